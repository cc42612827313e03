"""``ThreeDSettings``: defaults, every validation message, immutability, the consistency items and the drift
between the settings, the Hydra schema derived from them and ``conf/strategy/3d.yaml``."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from lightning_3d.core.partition import UniformPartitioner
from lightning_3d.reliability import settings_items
from lightning_3d.settings import ThreeDSettings
from lightning_3d.strategy import ThreeDStrategy
from lightning_3d.train.config import StrategyConfig, strategy_schema

ROOT = Path(__file__).resolve().parents[2]
STRATEGY_YAML = ROOT / "conf" / "strategy" / "3d.yaml"
# The default job's layout (tp 2 x pp 2 x dp 2 on 8 processes): the only values the YAML file sets differently
# from ThreeDSettings' defaults.
JOB_CHOICES = {"tp": 2, "pp": 2, "micro_batches": 4}
NAMES = [f.name for f in dataclasses.fields(ThreeDSettings)]


def _error(**kwargs) -> str:
    with pytest.raises(ValueError) as err:
        ThreeDSettings(**kwargs)
    return str(err.value)


# ---------------------------------------------------------------------------------------------- defaults


def test_defaults():
    s = ThreeDSettings()
    assert (s.tp, s.pp, s.dp, s.schedule, s.stages_per_rank) == (1, 1, None, "1f1b", 1)
    assert (s.tp_plan, s.tp_autoplan, s.partitioner, s.body, s.blocks, s.seed) == (
        None,
        True,
        "uniform",
        None,
        None,
        None,
    )
    assert (s.timeout, s.train_timeout) == (timedelta(minutes=30), timedelta(minutes=10))
    assert (s.on_nonfinite, s.check_consistency, s.fail_fast) == ("raise", True, True)
    assert (s.process_group_backend, s.print_layout) == (None, True)
    assert s.compile is False and s.stages is None and s.activation_checkpointing is None
    assert s.data_parallel == "replicate" and s.dp_shard is None and s.grad_reduce_dtype is None
    assert NAMES[:4] == ["tp", "pp", "dp", "micro_batches"] and len(NAMES) == 30
    assert s.fsdp_reshard_after_forward is None and s.fsdp_reshard_after_backward is None and s.fsdp_unit == "block"
    assert s.loss_weighting == "auto" and s.split_backward == "linear"


def test_split_backward_names_are_checked_and_only_split_schedules_defer():
    with pytest.raises(ValueError, match=r"split_backward must be one of \('linear', 'autograd'\), got 'graph'"):
        ThreeDSettings(split_backward="graph")
    assert not ThreeDSettings(pp=2).defers_linear_weight_grads()  # 1F1B runs whole backwards
    zb = {"pp": 2, "stages_per_rank": 2, "schedule": "zbvzerobubble"}
    assert ThreeDSettings(**zb).defers_linear_weight_grads()
    assert not ThreeDSettings(**zb, split_backward="autograd").defers_linear_weight_grads()


def test_loss_weighting_names_are_checked():
    with pytest.raises(ValueError, match=r"loss_weighting must be one of \('auto', 'samples', 'labels'"):
        ThreeDSettings(loss_weighting="tokens")
    assert ThreeDSettings(loss_weighting="shifted_labels").loss_weighting == "shifted_labels"


def test_micro_batches_default_to_the_schedules_minimum():
    assert ThreeDSettings(pp=4).micro_batches == 4  # 1F1B: one in flight per stage
    assert ThreeDSettings(pp=4, schedule="gpipe").micro_batches == 1
    assert ThreeDSettings(pp=2, stages_per_rank=2, schedule="interleaved1f1b").micro_batches == 2
    assert ThreeDSettings(pp=4, micro_batches=8).micro_batches == 8
    assert ThreeDSettings(pp=2) == ThreeDSettings(pp=2, micro_batches=2)  # the same settings, resolved alike


def test_timeouts_are_seconds_or_timedelta():
    s = ThreeDSettings(timeout=45, train_timeout=2.5)
    assert (s.timeout, s.train_timeout) == (timedelta(seconds=45), timedelta(seconds=2.5))
    assert ThreeDSettings(timeout=timedelta(hours=1), train_timeout=None).train_timeout is None
    assert ThreeDSettings(timeout=None).timeout is None


def test_tp_plan_is_copied_and_empty_means_none():
    plan = {"*.q": "colwise"}
    s = ThreeDSettings(tp_plan=plan)
    plan["*.o"] = "rowwise"
    assert s.tp_plan == {"*.q": "colwise"}
    assert ThreeDSettings(tp_plan={}).tp_plan is None


def test_frozen():
    s = ThreeDSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tp = 2  # type: ignore[misc]
    assert dataclasses.replace(s, tp=2).tp == 2 and s.tp == 1


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "ThreeDStrategy: tp must be a positive integer, got 0."),
        ({"pp": -1}, "ThreeDStrategy: pp must be a positive integer, got -1."),
        ({"tp": "2"}, "ThreeDStrategy: tp must be a positive integer, got '2'."),
        ({"tp": True}, "ThreeDStrategy: tp must be a positive integer, got True."),
        ({"dp": 0}, "ThreeDStrategy: dp must be a positive integer or None, got 0."),
        ({"stages_per_rank": 0}, "ThreeDStrategy: stages_per_rank must be >= 1, got 0."),
        (
            {"pp": 2, "stages_per_rank": 2},
            "ThreeDStrategy(schedule='1f1b') runs one stage per rank; with stages_per_rank=2 use a multi-stage "
            "schedule such as 'interleaved1f1b'.",
        ),
        (
            {"schedule": "interleaved1f1b"},
            "ThreeDStrategy(schedule='interleaved1f1b') needs stages_per_rank >= 2 (with one stage per rank, "
            "'interleavedzerobubble' splits 1F1B's backwards to fill its bubble).",
        ),
        ({"micro_batches": 2.5}, "ThreeDStrategy: micro_batches must be an integer, got 2.5."),
        ({"tp_plan": ["*.q"]}, "ThreeDStrategy: tp_plan must be a mapping of module-name patterns to styles or None"),
        (
            {"partitioner": "zigzag"},
            "Unknown partitioner 'zigzag'; choose one of ['compute', 'memory', 'parameters', 'uniform']",
        ),
        (
            {"on_nonfinite": "ignore"},
            "ThreeDStrategy: on_nonfinite must be one of ('raise', 'skip', 'off'), got 'ignore'.",
        ),
    ],
)
def test_validation_messages(kwargs, message):
    assert message in _error(**kwargs)


def test_unknown_schedule_lists_torchs_names():
    text = _error(schedule="zigzag")
    assert "Unknown schedule name 'zigzag'" in text and "1F1B" in text


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_zero_micro_batches_is_refused_as_such(schedule):
    """Checked before the schedule's minimum: a count below 1 is wrong under every schedule."""
    text = _error(pp=4, schedule=schedule, micro_batches=0)
    assert text == "ThreeDStrategy: micro_batches must be >= 1, got 0."


def test_micro_batches_below_the_minimum_blames_the_schedule():
    text = _error(pp=4, micro_batches=2)
    assert text.startswith("ThreeDStrategy: micro_batches=2 < pp=4 under schedule='1f1b': that schedule keeps")
    assert "micro_batches >= 4" in text and "schedule='gpipe'" in text
    assert ThreeDSettings(pp=4, micro_batches=2, schedule="gpipe").micro_batches == 2  # GPipe takes any count


def test_zero_bubble_over_one_stage_per_rank_suggests_gpipe_below_its_minimum():
    """ZB-H1 (``interleavedzerobubble`` at ``stages_per_rank=1``) runs one stage per rank, as GPipe does."""
    text = _error(pp=4, schedule="interleavedzerobubble", micro_batches=2)
    assert "under schedule='interleavedzerobubble'" in text and "micro_batches >= 4" in text
    assert "schedule='gpipe'" in text
    assert ThreeDSettings(pp=4, micro_batches=2, schedule="gpipe").micro_batches == 2


def test_multi_stage_schedule_minimum_suggests_no_single_stage_schedule():
    text = _error(pp=2, stages_per_rank=2, schedule="interleaved1f1b", micro_batches=1)
    assert "under schedule='interleaved1f1b'" in text and "micro_batches >= 2" in text
    assert "gpipe" not in text  # GPipe runs one stage per rank: no way out with stages_per_rank=2


@pytest.mark.parametrize("name", ["timeout", "train_timeout"])
@pytest.mark.parametrize("value", [0, -1, "30", True, timedelta(seconds=-5)])
def test_timeouts_must_be_positive(name, value):
    text = _error(**{name: value})
    assert text == (
        f"ThreeDStrategy: {name} must be a positive number of seconds, a datetime.timedelta or None, got {value!r}."
    )


# ---------------------------------------------------------------------------------------------- the strategy


def test_strategy_keeps_one_settings_object():
    strategy = ThreeDStrategy(tp=2, pp=4, micro_batches=8, schedule="gpipe", body="net", seed=3, print_layout=False)
    s = strategy.settings
    assert s == ThreeDSettings(tp=2, pp=4, micro_batches=8, schedule="gpipe", body="net", seed=3, print_layout=False)
    views = (strategy.tp, strategy.pp, strategy.micro_batches, strategy.schedule, strategy.stages_per_rank)
    assert views == (2, 4, 8, "gpipe", 1)
    assert (strategy.body_name, strategy.seed, strategy.print_layout, strategy.tp_plan) == ("net", 3, False, None)
    assert isinstance(strategy.partitioner, UniformPartitioner) and strategy.tp_autoplan
    with pytest.raises(AttributeError):
        strategy.tp = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        strategy.settings = ThreeDSettings()  # type: ignore[misc]
    assert ThreeDStrategy(settings=s).settings is s


def test_strategy_refuses_unknown_or_doubled_settings():
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['tpp'\]; the settings are: tp, pp, dp, "):
        ThreeDStrategy(tpp=2)
    with pytest.raises(TypeError, match="either settings=ThreeDSettings"):
        ThreeDStrategy(settings=ThreeDSettings(), tp=2)
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        ThreeDStrategy(on_nonfinite="ignore")


# ---------------------------------------------------------------------------------------------- consistency items


def my_partitioner(layers, num_stages):  # a custom partitioner, hashed by its qualified name
    return UniformPartitioner()(layers, num_stages)


def test_every_field_is_compared_across_ranks():
    items = settings_items(ThreeDSettings())
    assert sorted(items) == sorted(f"strategy.{n}" for n in NAMES)
    assert items["strategy.train_timeout"] == "datetime.timedelta(seconds=600)"
    assert settings_items(ThreeDSettings(seed=1)) != settings_items(ThreeDSettings(seed=2))

    @dataclasses.dataclass(frozen=True)
    class MoreSettings(ThreeDSettings):
        blocks: int = 3

    assert settings_items(MoreSettings())["strategy.blocks"] == "3"  # a new field needs no listing


def test_callables_are_compared_by_qualified_name():
    text = settings_items(ThreeDSettings(partitioner=my_partitioner))["strategy.partitioner"]
    assert text == f"{__name__}.my_partitioner"
    first = settings_items(ThreeDSettings(partitioner=UniformPartitioner()))["strategy.partitioner"]
    second = settings_items(ThreeDSettings(partitioner=UniformPartitioner()))["strategy.partitioner"]
    assert first == second == "lightning_3d.core.partition.UniformPartitioner"  # no memory address


# ---------------------------------------------------------------------------------------------- schema and YAML


def _schema_defaults(schema: type = StrategyConfig) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(schema):
        out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def test_schema_has_every_setting_with_its_default():
    schema = _schema_defaults()
    assert schema.pop("_target_") == "lightning_3d.ThreeDStrategy"
    assert list(schema) == NAMES, "StrategyConfig and ThreeDSettings list different settings"
    # The schema's defaults are the settings' defaults in their command-line form.
    assert ThreeDSettings(**schema) == ThreeDSettings()
    assert (schema["timeout"], schema["train_timeout"], schema["tp_plan"]) == (1800.0, 600.0, {})


def test_yaml_lists_every_setting_field_by_field():
    conf = yaml.safe_load(STRATEGY_YAML.read_text())
    assert conf.pop("defaults") == ["schema_3d", "_self_"]
    schema = _schema_defaults()
    schema.pop("_target_")
    missing = [n for n in NAMES if n not in conf]
    assert not missing, f"{STRATEGY_YAML.name} lacks the settings {missing}"
    assert not set(conf) - set(NAMES), f"{STRATEGY_YAML.name} has keys that are not settings"
    for name in NAMES:
        expected = JOB_CHOICES.get(name, schema[name])
        assert conf[name] == expected, f"{STRATEGY_YAML.name}: {name}: {conf[name]!r}, expected {expected!r}"
    assert list(conf) == NAMES, "keep the YAML in the settings' order"


def test_a_setting_without_a_command_line_form_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Odd(ThreeDSettings):
        ranks: frozenset = frozenset()

    with pytest.raises(TypeError, match=re.escape("ThreeDSettings.ranks: type <class 'frozenset'> has no command")):
        strategy_schema(Odd)


def test_readme_documents_every_setting():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("`ThreeDStrategy(...)` arguments:", 1)[1].split("\n\n", 2)[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert documented == NAMES, "README's ThreeDStrategy argument table and ThreeDSettings differ"


def test_stages_are_checked_and_kept_as_tuples():
    s = ThreeDSettings(pp=2, stages=[["wte", "h.0"], ["h.1", "head"]])
    assert s.stages == (("wte", "h.0"), ("h.1", "head"))
    assert "must be a list of lists of module names" in _error(pp=2, stages=["h.0", "h.1"])
    assert "must be a list of lists of module names" in _error(pp=2, stages=[["h.0"], [1]])
    assert "stages has 2 lists but pp * stages_per_rank = 2 * 2 = 4 pipeline stages" in _error(
        pp=2, stages_per_rank=2, schedule="interleaved1f1b", stages=[["h.0"], ["h.1"]]
    )
    assert "stages and body cannot be combined" in _error(pp=2, body="net", stages=[["h.0"], ["h.1"]])
    assert "stages and partitioner='parameters' cannot be combined" in _error(
        pp=2, partitioner="parameters", stages=[["h.0"], ["h.1"]]
    )


def test_grad_reduce_dtype_is_checked():
    assert ThreeDSettings(grad_reduce_dtype="bf16").grad_reduce_dtype == "bf16"  # dp inferred: checked at launch
    assert ThreeDSettings(dp=2, grad_reduce_dtype="fp16", data_parallel="fsdp").grad_reduce_dtype == "fp16"
    assert "grad_reduce_dtype must be one of ('bf16', 'fp16') or None" in _error(grad_reduce_dtype="fp8")
    assert "grad_reduce_dtype must be one of" in _error(grad_reduce_dtype="bfloat16")
    message = _error(dp=1, grad_reduce_dtype="bf16")
    assert "grad_reduce_dtype='bf16'" in message and "dp=1: no gradient is reduced" in message
