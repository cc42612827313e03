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

from lightning_3d import ThreeDStrategy
from lightning_3d.core.fsdp import mixed_precision_policy
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
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward applies to data_parallel='fsdp' only"):
        ThreeDSettings(fsdp_reshard_after_forward=False)
    with pytest.raises(ValueError, match="must be True, False or None"):
        ThreeDSettings(dp=2, data_parallel="fsdp", fsdp_reshard_after_forward="yes")  # type: ignore[arg-type]
