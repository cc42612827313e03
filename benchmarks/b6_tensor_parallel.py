"""B6 tensor parallelism: tp=2 on 2 processes against one process with 2 threads, hidden 256 and 1024.

Two processes. The benchmark GPT (8 layers, 4 heads, sequence 128, vocabulary 2048) at hidden 256 and 1024
trains on a batch of 2 sequences: forward, backward, AdamW step. Baseline, in the same run: rank 0 alone
with ``torch.set_num_threads(2)`` (the same two cores as the tp=2 pair) while rank 1 waits in a barrier
(a waiting gloo rank uses no CPU); one process with one thread is timed too, for the speed-up over one core.
tp=2: both ranks, one thread each, the layers sharded with the plan ``ThreeDStrategy`` resolves
automatically (``parallelize_module`` per layer, as the strategy does). Rounds alternate the three so load
drifts hit them alike; medians after a warm-up round; a tp step is the slower rank's.

One more step of each is run under ``torch.profiler`` to split its time into collectives (including waiting
for the other rank), DTensor's Python dispatch, matmul/attention kernels and the rest (AdamW's inclusive time
reported beside).

Ratio = one process with 2 threads / tp=2 (ideal 1.0: both use two cores; above 1 tp wins). The trend with
hidden size shows the cost of TP's all-reduces (2 x b s h per layer forward, 4 in backward with separate q/k/v,
see B5) against compute that grows as h^2.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import Record, breakdown_text, median

ID, TITLE = "B6", "tensor parallel: tp=2 on 2 processes vs one process with 2 threads"


def _tp_model(config: dict[str, Any], mesh: Any) -> Any:
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_3d.core import partition
    from lightning_3d.core.tensor_parallel import resolve_plan

    from .common import build_gpt

    model = build_gpt(config)
    body = partition.find_body(model)
    plan = resolve_plan(body.module, 2, body_prefix=body.fqn, example_input=torch.zeros(2, 8, dtype=torch.long))
    for name, layer in body.module.named_children():
        styles = plan.styles_for(name)
        if styles:
            parallelize_module(layer, mesh, styles)
    return model


def worker(hiddens: list[int], batch: int, rounds: int, warmup: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks; returns per-round step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .common import build_gpt, gpt_loss, init_distributed, model_config, profile_breakdown, token_batch

    rank, world = init_distributed()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for h in hiddens:
        config = {**model_config(tiny), "n_embd": h}
        x, y = token_batch(config, batch)
        single = build_gpt(config) if rank == 0 else None
        single_opt = torch.optim.AdamW(single.parameters(), lr=1e-4) if single is not None else None
        tp_model = _tp_model(config, mesh)
        tp_opt = torch.optim.AdamW(tp_model.parameters(), lr=1e-4)

        def step(model: Any, opt: Any, x: Any = x, y: Any = y) -> float:
            start = time.perf_counter()
            gpt_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"single_2threads": [], "single_1thread": [], "tp2": []}
        cpu_waiting = 0.0
        for r in range(warmup + rounds):
            dist.barrier()
            c0 = time.process_time()
            if rank == 0:
                for threads, key in ((2, "single_2threads"), (1, "single_1thread")):
                    torch.set_num_threads(threads)
                    t = step(single, single_opt)
                    if r >= warmup:
                        times[key].append(t)
                torch.set_num_threads(1)
            dist.barrier()
            if rank == 1:
                cpu_waiting += time.process_time() - c0
            t = step(tp_model, tp_opt)
            if r >= warmup:
                times["tp2"].append(t)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (times["tp2"], cpu_waiting))
        times["tp2"] = [max(v) for v in zip(*(g[0] for g in gathered))]
        # where a tp step's time goes (profiled once on both ranks, rank 0's figures), and the same for one process
        dist.barrier()
        tp_parts = profile_breakdown(lambda m=tp_model, o=tp_opt: step(m, o))
        single_parts: dict[str, float] = {}
        dist.barrier()
        if rank == 0:
            single_parts = profile_breakdown(lambda m=single, o=single_opt: step(m, o))
        dist.barrier()
        out[str(h)] = {
            **times,
            "rank1_cpu_s_while_waiting": gathered[1][1],
            "profile_tp2_rank0": tp_parts,
            "profile_single_1thread": single_parts,
        }
    return out


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    hiddens = [32, 64] if tiny else [256, 1024]
    res = launch(
        "b6_tensor_parallel:worker",
        2,
        {"hiddens": hiddens, "batch": 2, "rounds": 1 if tiny else 5, "warmup": 1, "tiny": tiny},
        timeout=300,
    )
    lines = ["hidden | 1 proc 1 thread ms | 1 proc 2 threads ms | tp=2 ms | 2 threads / tp2 | 1 thread / tp2"]
    table: dict[str, dict[str, Any]] = {}
    profiles: list[str] = []
    for h in map(str, hiddens):
        r = res[h]
        one, two, tp = (median(r[k]) * 1e3 for k in ("single_1thread", "single_2threads", "tp2"))
        table[h] = {
            "single_1thread_ms": one,
            "single_2threads_ms": two,
            "tp2_ms": tp,
            "ratio": two / tp,
            "speedup_over_1thread": one / tp,
            "threads_speedup": one / two,
            "rank1_cpu_s_while_waiting": r["rank1_cpu_s_while_waiting"],
            "rounds_s": {k: r[k] for k in ("single_1thread", "single_2threads", "tp2")},
        }
        lines.append(f"{h:>6} | {one:18.1f} | {two:19.1f} | {tp:7.1f} | {two / tp:15.3f} | {one / tp:14.3f}")
        table[h]["profile_tp2_rank0"] = r["profile_tp2_rank0"]
        table[h]["profile_single_1thread"] = r["profile_single_1thread"]
        profiles.append(f"  profile hidden {h}, tp=2 rank 0: {breakdown_text(r['profile_tp2_rank0'])}")
        profiles.append(f"  profile hidden {h}, one process: {breakdown_text(r['profile_single_1thread'])}")
    lo, hi = table[str(hiddens[0])]["ratio"], table[str(hiddens[-1])]["ratio"]
    lines.append(f"trend: ratio {lo:.3f} at hidden {hiddens[0]} -> {hi:.3f} at hidden {hiddens[-1]}")
    lines += profiles
    details = {
        "table": table,
        "batch": "2 sequences x 128 tokens, forward + backward + AdamW",
        "layout": "2 processes; baseline rank 0 alone with 2 threads (rank 1 waits in a barrier)",
    }
    return Record(
        ID,
        TITLE,
        {h: t["tp2_ms"] for h, t in table.items()},
        {h: t["single_2threads_ms"] for h, t in table.items()},
        1.0,
        {h: round(t["ratio"], 4) for h, t in table.items()},
        "ms per step, by hidden size",
        details,
        lines,
    )
