"""B7 data-parallel weak scaling: dp=2 on 2 processes against one process with the same per-rank batch.

Two processes, one thread each, the benchmark GPT, 4 sequences per rank, forward + backward + AdamW. dp=2 is
what the strategy does to a stage: ``lightning_3d.core.data_parallel.apply_data_parallel`` with the body's
layers as blocks, so each layer is a ``replicate`` group (a gradient bucket) all-reduced as soon as autograd has
produced its gradients, during the backward (the pipeline does this in the last micro-batch's backward).
Baseline, in the same run: rank 0 alone training its own copy on the same per-rank batch while rank 1 waits in a
barrier. A third variant, the body wrapped as ONE ``replicate`` group (one all-reduce after the whole backward,
what lightning_3d did before), is timed beside them. Rounds alternate the three; medians after warm-up; a dp step
is the slower rank's; the spread of the per-round ratios is reported too (the machine may be shared). The time
of one all-reduce of the gradient bytes is measured alone as well.

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

    from .common import build_gpt, gpt_loss, init_distributed, model_config, profile_breakdown, token_batch

    rank, world = init_distributed()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    config = model_config(tiny)
    x, y = token_batch(config, batch, seed=rank)
    single = build_gpt(config) if rank == 0 else None
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4) if single is not None else None
    dp_model = build_gpt(config)
    apply_data_parallel(dp_model.body, mesh, blocks=list(dp_model.body))  # what build_stages does to a stage
    dp_opt = torch.optim.AdamW(dp_model.parameters(), lr=1e-4)
    whole = build_gpt(config)
    apply_data_parallel(whole.body, mesh)  # no blocks: one group, reduced after the whole backward
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-4)
    grad_elems = sum(p.numel() for p in dp_model.parameters())

    cpu: dict[str, list[float]] = {"single": [], "dp2": [], "dp2_whole": []}

    def step(model: Any, opt: Any, key: str | None = None) -> float:
        start, start_cpu = time.perf_counter(), time.process_time()
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if key is not None:  # CPU seconds of the whole process (gloo's threads included): what a busy machine
            cpu[key].append(time.process_time() - start_cpu)  # cannot inflate, unlike the wall clock
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"single": [], "dp2": [], "dp2_whole": [], "allreduce": []}
    flat = torch.zeros(grad_elems)
    for r in range(warmup + rounds):
        dist.barrier()
        if rank == 0:
            t = step(single, single_opt, "single" if r >= warmup else None)
            if r >= warmup:
                times["single"].append(t)
        dist.barrier()
        t = step(dp_model, dp_opt, "dp2" if r >= warmup else None)
        if r >= warmup:
            times["dp2"].append(t)
        dist.barrier()
        t = step(whole, whole_opt, "dp2_whole" if r >= warmup else None)
        if r >= warmup:
            times["dp2_whole"].append(t)
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
    reduction_whole = _reduction_breakdown(lambda: step(whole, whole_opt))
    single_parts: dict[str, float] = {}
    dist.barrier()
    if rank == 0:
        single_parts = profile_breakdown(lambda: step(single, single_opt))
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (times["dp2"], times["dp2_whole"], times["allreduce"]))
    for i, key in enumerate(("dp2", "dp2_whole", "allreduce")):
        times[key] = [max(v) for v in zip(*(g[i] for g in gathered))]
    return {
        **times,
        "cpu": cpu,
        "grad_bytes": grad_elems * 4,
        "buckets": gradient_buckets(dp_model.body),
        "profile_dp2_rank0": dp_parts,
        "profile_single": single_parts,
        "reduction_rank0": reduction,
        "reduction_whole_rank0": reduction_whole,
    }


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    res = launch(
        "b7_data_parallel:worker", 2, {"batch": 4, "rounds": 1 if tiny else 8, "warmup": 1 if tiny else 2, "tiny": tiny}
    )
    single, dp, whole, ar = (median(res[k]) * 1e3 for k in ("single", "dp2", "dp2_whole", "allreduce"))
    per_round = sorted(s / d for s, d in zip(res["single"], res["dp2"]))
    per_round_whole = sorted(s / d for s, d in zip(res["single"], res["dp2_whole"]))
    red, red_whole = res["reduction_rank0"], res["reduction_whole_rank0"]
    cpu_single, cpu_dp, cpu_whole = (median(res["cpu"][k]) * 1e3 for k in ("single", "dp2", "dp2_whole"))
    lines = [
        f"one process {single:.1f} ms/step, dp=2 {dp:.1f} ms/step (4 sequences per rank) -> efficiency "
        f"{single / dp:.3f} (rounds {per_round[0]:.3f}-{per_round[-1]:.3f})",
        f"  {res['buckets']} gradient buckets (one replicate group per layer), all-reduced during the backward; "
        f"the body as one group (before): {whole:.1f} ms/step -> {single / whole:.3f} "
        f"(rounds {per_round_whole[0]:.3f}-{per_round_whole[-1]:.3f})",
        f"  un-overlapped reduction on the step's thread (profiled): {red['reduce_ms']:.1f} ms in "
        f"{red['buckets']} reductions, of which flattening copies {red['flatten_ms']:.1f} ms "
        f"(one group: {red_whole['reduce_ms']:.1f} ms, copies {red_whole['flatten_ms']:.1f} ms)",
        f"  CPU time per step (rank 0, all its threads; a busy machine does not inflate it): one process "
        f"{cpu_single:.1f} ms, dp=2 {cpu_dp:.1f} ms ({cpu_single / cpu_dp:.3f}), one group {cpu_whole:.1f} ms "
        f"({cpu_single / cpu_whole:.3f})",
        f"  all-reduce of the {res['grad_bytes'] / 2**20:.1f} MB of gradients alone: {ar:.1f} ms; the rest of the "
        f"gap: {dp - single - ar:.1f} ms",
        f"  profile dp=2 rank 0: {breakdown_text(res['profile_dp2_rank0'])}",
        f"  profile one process: {breakdown_text(res['profile_single'])}",
    ]
    details = {
        "single_ms": single,
        "dp2_ms": dp,
        "dp2_whole_ms": whole,
        "ratio_whole": single / whole,
        "ratio_rounds": per_round,
        "ratio_rounds_whole": per_round_whole,
        "allreduce_ms": ar,
        "cpu_ms": {"single": cpu_single, "dp2": cpu_dp, "dp2_whole": cpu_whole},
        "cpu_ratio": cpu_single / cpu_dp,
        "grad_bytes": res["grad_bytes"],
        "buckets": res["buckets"],
        "unoverlapped_reduction_ms": red["reduce_ms"],
        "flatten_ms": red["flatten_ms"],
        "unoverlapped_reduction_whole_ms": red_whole["reduce_ms"],
        "rounds_s": res,
        "layout": "dp=2 on 2 processes (replicate per layer, as apply_data_parallel), 1 thread each; "
        "baseline rank 0 alone",
    }
    return Record(ID, TITLE, dp, single, 1.0, single / dp, "ms per step", details, lines)
