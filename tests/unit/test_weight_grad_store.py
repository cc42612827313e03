"""The split backward's linear weight-gradient pass (``core/weight_grad_store.py``) against plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.utils.checkpoint import checkpoint

from lightning_3d.core import weight_grad_store as wgs


def _mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 5, bias=bias))


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("defer", [True, False])
def test_gradients_equal_autograd_whether_deferred_or_not(bias, defer):
    ref = _mlp(bias).double()
    model = copy.deepcopy(ref)
    undo = wgs.defer_linear_weight_grads([model])
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    g = torch.randn(3, 4, 5, dtype=torch.float64)
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).backward(g)
    with wgs.stage_pass() as counted:
        out = model(xm)
    assert counted[0] == 2  # both linear layers can defer
    torch.testing.assert_close(out, ref(x), rtol=0, atol=1e-14)
    if defer:
        with wgs.deferring() as kept:
            out.backward(g)
        assert len(kept) == 2 and model[0].weight.grad is None and model[3].weight.grad is None
        assert not any(t.requires_grad for _, *ts in kept for t in ts)  # kept without the graph
        assert model[2].weight.grad is not None  # the norm's gradient comes with the input's
        wgs.run_kept(kept)
        assert kept == []  # released as they run
    else:
        out.backward(g)
    (gx_ref, ref_grads), (gx, grads) = _grads(ref, xr), _grads(model, xm)
    assert grads.keys() == ref_grads.keys()
    assert not any(g.requires_grad for g in grads.values())  # gradients without a graph of their own
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-12)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-12, msg=name)
    undo()
    assert all(type(m) in (nn.Linear, nn.GELU, nn.LayerNorm, nn.Sequential) for m in model.modules())


def test_deferred_gradients_accumulate_onto_existing_ones():
    ref, model = _mlp(), _mlp()
    wgs.defer_linear_weight_grads([model])
    x = torch.randn(2, 6)
    for i in range(2):  # two micro-batches' worth: W adds to what the first left (in place: ``addmm_``)
        ref(x).sum().backward()
        with wgs.stage_pass():
            out = model(x)
        mine: list = []  # the second time, a list of one's own receives the kept products
        with wgs.deferring(mine if i else None) as kept:
            out.sum().backward()
        assert len(kept) == 2 and (kept is mine) == bool(i)
        wgs.run_kept(kept)
        assert kept == []  # each product released once added
    with wgs.deferring() as kept:  # outside a stage's forward: plain F.linear, nothing kept
        model(x).sum().backward()
    ref(x).sum().backward()
    assert kept == []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_autocast_matches_autocast_of_plain_linear():
    ref = _mlp()
    model = copy.deepcopy(ref)
    wgs.defer_linear_weight_grads([model])
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16), wgs.stage_pass():
        out_ref, out = ref(x), model(x)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out_ref.float().square().sum().backward()
    with wgs.deferring() as kept:
        out.float().square().sum().backward()
    assert len(kept) == 2
    wgs.run_kept(kept)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_outputs_can_be_modified_in_place():
    """The caller may modify a layer's output in place, as it may ``F.linear``'s (with a bias, ``F.linear``'s 3-D
    output is a view, which made inside a custom function could not be)."""
    ref, model = _mlp(), _mlp()
    wgs.defer_linear_weight_grads([model])
    x = torch.randn(2, 3, 6)
    with wgs.stage_pass():
        out = model[0](x)
    assert out.shape == (2, 3, 8)
    out += 1
    with wgs.stage_pass():
        y = model(x)
    y.mul_(2)
    with wgs.deferring() as kept:
        y.sum().backward()
    wgs.run_kept(kept)
    (ref(x) * 2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_layers_that_cannot_defer_take_plain_linear():
    model = _mlp()
    wgs.defer_linear_weight_grads([model])
    model[0].weight.requires_grad_(False)  # frozen: nothing to keep
    x = torch.randn(2, 6)
    with wgs.stage_pass() as counted, wgs.deferring() as kept:
        model(x).sum().backward()
        with torch.no_grad():
            model(x)
    assert counted[0] == 1 and len(kept) == 1 and model[0].weight.grad is None
    shared = nn.Linear(6, 6)
    derived = nn.Linear(6, 6)
    del derived.weight
    derived.weight = shared.weight * 2  # a weight computed from another: its gradient must flow on to ``shared``
    wgs.defer_linear_weight_grads([derived])
    with wgs.stage_pass() as counted, wgs.deferring() as kept:
        derived(x).sum().backward()
    assert counted[0] == 0 and kept == [] and shared.weight.grad is not None
    seen: list[torch.Tensor] = []
    model[3].weight.register_hook(lambda g: seen.append(g))  # a hook waits for this weight's gradient: not deferred
    model[0].weight.requires_grad_(True)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    with wgs.stage_pass() as counted, wgs.deferring() as kept:
        model(x).sum().backward()
    assert counted[0] == 0 and kept == [] and len(seen) == 2


def test_only_plain_linear_forwards_are_routed():
    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    compiled = nn.Linear(2, 2)
    compiled.forward = lambda x: x  # a forward set on the instance (as compile_blocks does) is left alone
    block = nn.Sequential(nn.Linear(2, 2))
    block.forward = lambda x: x  # ... and so are the layers of a block whose forward is (a compiled block)
    model = nn.Sequential(nn.Linear(2, 2), Custom(2, 2), compiled, block)
    assert wgs.deferrable_layers(model) == [model[0]]
    undo = wgs.defer_linear_weight_grads([model], enabled=False)
    assert not wgs.is_deferrable(model)
    undo()
    undo = wgs.defer_linear_weight_grads([model])
    # the class is swapped (nothing set on the instance: an instance forward marks a compiled block), still a Linear
    assert wgs.is_deferrable(model) and "forward" not in model[0].__dict__ and type(model[0]) is not nn.Linear
    assert isinstance(model[0], nn.Linear) and type(model[0]).__name__ == "Linear" and type(model[1]) is Custom
    assert wgs.deferrable_layers(model) == []  # routed once
    undo()
    assert not wgs.is_deferrable(model) and type(model[0]) is nn.Linear and "forward" in compiled.__dict__


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class _Checkpointed(nn.Module):
    """``inner`` under torch's non-reentrant activation checkpoint (recomputed in the backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize(("defer", "checkpointed"), [(True, False), (False, False), (True, True)])
def test_zbv_stages_on_one_rank_give_one_device_gradients(world_of_one, defer, checkpointed, monkeypatch):
    """Both V stages of a world of one run ZB-V's F / I / W actions; the gradients equal one whole backward. Under
    activation checkpointing the recomputation in ``I`` takes the forward's path (the same saved tensors)."""
    ran: list[int] = []
    real = wgs.run_kept
    monkeypatch.setattr(wgs, "run_kept", lambda kept: (ran.append(len(kept)), real(kept)))
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    ref = copy.deepcopy(full)
    first, second = full[:2], full[2:]
    if checkpointed:
        first, second = _Checkpointed(first), _Checkpointed(second)
    wgs.defer_linear_weight_grads([first, second], enabled=defer)
    device = torch.device("cpu")
    stages = [wgs.WeightGradStage(mod, i, 2, device, group=world_of_one) for i, mod in enumerate((first, second))]
    n_micro = 4
    schedule = ScheduleZBVZeroBubble(stages, n_micro, loss_fn=_loss, scale_grads=False)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    schedule.step(x, target=y)
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro), strict=True):  # scale_grads=False: summed micro-batch means
        _loss(ref(xs), ys).backward()
    for (name, p), q in zip(full.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    assert all(not s._deferred_chunks for s in stages)  # every W ran
    # deferred: stage 1's W ran the kept products of its micro-batches (2 layers each); stage 0 keeps torch's split
    # (its I skipped, its W one whole backward)
    assert ran == ([2] * n_micro if defer else [])
    assert not stages[0]._defers and stages[1]._defers == defer


def test_tensor_parallel_layers_defer_on_their_shards(world_of_one):
    """Column- and row-parallel layers (DTensor weights and inputs) keep their products too; their weight gradients
    are DTensors laid out as the weights, equal to plain autograd's (a mesh of one rank: the DTensor code paths)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5)).double()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    wgs.defer_linear_weight_grads([model])
    x, g = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    ref(x).backward(g)
    with wgs.stage_pass() as counted:
        out = model(x)
    with wgs.stage_pass(), wgs.deferring() as kept:
        out.backward(g)
    assert counted[0] == 2 and len(kept) == 2 and model[0].weight.grad is None
    wgs.run_kept(kept)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=1e-12, msg=name)
