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
DEFAULT_SCHEDULE, DEFAULT_PARTITIONER = "1f1b", "uniform"


def compared_schedules(schedule: str) -> tuple[str, ...]:
    """The schedules one B1 run times: GPipe and 1F1B by default, else 1F1B and the chosen one (same run)."""
    name = schedule.lower()
    return SCHEDULES if name == DEFAULT_SCHEDULE else ("1f1b", name)


def stages_per_rank_of(schedule: str) -> int:
    """Stages per rank B1 gives a schedule: 1 for the single-stage ones, 2 for the multi-stage ones."""
    from lightning_3d.core.pipeline import is_multi_stage

    return 2 if is_multi_stage(schedule) else 1


def split_stages(
    model: Any, pp_rank: int, schedule: str, partitioner: str, example: Any, plans: dict[str, Any] | None = None
) -> list[tuple[int, Any]]:
    """This rank's stages of ``model``'s body at pp = 2, split by ``partitioner`` (``"compute"`` times the layers
    on ``example``, one micro-batch's input, ``"memory"`` profiles them) and placed as ``schedule`` places them;
    ``plans[schedule]`` receives the stage plan (layer names and each stage's estimate) when given."""
    from lightning_3d.core import partition
    from lightning_3d.core.balance import ComputePartitioner, MemoryPartitioner
    from lightning_3d.core.pipeline import stage_ranks

    spr = stages_per_rank_of(schedule)
    body = partition.find_body(model)
    part = partition.get_partitioner(partitioner)
    if isinstance(part, (ComputePartitioner, MemoryPartitioner)):
        part = part.for_input(example)
    plan = partition.plan_stages(body, 2, part, spr, stage_ranks(schedule, 2, spr))
    if plans is not None:
        plans[schedule] = {
            "layers": plan.layer_names,
            "estimates": plan.estimates,
            "predicted_imbalance": plan.predicted_imbalance(),  # from the estimates, per pp rank
        }
    return [
        (s, partition.stage_container(body, plan.layer_names[s]))
        for s in range(plan.num_stages)
        if plan.stage_to_rank[s] == pp_rank
    ]


def runnable_ms(schedule: str, ms: list[int]) -> list[int]:
    """The micro-batch counts of ``ms`` that ``schedule`` accepts at pp = 2."""
    from lightning_3d.core.pipeline import micro_batch_problem

    return [m for m in ms if micro_batch_problem(schedule, 2, m) is None]


def worker(
    ms: list[int],
    reps: int,
    warmup: int,
    tiny: bool,
    timeline_dir: str | None,
    timeline_m: int,
    timeline_steps: int = 5,
    schedule: str = DEFAULT_SCHEDULE,
    partitioner: str = DEFAULT_PARTITIONER,
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
        token_batch,
    )

    rank, world = init_distributed()
    assert world == 2, "B1 runs on 2 processes"
    config = model_config(tiny)
    whole = build_gpt(config)
    piece = copy.deepcopy(whole)
    x, y = token_batch(config, max(ms))
    names = compared_schedules(schedule)
    # every schedule splits the same copy (its layers are shared): each rank holds the stages its schedule places
    plans: dict[str, Any] = {}
    split = {name: split_stages(piece, rank, name, partitioner, x[:1], plans) for name in names}
    every_plan: list[Any] = [None, None]
    dist.all_gather_object(every_plan, plans)  # a measured split must be the same on both ranks
    assert every_plan[0] == every_plan[1], f"the ranks split the model differently: {every_plan}"
    params = list(piece.parameters()) + list(whole.parameters())
    # the first and the last stage: rank 0 and rank 1, or both rank 0 under a V schedule
    held = {name: {s for s, _ in split[name]} for name in names}
    ends = {name: (0 in held[name], 2 * len(held[name]) - 1 in held[name]) for name in names}
    schedules = {
        (name, m): build_schedule(name, split[name], 2 * len(split[name]), m)
        for name in names
        for m in runnable_ms(name, ms)
    }

    def step(name: str, m: int) -> None:
        first, last = ends[name]
        pipeline_step(schedules[name, m], first, last, x[:m], y[:m])

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
            for name in names:
                if (name, m) not in schedules:
                    continue
                zero()
                dist.barrier()
                start = time.perf_counter()
                step(name, m)
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    times.setdefault(f"{name}/{m}", []).append(elapsed)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, times)
    result: dict[str, Any] = {"rounds": {}, "timeline": {}, "split": plans}
    for key in gathered[0]:
        if key.startswith("base/"):
            result["rounds"][key] = gathered[0][key]
        else:  # the slower rank's time, step by step
            result["rounds"][key] = [max(a, b) for a, b in zip(gathered[0][key], gathered[1][key])]
    if timeline_dir is not None:
        for name in names:
            sched = schedules.get((name, timeline_m))
            if sched is None:
                continue
            recorded = []
            for _ in range(timeline_steps):
                zero()
                recorder = ScheduleRecorder()
                dist.barrier()
                with recorder.patch(sched):
                    step(name, timeline_m)
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


def imbalance_bound(stats: dict[str, Any]) -> dict[str, Any]:
    """Per-micro-batch compute of each pipeline rank, the speed-up the imbalance alone allows (p = 2) and the
    imbalance: the slowest rank's compute over the mean (a rank's stages together, as the schedule runs them)."""
    m = stats["n_micro"]
    c = [r["compute_ms"] / m for r in stats["ranks"].values()]
    bound = m * sum(c) / (sum(c) + (m - 1) * max(c))
    return {
        "compute_per_microbatch_ms": c,
        "speedup_bound": bound,
        "bound_over_ideal": bound / (2 * m / (m + 1)),
        "imbalance": max(c) / (sum(c) / len(c)),
    }


def run(
    out: Path, tiny: bool = False, schedule: str = DEFAULT_SCHEDULE, partitioner: str = DEFAULT_PARTITIONER
) -> Record:
    """Launch the two processes and build the record.

    Args:
        out: folder for the timeline pictures and traces.
        tiny: the tiny model and one round (checks the plumbing).
        schedule: the schedule timed beside 1F1B (``"1f1b"``, the default, times GPipe and 1F1B); the record's
            ratio is this schedule's at m = 8 (m = 4 with ``tiny``).
        partitioner: how the body is split into stages (``"uniform"``, ``"parameters"``, ``"compute"``,
            ``"memory"``), for every schedule of the run.
    """
    from lightning_3d.core.pipeline import check_schedule_name

    from .common import launch

    check_schedule_name(schedule)
    schedule = schedule.lower()
    names = compared_schedules(schedule)
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
            "schedule": schedule,
            "partitioner": partitioner,
        },
        timeout=240 if tiny else 420,
    )
    rounds = res["rounds"]
    table: dict[str, dict[str, Any]] = {}
    own = res["split"][schedule]
    stages = "; ".join(
        f"stage {i}: body[{', '.join(n)}]" + (f" ({own['estimates'][i]})" if own["estimates"] else "")
        for i, n in enumerate(own["layers"])
    )
    if own["predicted_imbalance"] is not None:
        stages += f"; predicted imbalance {own['predicted_imbalance']:.3f}"
    lines = [
        f"schedule {schedule} (stages per rank {stages_per_rank_of(schedule)}), partitioner {partitioner}",
        f"split: {stages}",
        "  m | one process ms | " + " | ".join(f"{n} ms  speed-up  /ideal" for n in names) + " | ideal 2m/(m+1)",
    ]
    for m in ms:
        base = median(rounds[f"base/{m}"]) * 1e3
        ideal = 2 * m / (m + 1)
        row: dict[str, Any] = {
            "baseline_ms": base,
            "ideal_speedup": ideal,
            "baseline_rounds_ms": [v * 1e3 for v in rounds[f"base/{m}"]],
        }
        cells = []
        for name in names:
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
        lines.append(f"{m:3d} | {base:14.1f} | {' | '.join(cells)} | {ideal:.3f}")
    bounds = {}
    for name, stats in res["timeline"].items():
        bound = imbalance_bound(stats)
        bounds[name] = bound
        ranks = stats["ranks"]
        lines.append(
            f"timeline {name} m={stats['n_micro']}: step {stats['span_ms']:.1f} ms, bubble measured "
            f"{stats['measured']:.1%} vs theory {stats['theory']:.1%} ({stats.get('theory_source', 'formula')}); "
            "per stage compute/micro-batch "
            + ", ".join(f"{c:.1f}" for c in bound["compute_per_microbatch_ms"])
            + " ms, waiting for the neighbour "
            + ", ".join(f"{r['recv_wait_ms']:.1f}" for r in ranks.values())
            + " ms, p2p post/send "
            + ", ".join(f"{r['send_ms']:.1f}" for r in ranks.values())
            + f" ms; imbalance (slowest / mean) {bound['imbalance']:.3f} alone bounds the speed-up at "
            f"{bound['speedup_bound']:.3f} ({bound['bound_over_ideal']:.3f} of ideal)"
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
    measured = row[schedule]["speedup"]
    details = {
        "schedule": schedule,
        "partitioner": partitioner,
        "stages_per_rank": stages_per_rank_of(schedule),
        "imbalance": bounds[schedule]["imbalance"] if schedule in bounds else None,
        "split": res["split"],  # each schedule's stages (layer names) and the partitioner's estimate of each
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
        f"x speed-up ({schedule}, {partitioner} partitioner, m={m_key})",
        details,
        lines,
        baseline_unit="ms per step (one process)",
    )


def model_desc(tiny: bool) -> str:
    """A one-line description of the model used."""
    from .common import model_config

    return ", ".join(f"{k}={v}" for k, v in model_config(tiny).items())
