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

Then gradient compression (``grad_reduce_dtype="bf16"``), for ``replicate`` and for ``fully_shard`` (float32
model, 2 micro-batches, SGD, a few steps): every data-parallel all-reduce / reduce-scatter carries bf16 (fp32
without it), the gradients after each step are fp32, and the per-step losses stay within ``BF16_LOSS_RTOL`` of
the same run with fp32 reduction without being bitwise equal to them (so the reduction really ran in bf16), and
the first step's gradients equal, bit for bit, the hand-made reduction: each rank's fp32 sum of its micro-batches
rounded to bf16 once, averaged over dp in bf16 (micro-batches are summed in fp32, only the wire is bf16).

Raises (exit code != 0) on any mismatch.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_3d.core import torch_compat
from lightning_3d.core.data_parallel import apply_data_parallel, gradient_buckets
from lightning_3d.core.fsdp import apply_fsdp
from lightning_3d.core.pipeline import PipelineRuntime, StageSpec

MICRO, BATCH, WIDTH = 4, 8, 16
STEPS, BF16_LOSS_RTOL = 6, 1e-3  # measured: 6e-5 (bf16 rounds each reduced gradient by <= 4e-3 relative)


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
    check_grad_reduce_dtype(mesh)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo worker threads that still hold finished async work
    # objects can abort the process there (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


def train(mesh: Any, mode: str, reduce_dtype: str | None) -> tuple[list[float], set[torch.dtype], set[torch.dtype]]:
    """``STEPS`` SGD steps of a float32 model under ``mode`` ("replicate" / "fsdp") with the given reduce dtype;
    returns the per-step losses (this rank's, summed over micro-batches), the dtypes of the dp collectives' tensors
    and the gradients' dtypes after the steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))
    plain = copy.deepcopy(model)  # the first step's gradients by hand
    blocks = [model[0], model[2]]
    if mode == "fsdp":
        model = apply_fsdp(model, blocks, mesh["dp"], pp=1, precision=Precision(), reduce_dtype=reduce_dtype)
    else:
        model = apply_data_parallel(model, mesh["dp"], blocks=blocks, reduce_dtype=reduce_dtype)
    wire: set[torch.dtype] = set()

    class Collectives(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = torch_compat.op_name(func)
            if func.namespace == "c10d" and ("reduce" in name):
                first = args[1] if "reduce_scatter" in name and len(args) > 1 else args[0]  # (output, input)
                for t in first if isinstance(first, (list, tuple)) else [first]:
                    if isinstance(t, torch.Tensor):
                        wire.add(t.dtype)
            return func(*args, **(kwargs or {}))

    losses: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = mse(out, target)
        losses.append(loss.detach())
        return loss

    runtime = PipelineRuntime(
        [StageSpec(0, model)], 1, mesh["pp"].get_group(), torch.device("cpu"), "1f1b", loss_fn=loss_fn
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(200 + dist.get_rank())
    per_step = []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
        losses.clear()
        with Collectives():
            runtime.run(x, y, 2, ("x",), True)
        per_step.append(float(sum(losses)))
        if step == 0:
            check_first_gradients(plain, model, x, y, reduce_dtype)
        optimizer.step()
        grad_dtypes = {p.grad.dtype for p in model.parameters()}
        optimizer.zero_grad()
    return per_step, wire, grad_dtypes


def check_first_gradients(plain: nn.Module, model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: Any) -> None:
    """The first step's gradients, by hand: each rank sums its 2 micro-batches' fp32 gradients, rounds the sum to
    the reduce dtype, averages it over dp in that dtype. Equal
    bit for bit: summing the micro-batches in the reduce dtype (torch's own accumulation) would differ."""
    for xc, yc in zip(x.chunk(2), y.chunk(2)):
        mse(plain(xc), yc).backward()
    wire = {None: torch.float32, "bf16": torch.bfloat16}[dtype]
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        want = p.grad.to(wire)
        dist.all_reduce(want, op=dist.ReduceOp.AVG)
        want = want.float()
        got = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        assert got.dtype == torch.float32 and torch.equal(got, want), (
            f"{name}: reduce dtype {dtype}: max diff {(got - want).abs().max().item():.3e}"
        )


def check_grad_reduce_dtype(mesh: Any) -> None:
    """bf16 gradient reduction against fp32 reduction, for replicate and FSDP (see the module text)."""
    rank = dist.get_rank()
    for mode in ("replicate", "fsdp"):
        ref, ref_wire, ref_grads = train(mesh, mode, None)
        got, wire, grads = train(mesh, mode, "bf16")
        assert ref_wire == {torch.float32} and wire == {torch.bfloat16}, f"{mode}: dp collectives {ref_wire} {wire}"
        assert ref_grads == grads == {torch.float32}, f"{mode}: gradients {ref_grads} / {grads}, not fp32"
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
        assert worst < BF16_LOSS_RTOL, f"{mode}: bf16 reduction's losses {got} vs fp32 {ref}: rel {worst:.2e}"
        assert ref[0] == got[0] and ref[1:] != got[1:], f"{mode}: losses {got} vs {ref}: bf16 reduced nothing?"
        print(f"rank {rank}: {mode} bf16 reduction ok (loss rel diff {worst:.1e})", flush=True)


if __name__ == "__main__":
    main()
