"""B7 data-parallel weak scaling: dp=2 on 2 processes against one process with the same per-rank batch.

Two processes, one thread each, the benchmark GPT, 4 sequences per rank, forward + backward + AdamW. dp=2 wraps
the whole model with ``replicate`` over a 2-rank mesh (``lightning_3d.core.data_parallel.apply_data_parallel``,
what the strategy does around each stage): one all-reduce of every gradient after backward. Baseline, in
the same run: rank 0 alone training its own copy on the same per-rank batch while rank 1 waits in a barrier.
Rounds alternate the two; medians after warm-up; a dp step is the slower rank's. The time of one all-reduce
of the gradient bytes is measured alone as well, to split the gap into communication and the rest.

One more step of each runs under ``torch.profiler`` to split the time into collectives, DTensor dispatch (the
replicated parameters are DTensors), matmul/attention and the rest, with AdamW's inclusive time beside.

Ratio = one-process step / dp=2 step (weak scaling efficiency, ideal 1.0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import Record, breakdown_text, median

ID, TITLE = "B7", "data-parallel weak scaling: dp=2 vs one process, same per-rank batch"


def worker(batch: int, rounds: int, warmup: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks; returns per-round step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.core.data_parallel import apply_data_parallel

    from .common import build_gpt, gpt_loss, init_distributed, model_config, profile_breakdown, token_batch

    rank, world = init_distributed()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    config = model_config(tiny)
    x, y = token_batch(config, batch, seed=rank)
    single = build_gpt(config) if rank == 0 else None
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4) if single is not None else None
    dp_model = build_gpt(config)
    dp_model.body = apply_data_parallel(dp_model.body, mesh)
    dp_opt = torch.optim.AdamW(dp_model.parameters(), lr=1e-4)
    grad_elems = sum(p.numel() for p in dp_model.parameters())

    def step(model: Any, opt: Any) -> float:
        start = time.perf_counter()
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"single": [], "dp2": [], "allreduce": []}
    flat = torch.zeros(grad_elems)
    for r in range(warmup + rounds):
        dist.barrier()
        if rank == 0:
            t = step(single, single_opt)
            if r >= warmup:
                times["single"].append(t)
        dist.barrier()
        t = step(dp_model, dp_opt)
        if r >= warmup:
            times["dp2"].append(t)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if r >= warmup:
            times["allreduce"].append(time.perf_counter() - start)
    dist.barrier()
    dp_parts = profile_breakdown(lambda: step(dp_model, dp_opt))
    single_parts: dict[str, float] = {}
    dist.barrier()
    if rank == 0:
        single_parts = profile_breakdown(lambda: step(single, single_opt))
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (times["dp2"], times["allreduce"]))
    times["dp2"] = [max(v) for v in zip(*(g[0] for g in gathered))]
    times["allreduce"] = [max(v) for v in zip(*(g[1] for g in gathered))]
    return {**times, "grad_bytes": grad_elems * 4, "profile_dp2_rank0": dp_parts, "profile_single": single_parts}


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    res = launch(
        "b7_data_parallel:worker", 2, {"batch": 4, "rounds": 1 if tiny else 8, "warmup": 1 if tiny else 2, "tiny": tiny}
    )
    single, dp, ar = (median(res[k]) * 1e3 for k in ("single", "dp2", "allreduce"))
    lines = [
        f"one process {single:.1f} ms/step, dp=2 {dp:.1f} ms/step (4 sequences per rank) -> "
        f"efficiency {single / dp:.3f}",
        f"all-reduce of the {res['grad_bytes'] / 2**20:.1f} MB of gradients alone: {ar:.1f} ms "
        f"({ar / dp:.1%} of the dp step); the rest of the gap: {dp - single - ar:.1f} ms",
        f"  profile dp=2 rank 0: {breakdown_text(res['profile_dp2_rank0'])}",
        f"  profile one process: {breakdown_text(res['profile_single'])}",
    ]
    details = {
        "single_ms": single,
        "dp2_ms": dp,
        "allreduce_ms": ar,
        "grad_bytes": res["grad_bytes"],
        "rounds_s": res,
        "layout": "dp=2 on 2 processes (replicate), 1 thread each; baseline rank 0 alone",
    }
    return Record(ID, TITLE, dp, single, 1.0, single / dp, "ms per step", details, lines)
