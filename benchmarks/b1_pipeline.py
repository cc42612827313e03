"""B1 pipeline efficiency: pp=2 on 2 processes (1F1B and GPipe, m = 1, 2, 4, 8, 16) against one process.

Two processes, one thread each. The benchmark GPT's body is split as ``ThreeDStrategy`` splits it (uniform:
embedding + 4 blocks | 4 blocks + head) and run with torch's ``ScheduleGPipe`` / ``Schedule1F1B`` over
``PipelineStage`` (the objects the strategy builds), micro-batches of one sequence (1 x 128 tokens). The
baseline, in the same run and the same processes, is rank 0 alone running the whole model over the same m
micro-batches (forward + backward each, gradients accumulated) while rank 1 waits in a barrier. Rounds
alternate baseline, GPipe and 1F1B for every m so that drifting load hits all of them alike; figures are
medians over the rounds after warm-up rounds (the first step of a schedule exchanges shapes). A pipelined
step's time is the slower rank's. No optimizer step on either side: this is the schedule's efficiency.

Speed-up = baseline time / pipelined time; the ideal speed-up of a balanced 2-stage pipeline with free
communication is ``2m / (m + 1)`` (bubble ``(p - 1) / (m + p - 1)``); the record's ratio is measured / ideal
for 1F1B at m = 8. Seven more steps of each schedule at m = 8 are recorded with :mod:`lightning_3d.tools.timeline`
(the one of median length goes to a Chrome trace + Gantt chart in the output folder): the record splits the
step into compute, waiting for the neighbour and the rest, and gives the bound that the measured stage
imbalance alone allows,
``m (c0 + c1) / (c0 + c1 + (m - 1) max(c0, c1))`` with ``c_s`` the compute per micro-batch of stage ``s``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "B1", "pipeline efficiency: pp=2 on 2 processes (1F1B, GPipe) vs one process"
SCHEDULES = ("gpipe", "1f1b")


def worker(
    ms: list[int],
    reps: int,
    warmup: int,
    tiny: bool,
    timeline_dir: str | None,
    timeline_m: int,
    timeline_steps: int = 5,
) -> dict[str, Any]:
    """Runs on both ranks (see the module docstring); returns the times of every round."""
    import torch.distributed as dist

    from lightning_3d.tools.timeline import (
        ScheduleRecorder,
        bubble_stats,
        gather_timelines,
        plot_gantt,
        write_chrome_trace,
    )

    from .common import (
        build_gpt,
        build_schedule,
        gpt_loss,
        init_distributed,
        model_config,
        pipeline_step,
        stage_modules,
        token_batch,
    )

    rank, world = init_distributed()
    assert world == 2, "B1 runs on 2 processes"
    config = model_config(tiny)
    whole = build_gpt(config)
    piece = copy.deepcopy(whole)
    stages = stage_modules(piece, 2, rank)
    params = [p for _, mod in stages for p in mod.parameters()] + list(whole.parameters())
    x, y = token_batch(config, max(ms))
    first, last = rank == 0, rank == 1
    schedules = {
        (name, m): build_schedule(name, stages, 2, m) for m in ms for name in SCHEDULES if name == "gpipe" or m >= 2
    }

    def zero() -> None:
        for p in params:
            p.grad = None

    def baseline(m: int) -> None:
        for i in range(m):
            gpt_loss(whole(x[i : i + 1]), y[i : i + 1]).backward()

    times: dict[str, list[float]] = {}
    for round_ in range(warmup + reps):
        for m in ms:
            zero()
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                baseline(m)
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    times.setdefault(f"base/{m}", []).append(elapsed)
            dist.barrier()
            for name in SCHEDULES:
                if (name, m) not in schedules:
                    continue
                zero()
                dist.barrier()
                start = time.perf_counter()
                pipeline_step(schedules[name, m], first, last, x[:m], y[:m])
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    times.setdefault(f"{name}/{m}", []).append(elapsed)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, times)
    result: dict[str, Any] = {"rounds": {}, "timeline": {}}
    for key in gathered[0]:
        if key.startswith("base/"):
            result["rounds"][key] = gathered[0][key]
        else:  # the slower rank's time, step by step
            result["rounds"][key] = [max(a, b) for a, b in zip(gathered[0][key], gathered[1][key])]
    if timeline_dir is not None:
        for name in SCHEDULES:
            sched = schedules.get((name, timeline_m))
            if sched is None:
                continue
            recorded = []
            for _ in range(timeline_steps):
                zero()
                recorder = ScheduleRecorder()
                dist.barrier()
                with recorder.patch(sched):
                    pipeline_step(sched, first, last, x[:timeline_m], y[:timeline_m])
                timelines = gather_timelines(recorder.timeline(sched, {"pp": rank}))
                recorded.append((bubble_stats(timelines), timelines))
            # the picture shows the step of median length; the summary keeps every recorded step
            recorded.sort(key=lambda item: item[0]["span_ms"])
            stats, timelines = recorded[len(recorded) // 2]
            stats["recorded_steps"] = [dict(st) for st, _ in recorded]  # copies: no cycle through stats
            if rank == 0:
                stem = Path(timeline_dir) / f"B1_timeline_{name}_m{timeline_m}"
                write_chrome_trace(timelines, stem.with_suffix(".json"), stats)
                try:
                    plot_gantt(timelines, stem.with_suffix(".png"), summary=stats)
                    stats["png"] = str(stem.with_suffix(".png"))
                except ImportError:
                    stats["png"] = None
                stats["trace"] = str(stem.with_suffix(".json"))
            result["timeline"][name] = stats
    return result


def imbalance_bound(stats: dict[str, Any]) -> dict[str, float]:
    """Per-micro-batch compute of each stage and the speed-up the imbalance alone allows (p = 2)."""
    m = stats["n_micro"]
    c = [r["compute_ms"] / m for r in stats["ranks"].values()]
    bound = m * sum(c) / (sum(c) + (m - 1) * max(c))
    return {"compute_per_microbatch_ms": c, "speedup_bound": bound, "bound_over_ideal": bound / (2 * m / (m + 1))}


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    ms = [1, 2, 4] if tiny else [1, 2, 4, 8, 16]
    timeline_m = 4 if tiny else 8
    res = launch(
        "b1_pipeline:worker",
        2,
        {
            "ms": ms,
            "reps": 1 if tiny else 9,
            "warmup": 1,
            "tiny": tiny,
            "timeline_dir": str(out.resolve()),
            "timeline_m": timeline_m,
            "timeline_steps": 1 if tiny else 7,
        },
        timeout=240 if tiny else 420,
    )
    rounds = res["rounds"]
    table: dict[str, dict[str, Any]] = {}
    lines = ["  m | one process ms | GPipe ms  speed-up  /ideal | 1F1B ms  speed-up  /ideal | ideal 2m/(m+1)"]
    for m in ms:
        base = median(rounds[f"base/{m}"]) * 1e3
        ideal = 2 * m / (m + 1)
        row: dict[str, Any] = {
            "baseline_ms": base,
            "ideal_speedup": ideal,
            "baseline_rounds_ms": [v * 1e3 for v in rounds[f"base/{m}"]],
        }
        cells = []
        for name in SCHEDULES:
            key = f"{name}/{m}"
            if key not in rounds:
                cells.append("        -        -       -")
                continue
            t = median(rounds[key]) * 1e3
            row[name] = {
                "ms": t,
                "speedup": base / t,
                "ratio": base / t / ideal,
                "rounds_ms": [v * 1e3 for v in rounds[key]],
            }
            cells.append(f"{t:8.1f}  {base / t:8.3f}  {base / t / ideal:6.3f}")
        table[str(m)] = row
        lines.append(f"{m:3d} | {base:14.1f} | {cells[0]} | {cells[1]} | {ideal:.3f}")
    bounds = {}
    for name, stats in res["timeline"].items():
        bound = imbalance_bound(stats)
        bounds[name] = bound
        ranks = stats["ranks"]
        lines.append(
            f"timeline {name} m={stats['n_micro']}: step {stats['span_ms']:.1f} ms, bubble measured "
            f"{stats['measured']:.1%} vs theory {stats['theory']:.1%}; per stage compute/micro-batch "
            + ", ".join(f"{c:.1f}" for c in bound["compute_per_microbatch_ms"])
            + " ms, waiting for the neighbour "
            + ", ".join(f"{r['recv_wait_ms']:.1f}" for r in ranks.values())
            + " ms, p2p post/send "
            + ", ".join(f"{r['send_ms']:.1f}" for r in ranks.values())
            + f" ms; imbalance alone bounds the speed-up at {bound['speedup_bound']:.3f} "
            f"({bound['bound_over_ideal']:.3f} of ideal)"
        )
        slow_key = max(ranks, key=lambda k: ranks[k]["compute_ms"])
        slow = ranks[slow_key]
        steps = stats.get("recorded_steps", [stats])
        spans = sorted(st["span_ms"] for st in steps)
        stalls = sorted(st["ranks"][slow_key]["stall_ms"] for st in steps)
        lines.append(
            f"  {len(steps)} recorded steps: {spans[0]:.0f}..{spans[-1]:.0f} ms (median shown); bottleneck-stage "
            f"stalls {stalls[0]:.1f}..{stalls[-1]:.1f} ms"
        )
        lines.append(
            f"  bottleneck stage {slow_key}: step {stats['span_ms']:.1f} ms = fill {slow['fill_ms']:.1f} (waiting for "
            f"the first activation) + compute {slow['compute_ms']:.1f} + steady-state stalls {slow['stall_ms']:.1f} "
            f"(between its computations) + drain {slow['drain_ms']:.1f} (the other stage's last backward, grad "
            f"reduce); its thread was off the CPU for {slow['descheduled_ms']:.1f} ms while computing or posting p2p"
        )
        if stats.get("png"):
            lines.append(f"  picture: {stats['png']}")
    m_key = str(timeline_m)
    row = table[m_key]
    if "1f1b" in bounds:
        compute = sum(c * timeline_m for c in bounds["1f1b"]["compute_per_microbatch_ms"])
        lines.append(
            f"compute in the recorded 1F1B step at m={m_key}: {compute:.1f} ms over both stages vs "
            f"{row['baseline_ms']:.1f} ms for one process (per-micro-batch compute inflation "
            f"{compute / row['baseline_ms']:.3f})"
        )
    measured = row["1f1b"]["speedup"]
    details = {
        "table": table,
        "timeline": res["timeline"],
        "bounds": bounds,
        "layout": "pp=2 on 2 processes, 1 thread each; baseline: rank 0 alone, whole model",
        "micro_batch": "1 sequence x 128 tokens" if not tiny else "tiny model",
        "model": model_desc(tiny),
        "rounds": {"warmup": 1, "timed": 1 if tiny else 9, "statistic": "median; pipelined step = slower rank"},
    }
    return Record(
        ID,
        TITLE,
        measured,
        row["baseline_ms"],
        row["ideal_speedup"],
        measured / row["ideal_speedup"],
        f"x speed-up (1F1B, m={m_key})",
        details,
        lines,
        baseline_unit="ms per step (one process)",
    )


def model_desc(tiny: bool) -> str:
    """A one-line description of the model used."""
    from .common import model_config

    return ", ".join(f"{k}={v}" for k, v in model_config(tiny).items())
