"""The Hydra command line ``python -m lightning_3d.train``: configs, errors, runs, sweeps.

In-process tests compose ``conf/`` with Hydra's compose API (no process starts). The multi-process tests go
through ``tests/launch.py`` (hard time limit) with ``scripts/cli_main.py``, which is ``python -m
lightning_3d.train``; each writes into its own ``hydra.run.dir`` under pytest's ``tmp_path``.
Whole file: about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import csv
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lightning_3d.core.runner import micro_batch_mismatch
from lightning_3d.train.app import CONF_DIR, ConfigurationError, _register_resolvers, build
from lightning_3d.train.config import register_configs
from lightning_3d_examples import PRESETS

from launch import run_lightning

CLI = "cli_main.py"
FAST_FAIL_SECONDS = 30  # a bad config must be refused before any process starts: imports plus composition
# The final layout of the loss test: all three parallelisms at once on 8 CPU processes.
LAYOUT_3D = {"tp": 2, "pp": 2, "dp": 2}


def _compose(overrides: list[str] | None = None):
    register_configs()
    _register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides or [])


def _resolved(tmp_path: Path, overrides: list[str]):
    cfg = _compose(overrides)
    cfg.run_dir = str(tmp_path)  # ${hydra:runtime.output_dir} exists only inside a Hydra run
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def _val_losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+): .*?val_loss (\d+\.\d+)", output)}


def _csv_column(path: Path, key: str) -> dict[int, float]:
    with open(path) as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


# ------------------------------------------------------------------------------------------------ configs


def test_default_config_is_the_documented_job():
    cfg = _compose()
    s, t = cfg.strategy, cfg.trainer
    assert (s._target_, s.tp, s.pp, s.dp, s.micro_batches) == ("lightning_3d.ThreeDStrategy", 2, 2, None, 4)
    assert (t.accelerator, t.devices, t.precision, t.enable_checkpointing) == ("cpu", 8, "32-true", True)
    assert (cfg.model._target_, cfg.model.preset) == ("lightning_3d_examples.GPT", "small")
    assert cfg.data._target_ == "lightning_3d_examples.ByteTextDataModule"
    assert cfg.data.batch_size % s.micro_batches == 0


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "large", "xl"])
def test_gpt_preset_files_match_the_examples(name):
    model = _compose([f"model=gpt_{name}"]).model
    assert model.preset == name
    for field, value in vars(PRESETS[name]).items():
        assert model[field] == value, f"conf/model/gpt_{name}.yaml: {field}={model[field]}, PRESETS has {value}"


def test_mlp_selects_blobs_and_interpolates_shapes():
    cfg = _compose(["model=mlp", "model.num_classes=3"])
    assert cfg.data._target_ == "lightning_3d_examples.BlobsDataModule"
    assert cfg.data.num_classes == 3


def test_gpu_preset():
    t = _compose(["trainer=gpu"]).trainer
    assert (t.accelerator, t.devices, t.precision) == ("gpu", "auto", "bf16-mixed")


def test_lr_schedule_follows_max_steps():
    assert _compose(["trainer.max_steps=120"]).model.max_steps == 120
    assert _compose(["trainer.max_steps=-1"]).model.max_steps is None  # unlimited: constant LR


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("strategy.tpp=2", "Key 'tpp' not in 'StrategyConfig'"),
        ("strategy.tp=two", "could not be converted to Integer"),
        ("model.n_layr=3", "Key 'n_layr' not in 'GPTModelConfig'"),
        ("trainer.max_step=3", "Key 'max_step' not in 'TrainerConfig'"),
    ],
)
def test_schema_rejects_typos_and_wrong_types(override, reason):
    with pytest.raises(ConfigCompositionException) as err:
        _compose([override])
    assert reason in str(err.value) + str(err.value.__cause__)


def test_layout_that_does_not_fit_is_refused_at_build(tmp_path):
    cfg = _resolved(tmp_path, ["strategy.tp=1", "strategy.pp=3"])  # 3 does not divide 8 devices
    with pytest.raises(ConfigurationError, match=r"ThreeDStrategy: tp \* pp = 1 \* 3 = 3 does not divide"):
        build(cfg)


# Every setting that is not a layout choice, away from its default; the fast in-process test and the run below.
SETTINGS_OVERRIDES = [
    "strategy.on_nonfinite=skip",
    "strategy.train_timeout=120",
    "strategy.fail_fast=false",
    "strategy.check_consistency=false",
]
SMALL_JOB = [
    "model=gpt_tiny",
    "trainer.devices=2",
    "strategy.tp=1",
    "strategy.pp=2",
    "strategy.micro_batches=2",
    "data.batch_size=4",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
]


def test_settings_from_the_command_line_reach_the_strategy(tmp_path):
    overrides = [*SMALL_JOB, *SETTINGS_OVERRIDES, "strategy.timeout=90.5", "++strategy.tp_plan={*.mlp.fc:colwise}",
                 "++strategy.stages=[[body.0,body.1],[body.2,body.3]]"]  # fmt: skip
    trainer, _, _ = build(_resolved(tmp_path, overrides))
    s = trainer.strategy.settings
    assert (s.on_nonfinite, s.fail_fast, s.check_consistency) == ("skip", False, False)
    assert (s.timeout, s.train_timeout) == (timedelta(seconds=90.5), timedelta(seconds=120))
    assert (s.tp, s.pp, s.micro_batches, s.tp_plan) == (1, 2, 2, {"*.mlp.fc": "colwise"})
    assert s.stages == (("body.0", "body.1"), ("body.2", "body.3"))


@pytest.mark.parametrize(
    ("overrides", "total", "micro_batches", "minimum"),
    [
        (["data.batch_size=3"], 3, 4, 2),  # the default job: micro_batches 4 under 1F1B at pp 2
        (["strategy.micro_batches=null", "strategy.pp=4", "strategy.tp=1", "data.batch_size=6"], 6, 4, 4),
    ],
)
def test_batch_that_micro_batches_do_not_divide_is_refused_at_build(tmp_path, overrides, total, micro_batches, minimum):
    """The strategy's own message (the one the first training step would raise on every rank), before any
    process starts; micro_batches=null resolves as the strategy resolves it (the schedule's minimum)."""
    with pytest.raises(ConfigurationError) as err:
        build(_resolved(tmp_path, overrides))
    assert str(err.value) == f"ValueError: {micro_batch_mismatch(total, micro_batches, minimum)}"
    assert "\n" not in str(err.value)
    trainer, _, _ = build(
        _resolved(tmp_path, [*overrides[:-1], f"data.batch_size={total + micro_batches - total % micro_batches}"])
    )
    assert trainer.strategy.micro_batches == micro_batches


@pytest.mark.parametrize(
    ("overrides", "shape", "dtype"),
    [
        (["model=gpt_tiny", "data.batch_size=8", "strategy.micro_batches=4"], (2, 32), torch.long),
        (["model=hf_llama", "model.preset=tiny", "data.batch_size=6", "strategy.micro_batches=2"], (3, 64), torch.long),
        (["model=mlp", "data.batch_size=8", "strategy.micro_batches=8"], (1, 16), torch.float32),
        (["model=gpt_tiny", "model.example_batch=5"], (5, 32), torch.long),  # the user's choice stays
        # the CSV list's micro-batch count (micro_batches=null takes it from the file)
        (["model=gpt_tiny", "strategy.tp=4", "strategy.micro_batches=null", "strategy.stages_per_rank=2",
          f"strategy.schedule={CONF_DIR / 'schedules' / 'zbv_pp2_m4.csv'}", "data.batch_size=8"], (2, 32), torch.long),
    ],
)  # fmt: skip
def test_examples_get_one_micro_batch_as_their_example_input(tmp_path, overrides, shape, dtype):
    """The app gives the example models an ``example_input_array`` of the job's micro-batch (data.batch_size //
    micro_batches), so ``strategy.partitioner=compute`` / ``memory`` run from the command line."""
    _, model, _ = build(_resolved(tmp_path, overrides))
    example = model.example_input_array
    assert (tuple(example.shape), example.dtype) == (shape, dtype)


# ------------------------------------------------------------------------------------------------ runs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("strategy.tpp=2", "Key 'tpp' not in 'StrategyConfig'"),
        ("strategy.tp=two", "Value 'two' of type 'str' could not be converted to Integer"),
        ("strategy.pp=3", "ThreeDStrategy: tp * pp = 2 * 3 = 6 does not divide the world size 8."),
        ("data.batch_size=3", "ThreeDStrategy: the training batch has 3 samples per data-parallel replica"),
    ],
)
def test_bad_override_fails_fast_with_one_line(tmp_path, override, reason):
    job = run_lightning(CLI, [override, f"hydra.run.dir={tmp_path}"], timeout=60, check=False)
    assert job.returncode != 0
    assert job.seconds < FAST_FAIL_SECONDS, f"took {job.seconds:.0f}s"
    lines = [line for line in job.output.splitlines() if reason in line]
    assert lines, job.tail()
    assert "Traceback" not in job.output, job.tail()
    assert "Starting with" not in job.output and "distributed_backend" not in job.output  # no process started


@pytest.mark.slow
def test_cli_trains_with_overrides(tmp_path):
    """tp, pp, dp, micro_batches, the partitioner, the model preset and max_steps all come from the command line
    (the memory partitioner profiles the example's micro-batch the app gives it, and prints each stage's peak)."""
    args = [
        "model=gpt_tiny",
        "strategy.tp=2",
        "strategy.pp=2",
        "strategy.dp=1",
        "strategy.micro_batches=2",
        "strategy.partitioner=memory",
        "timeline.enabled=true",
        "data.batch_size=4",
        "trainer.devices=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "sample.max_new_tokens=16",
        f"hydra.run.dir={tmp_path}",
    ]
    job = run_lightning(CLI, args, timeout=120)
    out = job.output
    assert "world=4 = dp 1 x pp 2 x tp 2" in out, job.tail()
    assert "2 micro-batches per batch" in out
    assert len(re.findall(r"^  stage \d on pp rank \d: body\[.*\] \([\d.]+ [KM]iB peak", out, re.M)) == 2, job.tail(60)
    # the activations each stage holds under the job's schedule: 1F1B at m = 2 keeps 2 on stage 0, 1 on stage 1
    held = re.findall(
        r"^  stage (\d) on pp rank \d: .* activations of (\d) micro-batch(?:es)? in flight under 1f1b\)", out, re.M
    )
    assert held == [("0", "2"), ("1", "1")], job.tail(60)
    assert re.search(r"^  micro_batches: 2$", out, re.M), "resolved config not printed"
    assert out.count("lightning_3d layout:") == 1  # rank 0 only
    # the pipeline timeline of step 1 (timeline.enabled=true): its trace holds every stage's forwards and backwards
    assert re.search(r"timeline of step 1: bubble [\d.]+% measured vs [\d.]+% in theory", out), job.tail(60)
    trace = json.loads((tmp_path / "timeline" / "timeline_step1.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"F0", "F1", "B0", "B1"} <= names, sorted(names)
    assert "model GPT: 42,880 parameters" in out  # the tiny preset, counted whole (not rank 0's shard)
    assert re.search(r"sample \(temperature .*\n-+\ndef ", out), "no text sample"
    assert re.search(r"throughput: \d+ tokens/s", out)
    assert sorted(_val_losses(out)) == [2, 4]
    metrics = tmp_path / "csv" / "metrics.csv"
    assert len(_csv_column(metrics, "train_loss")) == 4
    assert _csv_column(metrics, "tokens_per_sec")
    assert (tmp_path / "job.yaml").is_file()
    assert any((tmp_path / "checkpoints").iterdir()), "no checkpoint written"


@pytest.mark.slow
def test_cli_takes_every_setting(tmp_path):
    """Settings the schema once lacked (``on_nonfinite``, ``train_timeout``, ``fail_fast``, ``check_consistency``)
    from the command line, into a job that trains; every rank trains from the recorded ``job.yaml``."""
    job = run_lightning(CLI, [*SMALL_JOB, *SETTINGS_OVERRIDES, f"hydra.run.dir={tmp_path}"], timeout=120)
    out = job.output
    assert "done: 3 steps" in out, job.tail()
    for line in ("on_nonfinite: skip", "train_timeout: 120.0", "fail_fast: false", "check_consistency: false"):
        assert re.search(rf"^  {line}$", out, re.M), f"resolved config lacks {line!r}"
    recorded = yaml.safe_load((tmp_path / "job.yaml").read_text())["strategy"]
    assert (recorded["on_nonfinite"], recorded["train_timeout"]) == ("skip", 120.0)
    assert (recorded["fail_fast"], recorded["check_consistency"]) == (False, False)


@pytest.mark.slow
def test_error_every_rank_raises_is_printed_once(tmp_path):
    """A checkpoint that does not exist: every rank raises the same error in ``load_checkpoint``. Rank 0 prints
    its traceback; the other rank prints one line (the fail-fast watch's) and no traceback."""
    missing = tmp_path / "missing.ckpt"
    args = [*SMALL_JOB, f"ckpt_path={missing}", "print_config=false", f"hydra.run.dir={tmp_path}"]
    job = run_lightning(CLI, args, timeout=120, check=False)
    out = job.output
    assert job.returncode != 0, job.tail()
    message = f"FileNotFoundError: lightning_3d: checkpoint '{missing}' does not exist."
    assert out.count("Traceback") == 1 and out.count(message) == 3, job.tail(40)  # rank 0: watch + traceback
    rank1 = [line for line in out.splitlines() if line.startswith("[rank 1]") or line.startswith("[rank1]")]
    assert rank1 == [
        "[rank 1] lightning_3d: rank 1 (dp 0, stage 1 of 2, tp 0) failed at global step 0 with the error every "
        f"rank raised (in full on rank 0): {message}"
    ], rank1


@pytest.mark.slow
def test_multirun_runs_each_layout_in_its_own_processes(tmp_path):
    """Two jobs in one Python process: the second must not reuse the first's process group or port."""
    args = [
        "--multirun",
        "model=mlp",
        "strategy.tp=1",
        "strategy.pp=1,2",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        f"hydra.sweep.dir={tmp_path}",
    ]
    # launch.py sets MASTER_PORT: both jobs get the same port, so a leftover store of job 0 would break job 1.
    job = run_lightning(CLI, args, timeout=120)
    out = job.output
    assert "world=2 = dp 2 x pp 1 x tp 1" in out and "world=2 = dp 1 x pp 2 x tp 1" in out, job.tail()
    assert len(re.findall(r"done: 4 steps", out)) == 2
    assert "samples/s" in out and "sample (" not in out  # an MLP: samples, no text
    for num in (0, 1):
        (run_dir,) = tmp_path.glob(f"{num}_*")
        assert _csv_column(run_dir / "csv" / "metrics.csv", "val_loss")
        assert yaml.safe_load((run_dir / "job.yaml").read_text())["strategy"]["pp"] == num + 1


@pytest.mark.slow
def test_torchrun_creates_the_processes(tmp_path):
    """``torchrun --nproc-per-node 4 -m lightning_3d.train ...``: every rank composes; rank 0 alone reports."""
    args = [
        "4",
        "model=gpt_tiny",
        "strategy.tp=2",
        "strategy.pp=2",
        "trainer.devices=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "sample.max_new_tokens=16",
        f"hydra.run.dir={tmp_path}",
    ]
    job = run_lightning("cli_torchrun.py", args, timeout=120)
    out = job.output
    assert out.count("lightning_3d layout: world=4 = dp 1 x pp 2 x tp 2") == 1, job.tail()
    assert len(re.findall(r"^strategy:$", out, re.M)) == 1  # the config, printed by rank 0 only
    assert "done: 4 steps" in out and "sample (" in out
    assert sorted(_val_losses(out)) == [2, 4]


@pytest.mark.slow
def test_gpt_loss_drops_under_3d_parallelism(tmp_path):
    """Fixed seed, tp=2 x pp=2 x dp=2: the loss falls from ln(256) by more than 1.5 nats in 30 steps.

    Measured (seed 7, lr 5e-3 without warm-up): train loss 5.54 at step 0; validation loss 4.01, 3.49 and
    3.39 at steps 10, 20 and 30. The margins below are about 70% and 50% of the measured drops.
    """
    tp, pp, dp = LAYOUT_3D["tp"], LAYOUT_3D["pp"], LAYOUT_3D["dp"]
    args = [
        "model=gpt_tiny",
        f"strategy.tp={tp}",
        f"strategy.pp={pp}",
        f"strategy.dp={dp}",
        f"trainer.devices={tp * pp * dp}",
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        "trainer.enable_checkpointing=false",
        "sample.enabled=false",
        "seed=7",
        "model.lr=5e-3",
        "model.warmup_steps=0",
        f"hydra.run.dir={tmp_path}",
    ]
    job = run_lightning(CLI, args, timeout=180)
    assert f"world={tp * pp * dp} = dp {dp} x pp {pp} x tp {tp}" in job.output, job.tail()
    val = _val_losses(job.output)
    train = _csv_column(tmp_path / "csv" / "metrics.csv", "train_loss")
    assert sorted(val) == [10, 20, 30], job.tail()
    assert train[0] > 5.3  # ln(256) = 5.55: bytes are near-uniform at initialisation
    assert val[10] > val[20] > val[30], val
    assert val[30] < train[0] - 1.5, (train[0], val)  # measured drop: 2.15
    assert val[30] < val[10] - 0.3, val  # measured: 0.62


@pytest.mark.slow
def test_hf_llama_from_the_command_line(tmp_path):
    """``model=hf_llama``: an unmodified Hugging Face LlamaForCausalLM split at ``model.model.layers`` (its own
    pipeline plan) and sharded with its own tensor-parallel plan, trained from the command line at tp2 x pp2; the
    compute partitioner times its blocks on the micro-batch the app gives the example (each stage's time printed).
    Its embedding and LM head are tied: the sample at the end loads ``full_state_dict()`` into a plain copy of the
    model, which needs the head's key as well as the embedding's."""
    args = [
        "model=hf_llama",
        "model.preset=tiny",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "model.tie_word_embeddings=true",
        "strategy.tp=2",
        "strategy.pp=2",
        "strategy.micro_batches=2",
        "strategy.partitioner=compute",
        "data.batch_size=4",
        "trainer.devices=4",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "sample.max_new_tokens=8",
        f"hydra.run.dir={tmp_path}",
    ]
    job = run_lightning(CLI, args, timeout=180)
    out = job.output
    assert "done: 4 steps" in out, job.tail()
    assert "model.model.layers[0] (hugging face pp plan)" in out and "model.model.layers[1]" in out, job.tail(60)
    assert out.count("ms fwd+bwd per micro-batch, measured)") == 2, job.tail(60)
    assert "tied across stages: model.model.embed_tokens.weight = model.lm_head.weight" in out, job.tail(60)
    assert re.search(r"model\.model\.layers\.0\.self_attn\.q_proj\s+colwise", out), job.tail(60)
    assert "sample (" in out, job.tail()
