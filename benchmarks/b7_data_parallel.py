"""B7 data-parallel weak scaling: dp=2 on 2 processes against one process with the same per-rank batch.

Two processes, one thread each, the benchmark GPT, 4 sequences per rank, forward + backward + AdamW. dp=2 is what
the strategy does to a stage: ``lightning_3d.core.data_parallel.apply_data_parallel`` with the body's layers as
blocks, and to its optimizer: AdamW left to choose steps the replicated DTensor parameters over their local tensors
with torch's choice for plain tensors, from the second step on (``lightning_3d.core.optim.optimizer_for_dtensors``;
bitwise the same numbers as over the DTensors); the buckets follow the backend (``per_block_buckets``): on gloo,
here, the body is ONE ``replicate`` group, all-reduced once after the whole backward (gloo's all-reduce blocks the
thread, so per-layer buckets cannot overlap the backward on a CPU). Baseline, in the same run: rank 0 alone training
its own copy on the same per-rank batch while rank 1 waits in a barrier. A third variant, NCCL's choice forced on
gloo (each layer a ``replicate`` group, a gradient bucket all-reduced as soon as autograd has produced its
gradients, during the backward), is timed beside them. Rounds alternate the three; medians after warm-up; a dp step
is the slower rank's; the spread of the per-round ratios is reported too (the machine may be shared). The time of
one all-reduce of the gradient bytes is measured alone as well, and so is a round in which both ranks train their
own copy at once with no communication (``corun``): what two processes sharing the two cores cost by themselves,
which the dp=2 step pays too; ``ratio_vs_corun`` = that step / the dp=2 step is what data parallelism itself costs.

One more step of each runs under ``torch.profiler`` to split the time into collectives, replicate's hooks,
DTensor dispatch (the replicated parameters are DTensors), copies, matmul/attention and the rest, with AdamW's
inclusive time beside. The un-overlapped reduction time is the inclusive time of replicate's reductions
(``FSDP::post_backward_reduce``) on the step's thread: the flattening copy and the all-reduce, which gloo runs
while the calling thread waits (a CPU cannot overlap it with compute here; NCCL runs it on its own stream).

Ratio = one-process step / dp=2 step (weak scaling efficiency, ideal 1.0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import Record, breakdown_text, median

ID, TITLE = "B7", "data-parallel weak scaling: dp=2 vs one process, same per-rank batch"


def _reduction_breakdown(step: Any) -> dict[str, float]:
    """One profiled step: ms inclusive in replicate's reductions, their flattening copies, and the bucket count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    reduce_ms = copy_ms = 0.0
    buckets = 0
    for ev in prof.events():
        if ev.name.startswith("FSDP::post_backward_reduce"):
            reduce_ms += ev.cpu_time_total / 1e3
            buckets += 1
        elif ev.name == "fsdp::chunk_cat":
            copy_ms += ev.cpu_time_total / 1e3
    return {"reduce_ms": reduce_ms, "flatten_ms": copy_ms, "buckets": buckets}


def worker(batch: int, rounds: int, warmup: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks; returns per-round step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.core.data_parallel import apply_data_parallel, gradient_buckets
    from lightning_3d.core.optim import optimizer_for_dtensors

    from .common import build_gpt, gpt_loss, init_distributed, model_config, profile_breakdown, token_batch

    rank, world = init_distributed()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    config = model_config(tiny)
    x, y = token_batch(config, batch, seed=rank)
    # every rank trains its own copy too: rank 0's alone is the baseline; both at once (no communication) show what
    # two processes sharing the two cores cost by themselves (memory bandwidth and caches), apart from data parallelism
    single = build_gpt(config)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4)
    dp_model = build_gpt(config)
    apply_data_parallel(dp_model.body, mesh, blocks=list(dp_model.body))  # what build_stages does to a stage
    dp_opt = torch.optim.AdamW(dp_model.parameters(), lr=1e-4)
    per_layer = build_gpt(config)  # NCCL's choice forced: a bucket per layer, reduced during the backward
    apply_data_parallel(per_layer.body, mesh, blocks=list(per_layer.body), per_block=True)
    per_layer_opt = torch.optim.AdamW(per_layer.parameters(), lr=1e-4)
    grad_elems = sum(p.numel() for p in dp_model.parameters())

    cpu: dict[str, list[float]] = {"single": [], "dp2": [], "dp2_per_layer": []}

    phases: dict[str, list[float]] = {"flatten": [], "optimizer_single": [], "optimizer_dp2": []}

    def step(model: Any, opt: Any, key: str | None = None, phase: str | None = None) -> float:
        start, start_cpu = time.perf_counter(), time.process_time()
        gpt_loss(model(x), y).backward()
        if phase == "single":  # the flattening copy replicate makes, alone and unprofiled (a profiler inflates it)
            grads = [p.grad.reshape(-1) for p in model.parameters()]
            t = time.perf_counter()
            torch.cat(grads, out=torch.empty(grad_elems))
            phases["flatten"].append(time.perf_counter() - t)
            start += time.perf_counter() - t  # not part of the step
        t = time.perf_counter()
        with optimizer_for_dtensors(opt):  # what the strategy's optimizer step does for DTensor parameters
            opt.step()
        if phase is not None:
            phases[f"optimizer_{phase}"].append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
        if key is not None:  # CPU seconds of the whole process (gloo's threads included): what a busy machine
            cpu[key].append(time.process_time() - start_cpu)  # cannot inflate, unlike the wall clock
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"single": [], "corun": [], "dp2": [], "dp2_per_layer": [], "allreduce": []}
    flat = torch.zeros(grad_elems)
    for r in range(warmup + rounds):
        dist.barrier()
        if rank == 0:
            t = step(single, single_opt, "single" if r >= warmup else None)
            if r >= warmup:
                times["single"].append(t)
        dist.barrier()
        t = step(single, single_opt, phase="single" if r >= warmup else None)  # both ranks at once, each its own
        if r >= warmup:
            times["corun"].append(t)
        dist.barrier()
        t = step(dp_model, dp_opt, "dp2" if r >= warmup else None, phase="dp2" if r >= warmup else None)
        if r >= warmup:
            times["dp2"].append(t)
        dist.barrier()
        t = step(per_layer, per_layer_opt, "dp2_per_layer" if r >= warmup else None)
        if r >= warmup:
            times["dp2_per_layer"].append(t)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if r >= warmup:
            times["allreduce"].append(time.perf_counter() - start)
    dist.barrier()
    dp_parts = profile_breakdown(lambda: step(dp_model, dp_opt))
    dist.barrier()
    reduction = _reduction_breakdown(lambda: step(dp_model, dp_opt))
    dist.barrier()
    reduction_per_layer = _reduction_breakdown(lambda: step(per_layer, per_layer_opt))
    single_parts: dict[str, float] = {}
    dist.barrier()
    if rank == 0:
        single_parts = profile_breakdown(lambda: step(single, single_opt))
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (times["dp2"], times["dp2_per_layer"], times["allreduce"], times["corun"]))
    for i, key in enumerate(("dp2", "dp2_per_layer", "allreduce", "corun")):
        times[key] = [max(v) for v in zip(*(g[i] for g in gathered))]
    return {
        **times,
        "cpu": cpu,
        "phases_rank0": phases,
        "grad_bytes": grad_elems * 4,
        "buckets": gradient_buckets(dp_model.body),
        "profile_dp2_rank0": dp_parts,
        "profile_single": single_parts,
        "reduction_rank0": reduction,
        "reduction_per_layer_rank0": reduction_per_layer,
    }


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    res = launch(
        "b7_data_parallel:worker", 2, {"batch": 4, "rounds": 1 if tiny else 8, "warmup": 1 if tiny else 2, "tiny": tiny}
    )
    single, dp, per_layer, ar, corun = (
        median(res[k]) * 1e3 for k in ("single", "dp2", "dp2_per_layer", "allreduce", "corun")
    )
    per_round = sorted(s / d for s, d in zip(res["single"], res["dp2"]))
    per_round_per_layer = sorted(s / d for s, d in zip(res["single"], res["dp2_per_layer"]))
    red, red_per_layer = res["reduction_rank0"], res["reduction_per_layer_rank0"]
    cpu_single, cpu_dp, cpu_per_layer = (median(res["cpu"][k]) * 1e3 for k in ("single", "dp2", "dp2_per_layer"))
    flatten, opt_single, opt_dp = (
        median(res["phases_rank0"][k]) * 1e3 for k in ("flatten", "optimizer_single", "optimizer_dp2")
    )
    lines = [
        f"one process {single:.1f} ms/step, dp=2 {dp:.1f} ms/step (4 sequences per rank) -> efficiency "
        f"{single / dp:.3f} (rounds {per_round[0]:.3f}-{per_round[-1]:.3f})",
        f"  {res['buckets']} gradient bucket(s) (the strategy's choice for gloo: one replicate group per stage); "
        f"a bucket per layer (NCCL's choice, forced): {per_layer:.1f} ms/step -> {single / per_layer:.3f} "
        f"(rounds {per_round_per_layer[0]:.3f}-{per_round_per_layer[-1]:.3f})",
        f"  un-overlapped reduction on the step's thread (profiled, which inflates the copies): "
        f"{red['reduce_ms']:.1f} ms in {red['buckets']} reductions, of which flattening copies "
        f"{red['flatten_ms']:.1f} ms "
        f"(a bucket per layer: {red_per_layer['reduce_ms']:.1f} ms, copies {red_per_layer['flatten_ms']:.1f} ms)",
        f"  CPU time per step (rank 0, all its threads; a busy machine does not inflate it): one process "
        f"{cpu_single:.1f} ms, dp=2 {cpu_dp:.1f} ms ({cpu_single / cpu_dp:.3f}), a bucket per layer "
        f"{cpu_per_layer:.1f} ms ({cpu_single / cpu_per_layer:.3f})",
        f"  two processes each training its own copy at the same time (no communication): {corun:.1f} ms/step, "
        f"{single / corun:.3f} of one alone: the two cores' shared memory bandwidth and caches, not data "
        f"parallelism; dp=2 against that: {corun / dp:.3f}",
        f"  all-reduce of the {res['grad_bytes'] / 2**20:.1f} MB of gradients alone: {ar:.1f} ms; the rest of the "
        f"gap: {dp - single - ar:.1f} ms",
        f"  unprofiled, rank 0: the flattening copy alone (one cat of the gradients after a co-run backward) "
        f"{flatten:.1f} ms; AdamW over replicate's DTensor parameters {opt_dp:.1f} ms vs {opt_single:.1f} ms over "
        f"plain tensors (co-run); so dp=2 - co-run = all-reduce {ar:.1f} + flattening {flatten:.1f} + optimizer "
        f"{opt_dp - opt_single:.1f} + the rest {dp - corun - ar - flatten - (opt_dp - opt_single):.1f} ms",
        f"  profile dp=2 rank 0: {breakdown_text(res['profile_dp2_rank0'])}",
        f"  profile one process: {breakdown_text(res['profile_single'])}",
    ]
    details = {
        "single_ms": single,
        "dp2_ms": dp,
        "dp2_per_layer_ms": per_layer,
        "ratio_per_layer": single / per_layer,
        "corun_ms": corun,
        "corun_ratio": single / corun,
        "ratio_vs_corun": corun / dp,
        "ratio_rounds": per_round,
        "ratio_rounds_per_layer": per_round_per_layer,
        "allreduce_ms": ar,
        "cpu_ms": {"single": cpu_single, "dp2": cpu_dp, "dp2_per_layer": cpu_per_layer},
        "cpu_ratio": cpu_single / cpu_dp,
        "grad_bytes": res["grad_bytes"],
        "buckets": res["buckets"],
        "unoverlapped_reduction_ms": red["reduce_ms"],
        "flatten_ms": red["flatten_ms"],
        "flatten_unprofiled_ms": flatten,
        "optimizer_ms": {"single": opt_single, "dp2": opt_dp},
        "unoverlapped_reduction_per_layer_ms": red_per_layer["reduce_ms"],
        "rounds_s": res,
        "layout": "dp=2 on 2 processes (apply_data_parallel: one replicate group per stage on gloo), 1 thread each; "
        "baseline rank 0 alone; dp2_per_layer: a replicate group per layer (NCCL's choice, forced)",
    }
    return Record(ID, TITLE, dp, single, 1.0, single / dp, "ms per step", details, lines)
