"""The global gradient norm and clipping by it, against torch.nn.utils.clip_grad_norm_ on one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_3d.core.grad_norm import _is_tp_sharded, clip_grads_, global_grad_norm


def params_with_grads(*grads: list[float] | None) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g) if g is not None else 1))
        p.grad = torch.tensor(g) if g is not None else None
        params.append(p)
    return params


def test_two_norm_by_hand() -> None:
    params = params_with_grads([3.0, -4.0], [12.0], None)  # sqrt(9 + 16 + 144) = 13; the None grad is skipped
    norm = global_grad_norm(params, 2.0, tp_group=None, pp_group=None)
    assert float(norm) == pytest.approx(13.0)
    assert norm.dtype == torch.float64 and norm.dim() == 0


@pytest.mark.parametrize(("norm_type", "expected"), [(1.0, 19.0), (math.inf, 12.0), (3.0, (27 + 64 + 1728) ** (1 / 3))])
def test_other_norms_by_hand(norm_type: float, expected: float) -> None:
    params = params_with_grads([3.0, -4.0], [-12.0])
    assert float(global_grad_norm(params, norm_type, tp_group=None, pp_group=None)) == pytest.approx(expected)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.5])
def test_matches_torch_clip_grad_norm(norm_type: float) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2) * 10]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ours = global_grad_norm(params, norm_type, tp_group=None, pp_group=None)
    theirs = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"), norm_type=norm_type)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_no_gradients_give_zero() -> None:
    assert float(global_grad_norm(params_with_grads(None), 2.0, tp_group=None, pp_group=None)) == 0.0
    assert float(global_grad_norm([], math.inf, tp_group=None, pp_group=None)) == 0.0


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_clip_scales_like_torch(max_norm: float) -> None:
    torch.manual_seed(1)
    grads = [torch.randn(4, 4), torch.randn(3)]
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, ref, grads):
        a.grad, b.grad = g.clone(), g.clone()
    norm = global_grad_norm(ours, 2.0, tp_group=None, pp_group=None)
    clip_grads_(ours, max_norm, norm)
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    clipped = float(global_grad_norm(ours, 2.0, tp_group=None, pp_group=None))
    assert clipped == pytest.approx(min(max_norm, float(norm)), rel=1e-5)


def test_clip_by_hand_and_keeps_dtype() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    params[0].grad = torch.tensor([3.0, -4.0], dtype=torch.bfloat16)
    clip_grads_(params, 2.5, torch.tensor(5.0, dtype=torch.float64))
    assert params[0].grad.dtype == torch.bfloat16
    assert params[0].grad.float().tolist() == pytest.approx([1.5, -2.0], rel=1e-2)
    clip_grads_(params_with_grads(None), 1.0, torch.tensor(0.0))  # nothing to clip: no error


def test_single_rank_groups_change_nothing(gloo_world: dist.ProcessGroup) -> None:
    params = params_with_grads([3.0, -4.0], [12.0])
    for norm_type, expected in ((2.0, 13.0), (math.inf, 12.0)):
        norm = global_grad_norm(params, norm_type, tp_group=gloo_world, pp_group=gloo_world)
        assert float(norm) == pytest.approx(expected)


def test_only_shards_on_the_tp_dimension_count_as_tp_sharded(gloo_world: dist.ProcessGroup) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    full = torch.arange(4.0)
    assert _is_tp_sharded(distribute_tensor(full, mesh, [Replicate(), Shard(0)]))
    assert not _is_tp_sharded(distribute_tensor(full, mesh, [Shard(0), Replicate()]))
    assert not _is_tp_sharded(distribute_tensor(full, mesh, [Replicate(), Replicate()]))
    assert not _is_tp_sharded(full)
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate(), Shard(0)]))
    p.grad = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Replicate(), Shard(0)])
    q = params_with_grads([12.0])[0]
    assert float(global_grad_norm([p, q], 2.0, tp_group=gloo_world, pp_group=None)) == pytest.approx(13.0)


def test_scan_norms_are_reused_only_for_the_same_unchanged_gradient() -> None:
    from lightning_3d.core.grad_norm import ScanNorms

    params = params_with_grads([3.0, -4.0], [12.0])
    known = ScanNorms()
    # a planted norm (not the true 5) shows that clipping took the scan's value instead of reading the gradient
    known.record([params[0].grad], [torch.tensor(7.0)])
    norm = global_grad_norm(params, 2.0, tp_group=None, pp_group=None, known=known)
    assert float(norm) == pytest.approx(math.sqrt(49 + 144))
    assert float(global_grad_norm(params, 1.0, tp_group=None, pp_group=None, known=known)) == pytest.approx(19.0)
    params[0].grad.mul_(2.0)  # written in place after the scan: computed again
    assert float(global_grad_norm(params, 2.0, tp_group=None, pp_group=None, known=known)) == pytest.approx(
        math.sqrt(100 + 144)
    )
    known.record([params[1].grad], [torch.tensor(1.0)])
    params[1].grad = params[1].grad.clone()  # another tensor with the same values: computed again
    assert known.lookup(params[1].grad) is None
    known.clear()
    assert float(global_grad_norm(params, 2.0, tp_group=None, pp_group=None, known=known)) == pytest.approx(
        math.sqrt(100 + 144)
    )


@pytest.mark.parametrize("norm_type", [2, "inf", 1.5])
def test_grad_norm_equals_lightnings_on_plain_gradients(norm_type: float | str) -> None:
    """``lightning_3d.grad_norm`` gives Lightning's keys and values where Lightning's works (plain tensors)."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from lightning_3d import grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False))
    model(torch.randn(5, 4)).square().sum().backward()
    model[0].bias.grad = None  # a parameter without a gradient is left out by both
    ours, theirs = grad_norm(model, norm_type, group_separator="|"), lightning_grad_norm(model, norm_type, "|")
    assert list(ours) == list(theirs) and len(ours) == 3
    for key in ours:
        assert float(ours[key]) == pytest.approx(float(theirs[key]), rel=1e-6), key
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm(model, 0)


def test_grad_norm_reads_dtensor_gradients_whole(gloo_world: dist.ProcessGroup) -> None:
    """DTensor gradients (replicate, FSDP2, tp), on which Lightning's version fails: the whole gradient's norm, as a
    plain tensor."""
    from lightning_3d import grad_norm

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    layer = torch.nn.Linear(3, 2)
    grads = {"weight": torch.tensor([[3.0, 0.0, 4.0], [0.0, 0.0, 0.0]]), "bias": torch.tensor([12.0, 0.0])}
    for name, placement in (("weight", Shard(0)), ("bias", Replicate())):
        param = torch.nn.Parameter(distribute_tensor(getattr(layer, name).detach(), mesh, [placement]))
        param.grad = distribute_tensor(grads[name], mesh, [placement])
        setattr(layer, name, param)
    norms = grad_norm(layer, 2)
    assert {k: float(v) for k, v in norms.items()} == pytest.approx(
        {"grad_2.0_norm/weight": 5.0, "grad_2.0_norm/bias": 12.0, "grad_2.0_norm_total": 13.0}
    )
    assert not any(isinstance(v, DTensor) for v in norms.values())


def test_clip_by_value_clamps_plain_and_dtensor_gradients_together(gloo_world: dist.ProcessGroup) -> None:
    """A stage under tp holds both kinds; torch's ``clip_grad_value_`` refuses the mix (multi-tensor clamp)."""
    from lightning_3d.core.grad_norm import clip_grads_by_value_

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(torch.tensor([-5.0, 0.5, 2.0]), mesh, [Shard(0)])
    plain = params_with_grads([3.0, -0.25])[0]
    clip_grads_by_value_([sharded, plain, params_with_grads(None)[0]], 1.0)
    assert sharded.grad.full_tensor().tolist() == [-1.0, 0.5, 1.0]
    assert plain.grad.tolist() == [1.0, -0.25]
