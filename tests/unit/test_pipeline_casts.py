"""Autocast's weight casts under micro-batches (``pipeline.cast_cache``), on pipelines in this process.

Lightning runs a step under ``torch.autocast(..., cache_enabled=False)``; the stages' forwards turn the cache on,
so each weight is cast once per batch instead of once per micro-batch, with bitwise the same gradients.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from lightning_3d.core import pipeline, torch_compat
from lightning_3d.core.pipeline import PipelineRuntime, StageSpec

M = 4  # micro-batches


class _WeightCasts(torch_compat.TorchDispatchMode):
    """Counts casts to bfloat16 of the given parameters (by storage)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count: collections.Counter[int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(src, torch.Tensor)
            and src.data_ptr() in self.ptrs
            and out.dtype == torch.bfloat16
        ):
            self.count[src.data_ptr()] += 1
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def _lightnings_autocast() -> torch.autocast:
    """The autocast Lightning's bf16-mixed runs every batch under (``MixedPrecision``: no cast cache)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def _step(world, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cache: bool) -> tuple[list, collections.Counter]:
    """One training batch of ``M`` micro-batches under Lightning's non-caching autocast; the gradients and the
    casts of each weight."""
    runtime = PipelineRuntime([StageSpec(0, model)], 1, world, torch.device("cpu"), "1f1b", _loss)
    if not cache:
        runtime._fsdp_sharded = lambda: True  # the stages are then built without the cache
    with _lightnings_autocast():  # the first batch runs torch's shape inference too (torch 2.11 checks its dtypes)
        runtime.run(x, y, M, ("x",), train=True)
    model.zero_grad(set_to_none=True)
    counter = _WeightCasts(list(model.parameters()))
    with _lightnings_autocast(), counter:
        runtime.run(x, y, M, ("x",), train=True)
    assert all(stage.cache_casts is cache for stage in torch_compat.schedule_stages(runtime.schedule(M, ("x",), True)))
    return [p.grad.clone() for p in model.parameters()], counter.count


def test_each_weight_is_cast_once_per_batch_with_the_same_gradients(world_of_one):
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    grads_cached, casts_cached = _step(world_of_one, _model(), x, y, cache=True)
    grads_plain, casts_plain = _step(world_of_one, _model(), x, y, cache=False)
    assert sorted(casts_plain.values()) == [M] * 4  # two weights, two biases: once per micro-batch
    assert sorted(casts_cached.values()) == [1] * 4  # once per batch
    assert all(torch.equal(a, b) for a, b in zip(grads_cached, grads_plain, strict=True))
    assert all(g.abs().sum() > 0 for g in grads_cached)  # every weight got its gradient through the shared cast


def test_the_cache_ends_with_the_batch_even_under_a_callers_caching_autocast(world_of_one):
    """Weights changed between two batches inside one outer autocast (which caches, unlike Lightning's): the second
    batch casts the new weights, so its gradients equal a fresh run's."""
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    model = _model()
    runtime = PipelineRuntime([StageSpec(0, model)], 1, world_of_one, torch.device("cpu"), "1f1b", _loss)
    with _lightnings_autocast():  # shape inference under the dtypes of the batches after it
        runtime.run(x, y, M, ("x",), train=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        model.zero_grad(set_to_none=True)
        runtime.run(x, y, M, ("x",), train=True)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5)
        model.zero_grad(set_to_none=True)
        runtime.run(x, y, M, ("x",), train=True)
    got = [p.grad.clone() for p in model.parameters()]
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(-0.5)
    expected, _ = _step(world_of_one, fresh, x, y, cache=False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_no_cache_for_evaluation_split_backward_or_outside_autocast(world_of_one):
    runtime = PipelineRuntime(
        [StageSpec(0, nn.Linear(4, 4)), StageSpec(1, nn.Linear(4, 4))],
        2,
        world_of_one,
        torch.device("cpu"),
        "interleavedzerobubble",
        _loss,
    )
    for train, name, cached in ((True, "interleaved1f1b", True), (True, None, False), (False, None, False)):
        sched = runtime.schedule(2, ("x",), train, name)
        assert [s.cache_casts for s in torch_compat.schedule_stages(sched)] == [cached, cached], (train, name)
    # the context itself: nothing without autocast (it turns none on) or without gradients
    with pipeline.cast_cache(True, torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with torch.no_grad(), pipeline.cast_cache(True, torch.device("cpu")):
            assert not torch.is_autocast_cache_enabled()
        with pipeline.cast_cache(True, torch.device("cpu")):
            assert torch.is_autocast_cache_enabled()
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()


def test_a_no_grad_use_inside_the_window_leaves_the_weight_its_gradient():
    """User code inside a stage's forward (the stage executor runs the whole step there) may run a weight under
    ``no_grad`` first: torch caches no cast made then, so the later use still reaches the weight."""
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with pipeline.cast_cache(True, torch.device("cpu")):
            with torch.no_grad():
                lin(x)
            loss = lin(x).float().sum()
    loss.backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
