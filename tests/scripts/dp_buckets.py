"""Bucketed data-parallel gradient reduction through the pipeline runtime (run with 2 ranks, gloo, float64).

A Sequential of four Linears (the last one's weight tied to the first's) and parameter-free activations is
wrapped by ``apply_data_parallel`` with its layers as blocks and run through ``PipelineRuntime`` (one stage,
1F1B, 4 micro-batches) for two batches of one accumulation window: the first defers the gradient sync, the
second syncs. Checked on every rank:

* with per-block buckets (NCCL's choice, forced here) the two untied Linears are buckets of their own and the tied
  pair stays with the root: 3 buckets; gloo's own choice is one bucket for the whole stage;
* the deferred batch issues no all-reduce; the syncing batch issues exactly one per bucket, every one of them
  while the last micro-batch's backward runs (none before it, none after it);
* the gradients equal the average over the ranks of a plain single-process model's gradients accumulated over
  both batches (all-reduced by hand), the tied weight included.

Raises (exit code != 0) on any mismatch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_3d.core import torch_compat
from lightning_3d.core.data_parallel import apply_data_parallel, gradient_buckets
from lightning_3d.core.pipeline import PipelineRuntime, StageSpec

MICRO, BATCH, WIDTH = 4, 8, 16


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def build() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    layers += [nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers).double()
    model[6].weight = model[0].weight  # tied: one parameter in two layers
    return model


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    reference = build()  # the same weights, no data parallelism
    model = build()
    # per-block buckets (NCCL's choice) forced on gloo: what runs on a GPU, checked here on CPU
    model = apply_data_parallel(
        model, mesh["dp"], blocks=list(torch_compat.child_modules(model).values()), per_block=True
    )
    plain = build()
    single = apply_data_parallel(plain, mesh["dp"], blocks=list(torch_compat.child_modules(plain).values()))
    assert gradient_buckets(single) == 1, "gloo's own choice: one bucket for the stage"
    buckets = gradient_buckets(model)
    assert buckets == 3, f"expected 3 buckets (two Linears and the root with the tied pair), got {buckets}"

    events: list[Any] = []

    class Collectives(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = torch_compat.op_name(func)
            if "allreduce" in name or "all_reduce" in name:
                events.append("allreduce")
            return func(*args, **(kwargs or {}))

    runtime = PipelineRuntime(
        [StageSpec(0, model)], 1, mesh["pp"].get_group(), torch.device("cpu"), "1f1b", loss_fn=mse
    )
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2)]
    targets = [torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2)]
    sched = runtime.schedule(MICRO, ("x",), True)
    for stage in torch_compat.schedule_stages(sched):

        def wrapper(real: Any) -> Any:
            def backward(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
                events.append(("start", last_backward))
                try:
                    return real(backward_type, bwd_kwargs, last_backward)
                finally:
                    events.append(("end", last_backward))

            return backward

        torch_compat.wrap_method(stage, "backward_maybe_with_nosync", wrapper)

    per_batch = []
    for i, (x, y) in enumerate(zip(batches, targets)):
        events.clear()
        with Collectives():
            runtime.run(x, y, MICRO, ("x",), True, defer_grad_sync=i == 0)
        per_batch.append(list(events))

    deferred, synced = per_batch
    assert "allreduce" not in deferred, f"the deferred batch all-reduced: {deferred}"
    assert synced.count("allreduce") == buckets, f"expected {buckets} all-reduces, got {synced}"
    last_start = synced.index(("start", True))
    last_end = synced.index(("end", True))
    outside = [i for i, e in enumerate(synced) if e == "allreduce" and not last_start < i < last_end]
    assert not outside, f"all-reduces outside the last micro-batch's backward: {synced}"
    starts = [e for e in synced if isinstance(e, tuple) and e[0] == "start"]
    assert len(starts) == MICRO and starts[-1] == ("start", True), starts

    # reference: the plain model's gradients over both batches, micro-batch by micro-batch, averaged by hand
    for x, y in zip(batches, targets):
        for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)):
            mse(reference(xc), yc).backward()
    problems = []
    for (name, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        want = p.grad.clone()
        dist.all_reduce(want)
        want /= dist.get_world_size()
        got = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
        if not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            problems.append(f"{name}: max diff {(got - want).abs().max().item():.3e}")
    assert not problems, problems
    assert len(list(model.parameters())) == len(list(reference.parameters())) == 7  # the tied weight once
    print(f"rank {rank}: dp buckets ok ({buckets} all-reduces, all inside the last backward)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo worker threads that still hold finished async work
    # objects can abort the process there (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
