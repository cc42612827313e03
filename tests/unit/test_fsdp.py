"""``data_parallel="fsdp"``: bad input refused before any collective, and the mixed-precision policy.

The numbers (parity with one process, one reduce-scatter per optimizer step, checkpoints across modes) are
checked by the multi-process tests in ``tests/test_fsdp.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from torch import nn

from lightning_3d import ThreeDStrategy
from lightning_3d.core.data_parallel import bucket_units
from lightning_3d.core.fsdp import fsdp_units, mixed_precision_policy
from lightning_3d.core.grad_norm import global_grad_norm
from lightning_3d.settings import ThreeDSettings


def test_fsdp_with_explicit_dp_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data_parallel='fsdp'.*dp=1: there is nothing to shard over"):
        ThreeDSettings(dp=1, data_parallel="fsdp")


def test_fsdp_with_inferred_dp_one_is_refused_when_the_trainer_is_built() -> None:
    """dp inferred from the world: refused in the launching process, before any rank starts."""
    with pytest.raises(ValueError, match=r"dp = world // \(tp \* pp\) = 4 // \(2 \* 2\) = 1"):
        L.Trainer(accelerator="cpu", devices=4, strategy=ThreeDStrategy(tp=2, pp=2, data_parallel="fsdp"), logger=False)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=ThreeDStrategy(pp=2, data_parallel="fsdp"), logger=False)
    assert trainer.strategy.topology.shape == (2, 2, 1)


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"data_parallel must be one of \('replicate', 'fsdp', 'hsdp'\), got 'zero3'\.$"
    ):
        ThreeDSettings(data_parallel="zero3")
    assert ThreeDSettings().data_parallel == "replicate"  # (hsdp's own checks: tests/unit/test_hsdp.py)


def test_mixed_precision_policy_follows_lightning_precision() -> None:
    bf16 = mixed_precision_policy(MixedPrecision("bf16-mixed", "cpu"))
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    for plugin in (Precision(), DoublePrecision()):
        policy = mixed_precision_policy(plugin)
        assert policy.param_dtype is None and policy.reduce_dtype is None


def test_grad_reduce_dtype_overrides_the_reduction_dtype_only() -> None:
    bf16_mixed = MixedPrecision("bf16-mixed", "cpu")
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = mixed_precision_policy(bf16_mixed, name)
        assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == dtype
        policy = mixed_precision_policy(Precision(), name)
        assert policy.param_dtype is None and policy.reduce_dtype == dtype
    with pytest.raises(ValueError, match="grad_reduce_dtype must be one of"):
        mixed_precision_policy(Precision(), "fp8")


def test_grad_reduce_dtype_with_inferred_dp_one_is_refused_when_the_trainer_is_built() -> None:
    """Refused in the launching process, before any collective, naming why (nothing is reduced)."""
    strategy = ThreeDStrategy(pp=2, grad_reduce_dtype="bf16")  # (fsdp at dp=1 is refused for its own reason)
    with pytest.raises(ValueError, match=r"grad_reduce_dtype='bf16'.*dp = world // \(tp \* pp\) = 2 // \(1 \* 2\) = 1"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy = ThreeDStrategy(pp=2, grad_reduce_dtype="fp16")
    assert L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False).strategy.topology.shape[0] == 2


def test_dp_group_of_one_changes_nothing(gloo_world: dist.ProcessGroup) -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    norm = global_grad_norm(params, tp_group=None, pp_group=None, dp_group=gloo_world)
    assert float(norm) == 5.0


def test_reshard_after_forward_setting_is_checked() -> None:
    assert ThreeDSettings(dp=2, data_parallel="fsdp", fsdp_reshard_after_forward=True).fsdp_reshard_after_forward
    assert ThreeDSettings(dp=4, data_parallel="hsdp", dp_shard=2, fsdp_reshard_after_forward=False) is not None
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward=False applies to data_parallel='fsdp' or 'hsdp'"):
        ThreeDSettings(fsdp_reshard_after_forward=False)
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward must be True, False or None, got 'yes'"):
        ThreeDSettings(dp=2, data_parallel="fsdp", fsdp_reshard_after_forward="yes")  # type: ignore[arg-type]


FSDP2 = {"dp": 2, "pp": 2, "data_parallel": "fsdp"}


def test_reshard_after_backward_defaults_and_implies_reshard_after_forward() -> None:
    assert ThreeDSettings().fsdp_reshard_after_backward is None
    on = ThreeDSettings(**FSDP2, fsdp_reshard_after_backward=True)
    assert on.fsdp_reshard_after_backward is True and on.fsdp_reshard_after_forward is True
    off = ThreeDSettings(**FSDP2, fsdp_reshard_after_backward=False)
    assert off.fsdp_reshard_after_forward is None  # today's choice (False under a pipeline)
    hsdp = ThreeDSettings(dp=4, data_parallel="hsdp", dp_shard=2, fsdp_reshard_after_backward=True)
    assert hsdp.fsdp_reshard_after_forward is True
    explicit = ThreeDSettings(**FSDP2, fsdp_reshard_after_backward=True, fsdp_reshard_after_forward=True)
    assert explicit == on
    for schedule, spr in (("gpipe", 1), ("interleaved1f1b", 2), ("loopedbfs", 2)):
        assert ThreeDSettings(**FSDP2, schedule=schedule, stages_per_rank=spr, fsdp_reshard_after_backward=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fsdp_reshard_after_backward": True},
         r"fsdp_reshard_after_backward=True applies to data_parallel='fsdp' or 'hsdp' only, but "
         r"data_parallel='replicate'\. Leave it None, or set data_parallel='fsdp' \(or 'hsdp'\): replicate holds "
         r"whole gradients"),
        ({"fsdp_reshard_after_backward": False}, r"fsdp_reshard_after_backward=False applies to data_parallel="),
        ({**FSDP2, "fsdp_reshard_after_backward": 1}, r"fsdp_reshard_after_backward must be True, False or None, "
                                                      r"got 1\.$"),
        ({**FSDP2, "fsdp_reshard_after_backward": True, "fsdp_reshard_after_forward": False},
         r"fsdp_reshard_after_backward=True with fsdp_reshard_after_forward=False: each unit would stay gathered "
         r"from its forward to its backward.*Leave fsdp_reshard_after_forward None"),
        ({**FSDP2, "fsdp_reshard_after_backward": True, "schedule": "zbvzerobubble", "stages_per_rank": 2,
          "micro_batches": 4},
         r"fsdp_reshard_after_backward=True with schedule='zbvzerobubble', which splits each backward into an "
         r"input-gradient and a later weight-gradient action.*Use a schedule with full backwards"),
        ({**FSDP2, "fsdp_reshard_after_backward": True, "schedule": "interleavedzerobubble", "stages_per_rank": 2},
         r"schedule='interleavedzerobubble', which splits each backward"),
        ({**FSDP2, "fsdp_reshard_after_backward": True, "schedule": "dualpipev", "stages_per_rank": 2,
          "micro_batches": 4},
         r"schedule='dualpipev', which splits each backward"),
    ],
)  # fmt: skip
def test_bad_reshard_after_backward_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreeDSettings(**kwargs)


def test_reshard_after_backward_refuses_a_csv_schedule_with_split_backwards(tmp_path) -> None:
    from lightning_3d.core.csv_schedule import write_zero_bubble_greedy_csv
    from lightning_3d.core.pipeline import write_csv_schedule

    split = write_zero_bubble_greedy_csv(2, 2, tmp_path / "zb.csv")
    with pytest.raises(ValueError, match=r"zb\.csv', which splits each backward"):
        ThreeDSettings(**FSDP2, schedule=str(split), fsdp_reshard_after_backward=True)
    full = write_csv_schedule("interleaved1f1b", 2, 2, 2, tmp_path / "i1f1b.csv")
    assert ThreeDSettings(**FSDP2, schedule=str(full), stages_per_rank=2, fsdp_reshard_after_backward=True)


# ------------------------------------------------------------------------------ fsdp_unit: what one unit holds


class _Attention(nn.Module):
    """Owns a parameter directly (``scale``) beside its children: a unit of its own after them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.attn = _Attention()
        self.act = nn.GELU()  # no parameters: no unit
        self.fc = nn.Linear(4, 4)


def _stage() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(8, 4), _Block(), _Block(), nn.Linear(4, 8, bias=False))


def test_block_units_are_the_blocks_by_the_bucket_rule() -> None:
    stage = _stage()
    blocks = [stage[1], stage[2]]
    assert fsdp_units(stage, blocks) == blocks == bucket_units(stage, blocks)
    stage[2].fc.weight = stage[0].weight  # a block sharing a weight with the embedding stays with the root
    assert fsdp_units(stage, blocks, "block") == [stage[1]]


def test_submodule_units_are_the_parameter_owners_children_first_then_nothing_left_for_the_block() -> None:
    stage = _stage()
    b1, b2 = stage[1], stage[2]
    expected = [b1.ln, b1.attn.q, b1.attn.out, b1.attn, b1.fc, b2.ln, b2.attn.q, b2.attn.out, b2.attn, b2.fc]
    assert fsdp_units(stage, [b1, b2], "submodule") == expected  # the blocks own nothing directly: no unit


def test_a_submodule_tied_outside_the_block_stays_with_the_root_and_the_block_too() -> None:
    stage = _stage()
    b1, b2 = stage[1], stage[2]
    b2.fc.weight = stage[0].weight  # tied to the embedding (outside the block)
    units = fsdp_units(stage, [b1, b2], "submodule")
    assert b2.fc not in units and b2 not in units  # both would split the tied weight from the embedding's unit
    assert units[-4:] == [b2.ln, b2.attn.q, b2.attn.out, b2.attn]  # the rest of the block is still split


def test_a_weight_shared_inside_a_block_and_a_direct_parameter_stay_with_the_block() -> None:
    stage = _stage()
    b1, b2 = stage[1], stage[2]
    b1.fc.weight = b1.attn.q.weight  # shared by two submodules of one block: neither is a unit, the block is
    b2.bias = nn.Parameter(torch.zeros(4))  # registered on the block itself
    units = fsdp_units(stage, [b1, b2], "submodule")
    # b1: q, fc and attn (which holds q) share the weight with a module outside them; the block holds it all
    assert units[:3] == [b1.ln, b1.attn.out, b1]
    assert units[3:] == [b2.ln, b2.attn.q, b2.attn.out, b2.attn, b2.fc, b2]  # the block after its submodules


def test_a_submodule_registered_twice_runs_twice_and_stays_with_the_block() -> None:
    stage = _stage()
    b1, b2 = stage[1], stage[2]
    b1.again = b1.fc  # registered under two names: called twice per forward
    units = fsdp_units(stage, [b1, b2], "submodule")
    assert b1.fc not in units and units[:4] == [b1.ln, b1.attn.q, b1.attn.out, b1.attn] and units[4] is b1
    listed_twice = fsdp_units(stage, [b1, b1, b2], "submodule")
    assert all(u is not b1 and u not in list(b1.modules()) for u in listed_twice)  # a block run twice: the root


def test_unknown_unit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fsdp_unit must be one of \('block', 'submodule'\), got 'layer'"):
        fsdp_units(_stage(), [], "layer")


def test_fsdp_unit_setting_is_checked() -> None:
    assert ThreeDSettings().fsdp_unit == "block" and ThreeDSettings(data_parallel="replicate", fsdp_unit="block")
    assert ThreeDSettings(**FSDP2, fsdp_unit="submodule").fsdp_unit == "submodule"
    hsdp = ThreeDSettings(
        dp=4, data_parallel="hsdp", dp_shard=2, fsdp_unit="submodule", fsdp_reshard_after_backward=True
    )
    assert hsdp.fsdp_unit == "submodule" and hsdp.fsdp_reshard_after_forward is True
    # it combines with activation checkpointing and compile (tested against one process in tests/test_fsdp.py)
    assert ThreeDSettings(**FSDP2, fsdp_unit="submodule", activation_checkpointing="full")
    assert ThreeDSettings(**FSDP2, fsdp_unit="submodule", compile={"backend": "aot_eager"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fsdp_unit": "submodule"},
         r"^ThreeDStrategy: fsdp_unit='submodule' applies to data_parallel='fsdp' or 'hsdp' only, but "
         r"data_parallel='replicate': replicate gathers no parameters \(every dp rank holds them whole\), so there is "
         r"no FSDP unit to split\. Leave fsdp_unit='block', or set data_parallel='fsdp' \(or 'hsdp'\)\.$"),
        ({**FSDP2, "fsdp_unit": "module"},
         r"^ThreeDStrategy: fsdp_unit must be one of \('block', 'submodule'\) \(what one FSDP unit holds: a block, or "
         r"each parameter-owning submodule of a block\), got 'module'\.$"),
        ({**FSDP2, "fsdp_unit": None}, r"fsdp_unit must be one of .*, got None\.$"),
    ],
)  # fmt: skip
def test_bad_fsdp_unit_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreeDSettings(**kwargs)
