"""B1 pipeline efficiency: pp=2 on 2 processes (1F1B and GPipe, m = 1, 2, 4, 8, 16) against one process.

Two processes, one thread each. The benchmark GPT's body is split as ``ThreeDStrategy`` splits it (uniform:
embedding + 4 blocks | 4 blocks + head) and run with torch's ``ScheduleGPipe`` / ``Schedule1F1B`` over
``PipelineStage`` (the objects the strategy builds), micro-batches of one sequence (1 x 128 tokens). The
baseline, in the same run and the same processes, is rank 0 alone running the whole model over the same m
micro-batches (forward + backward each, gradients accumulated) while rank 1 waits in a barrier. Rounds
alternate baseline, GPipe and 1F1B for every m so that drifting load hits all of them alike; figures are
medians over the rounds after warm-up rounds (the first step of a schedule exchanges shapes). A pipelined
step's time is the slower rank's. No optimizer step on either side: this is the schedule's efficiency.
At the timeline's m both ranks also run the whole model at once (no pipeline): a pipelined step keeps both
cores busy, and on a shared or hyper-threaded host that alone slows each process; the record reports that
factor and the ratio against a baseline slowed as much (:func:`host_contention`), beside the plain ratio.

Speed-up = baseline time / pipelined time; the ideal speed-up of a balanced 2-stage pipeline with free
communication is ``2m / (m + 1)`` (bubble ``(p - 1) / (m + p - 1)``); the record's ratio is measured / ideal
for 1F1B at m = 8. Seven more steps of each schedule at m = 8 are recorded with :mod:`lightning_3d.tools.timeline`
(the one of median length goes to a Chrome trace + Gantt chart in the output folder): the record splits the
step into compute, waiting for the neighbour and the rest, and gives the bound that the measured stage
imbalance alone allows,
``m (c0 + c1) / (c0 + c1 + (m - 1) max(c0, c1))`` with ``c_s`` the compute per micro-batch of stage ``s``.
The record's ``details.imbalance`` is taken over all seven steps (each rank's median compute, slowest over mean:
:func:`imbalance_over_steps`), with each step's own figure beside it for the spread.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "B1", "pipeline efficiency: pp=2 on 2 processes (1F1B, GPipe) vs one process"
SCHEDULES = ("gpipe", "1f1b")
DEFAULT_SCHEDULE, DEFAULT_PARTITIONER = "1f1b", "uniform"


def compared_schedules(schedule: str) -> tuple[str, ...]:
    """The schedules one B1 run times: GPipe and 1F1B by default, else 1F1B and the chosen one (same run)."""
    from lightning_3d.core.csv_schedule import is_csv_schedule

    name = schedule if is_csv_schedule(schedule) else schedule.lower()
    return SCHEDULES if name == DEFAULT_SCHEDULE else ("1f1b", name)


def schedule_label(schedule: str) -> str:
    """A schedule's name in file names: a CSV action list's file stem, else the name."""
    from lightning_3d.core.csv_schedule import is_csv_schedule

    return Path(schedule).stem if is_csv_schedule(schedule) else schedule.replace(":", "-")


def stages_per_rank_of(schedule: str) -> int:
    """Stages per rank B1 gives a schedule: 1 for the single-stage ones, 2 for the multi-stage ones, a CSV action
    list's own."""
    from lightning_3d.core.csv_schedule import is_csv_schedule, read_csv_schedule
    from lightning_3d.core.pipeline import is_multi_stage

    from .common import schedule_spec

    if is_csv_schedule(schedule):  # the file's own count (a 1F1B-like list has one stage per rank)
        return read_csv_schedule(schedule).stages_per_rank
    name, spr = schedule_spec(schedule)
    if spr is not None:  # NAME:STAGES_PER_RANK
        return spr
    return 2 if is_multi_stage(name) else 1


def split_stages(
    model: Any, pp_rank: int, schedule: str, partitioner: str, example: Any, plans: dict[str, Any] | None = None
) -> list[tuple[int, Any]]:
    """This rank's stages of ``model``'s body at pp = 2, split by ``partitioner`` (``"compute"`` times the layers
    on ``example``, one micro-batch's input, ``"memory"`` profiles them) and placed as ``schedule`` places them;
    ``plans[schedule]`` receives the stage plan (layer names and each stage's estimate) when given."""
    from lightning_3d.core import partition
    from lightning_3d.core.balance import ComputePartitioner, MemoryPartitioner
    from lightning_3d.core.pipeline import stage_ranks

    from .common import schedule_spec

    spr = stages_per_rank_of(schedule)
    body = partition.find_body(model)
    part = partition.get_partitioner(partitioner)
    if isinstance(part, (ComputePartitioner, MemoryPartitioner)):
        part = part.for_input(example)
    placement = stage_ranks(schedule_spec(schedule)[0], 2, spr)
    plan = partition.plan_stages(body, 2, part, spr, placement, example=example)
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

    from .common import schedule_spec

    return [m for m in ms if micro_batch_problem(schedule_spec(schedule)[0], 2, m) is None]


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
    split_backward: str = "linear",
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
        (name, m): build_schedule(name, split[name], 2 * len(split[name]), m, split_backward=split_backward)
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

    def timed(key: str, run: Any, keep: bool) -> None:
        start = time.perf_counter()
        run()
        if keep:
            times.setdefault(key, []).append(time.perf_counter() - start)

    for round_ in range(warmup + reps):
        kept = round_ >= warmup
        for m in ms:
            zero()
            dist.barrier()
            if rank == 0:
                timed(f"base/{m}", lambda m=m: baseline(m), kept)
            dist.barrier()
            if m == timeline_m:  # the host's share: both ranks run the whole model at once, no pipeline
                zero()
                dist.barrier()
                timed(f"pair/{m}", lambda m=m: baseline(m), kept)
                dist.barrier()
            for name in names:
                if (name, m) not in schedules:
                    continue
                zero()
                dist.barrier()
                timed(f"{name}/{m}", lambda name=name, m=m: step(name, m), kept)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, times)
    result: dict[str, Any] = {"rounds": {}, "timeline": {}, "split": plans}
    for key in gathered[0]:
        if key.startswith("base/"):
            result["rounds"][key] = gathered[0][key]
        elif key.startswith("pair/"):  # each rank's own time: how much the other busy core slowed it
            result["rounds"][key] = [list(pair) for pair in zip(gathered[0][key], gathered[1][key])]
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
                stem = Path(timeline_dir) / f"B1_timeline_{schedule_label(name)}_m{timeline_m}"
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


def imbalance_over_steps(stats: dict[str, Any]) -> dict[str, Any]:
    """The imbalance from every recorded step: each rank's median compute over the steps, slowest over mean.

    One step's ``max(c) / mean(c)`` takes the larger of two noisy figures, so host noise that slows either rank in
    that step reads as imbalance (the expected maximum of noisy numbers exceeds the maximum of their expectations);
    which rank is the slower one flips from step to step on this host. The median of each rank's own compute over
    the recorded steps keeps a rank that is slower in every step (a heavier stage, a slower core) and drops what a
    single step's noise adds. ``per_step`` keeps each step's own imbalance, for the spread."""
    steps = stats.get("recorded_steps") or [stats]
    m = stats["n_micro"]
    keys = list(stats["ranks"])
    per_rank = [median([st["ranks"][k]["compute_ms"] for st in steps]) / m for k in keys]
    per_step = []
    for st in steps:
        c = [st["ranks"][k]["compute_ms"] for k in keys]
        per_step.append(max(c) / (sum(c) / len(c)))
    return {
        "compute_per_microbatch_ms": per_rank,
        "imbalance": max(per_rank) / (sum(per_rank) / len(per_rank)),
        "per_step": per_step,
        "steps": len(steps),
    }


def host_contention(
    pair_rounds: Sequence[Sequence[float]], baseline_ms: float, speedup: float, m: int
) -> dict[str, Any]:
    """How much the host slows one process when the other core is busy too, and the pipeline's ratio without it.

    ``pair_rounds`` holds, per round, each rank's time (seconds) for the whole model over ``m`` micro-batches with
    both ranks running it at once (no pipeline, no communication); ``baseline_ms`` is rank 0's time alone. The
    factor is the ranks' median times, averaged, over ``baseline_ms``. A pipelined step keeps both cores busy, so
    its compute pays this factor whatever the schedule: ``speedup * factor / ideal`` is the ratio the pipeline
    would reach against a one-process baseline slowed as much (what is left is the bubble, imbalance and p2p).
    """
    per_rank = [median([r[k] for r in pair_rounds]) * 1e3 for k in range(len(pair_rounds[0]))]
    factor = sum(per_rank) / len(per_rank) / baseline_ms
    ideal = 2 * m / (m + 1)
    return {
        "both_ranks_ms": per_rank,
        "alone_ms": baseline_ms,
        "factor": factor,
        "ratio_against_contended_baseline": speedup * factor / ideal,
    }


def run(
    out: Path,
    tiny: bool = False,
    schedule: str = DEFAULT_SCHEDULE,
    partitioner: str = DEFAULT_PARTITIONER,
    split_backward: str = "linear",
) -> Record:
    """Launch the two processes and build the record.

    Args:
        out: folder for the timeline pictures and traces.
        tiny: the tiny model and one round (checks the plumbing).
        schedule: the schedule timed beside 1F1B (``"1f1b"``, the default, times GPipe and 1F1B); the record's
            ratio is this schedule's at m = 8 (m = 4 with ``tiny``).
        partitioner: how the body is split into stages (``"uniform"``, ``"parameters"``, ``"compute"``,
            ``"memory"``), for every schedule of the run.
        split_backward: how a zero-bubble schedule's stages split the backward, as the strategy's setting
            (``"linear"``, the default, or torch's ``"autograd"``).
    """
    from lightning_3d.core.csv_schedule import is_csv_schedule

    from .common import checked_stages_per_rank, launch

    checked_stages_per_rank(schedule)  # the name, and NAME:STAGES_PER_RANK's count, as the strategy checks them
    schedule = schedule if is_csv_schedule(schedule) else schedule.lower()
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
            "split_backward": split_backward,
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
        f"schedule {schedule} (stages per rank {stages_per_rank_of(schedule)}), partitioner {partitioner}, "
        f"split_backward {split_backward}",
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
        bound["over_steps"] = over = imbalance_over_steps(stats)
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
            f"stalls {stalls[0]:.1f}..{stalls[-1]:.1f} ms; imbalance over the steps (each rank's median compute "
            f"{', '.join(f'{c:.1f}' for c in over['compute_per_microbatch_ms'])} ms a micro-batch) "
            f"{over['imbalance']:.3f}, single steps {min(over['per_step']):.3f}..{max(over['per_step']):.3f}"
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
    contention = host_contention(rounds[f"pair/{m_key}"], row["baseline_ms"], measured, timeline_m)
    lines.append(
        f"host contention at m={m_key}: the whole model on both ranks at once (no pipeline) takes "
        + ", ".join(f"{t:.1f}" for t in contention["both_ranks_ms"])
        + f" ms vs {row['baseline_ms']:.1f} ms alone (x{contention['factor']:.3f}); against that slowed one-process "
        f"baseline {schedule}'s speed-up is {contention['ratio_against_contended_baseline']:.3f} of ideal"
    )
    details = {
        "schedule": schedule,
        "partitioner": partitioner,
        "split_backward": split_backward,
        "stages_per_rank": stages_per_rank_of(schedule),
        # each rank's median compute over the recorded steps, slowest over mean (imbalance_over_steps)
        "imbalance": bounds[schedule]["over_steps"]["imbalance"] if schedule in bounds else None,
        # the same from the step of median length alone (before 2026-12-06 this was "imbalance")
        "imbalance_median_step": bounds[schedule]["imbalance"] if schedule in bounds else None,
        "split": res["split"],  # each schedule's stages (layer names) and the partitioner's estimate of each
        "table": table,
        "timeline": res["timeline"],
        "bounds": bounds,
        "host_contention": contention,  # the whole model on both cores at once vs alone (see host_contention)
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


# ---------------------------------------------------------------------- the sweep: every schedule, pp 2 and 4
#: ``python -m benchmarks B1 --sweep``: every schedule at pp = 2 and 4 with m = 4, 8, 16 (a short cell each).
#: Multi-stage schedules run two stages per rank, ``NAME:1`` one (``interleavedzerobubble:1``: ZB-H1).
#: ``"csv"`` is a CSV action list (``schedule="path.csv"``): the greedy zero-bubble schedule with one stage per
#: rank (``csv_schedule.zero_bubble_greedy_rows``), written for each pp and m.
SWEEP_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved1f1b",
    "loopedbfs",
    "interleavedzerobubble",
    "interleavedzerobubble:1",
    "zbvzerobubble",
    "dualpipev",
    "csv",
)
SWEEP_PPS, SWEEP_MS = (2, 4), (4, 8, 16)
#: eight blocks (two per stage at pp = 4 with two stages per rank), small enough for a 2-core machine
SWEEP_MODEL: dict[str, Any] = {"preset": "small", "n_embd": 128, "n_head": 4, "n_layer": 8, "block_size": 64}
ZERO_BUBBLE_SWEEP = ("interleavedzerobubble", "interleavedzerobubble:1", "zbvzerobubble", "dualpipev", "csv")


def sweep_csv_path(folder: str | Path, pp: int, m: int) -> Path:
    """Where the sweep's CSV schedule for ``pp`` and ``m`` is written."""
    return Path(folder) / f"zero_bubble_greedy_pp{pp}_m{m}.csv"


def _sweep_schedule_name(name: str, csv_dir: str, pp: int, m: int) -> str:
    return str(sweep_csv_path(csv_dir, pp, m)) if name == "csv" else name


def sweep_worker(
    names: list[str],
    ms: list[int],
    csv_dir: str,
    reps: int,
    warmup: int,
    model: dict[str, Any],
    split_backward: str = "linear",
    partitioner: str = "uniform",
) -> dict[str, Any]:
    """Runs on every rank (pp = world size): per m, rank 0 alone runs the whole model (baseline), then each
    schedule runs ``warmup + reps`` steps in alternation (rounds), then one recorded step per (schedule, m) for
    the measured and theoretical bubble. Each schedule's stages are split by ``partitioner`` for its own
    placement (``"compute"`` times the layers once, on one micro-batch). Returns the slower rank's step times, the
    bubbles and each schedule's split."""
    import torch.distributed as dist

    from lightning_3d.core import partition, torch_compat
    from lightning_3d.core.balance import ComputePartitioner, MemoryPartitioner
    from lightning_3d.core.pipeline import is_multi_stage, micro_batch_problem, stage_ranks
    from lightning_3d.tools.timeline import ScheduleRecorder, bubble_stats, gather_timelines

    from .common import (
        build_gpt,
        build_schedule,
        cpu_stages,
        defers_linear,
        gpt_loss,
        init_distributed,
        pipeline_step,
        schedule_spec,
        token_batch,
    )

    rank, pp = init_distributed()
    whole = build_gpt(model)
    piece = copy.deepcopy(whole)
    x, y = token_batch(model, max(ms))
    body = partition.find_body(piece)
    part = partition.get_partitioner(partitioner)
    if isinstance(part, (ComputePartitioner, MemoryPartitioner)):
        part = part.for_input(x[:1])  # one instance: the layers are timed (or profiled) once for every schedule
    cells: dict[tuple[str, int], tuple[Any, bool, bool]] = {}
    splits: dict[str, Any] = {}
    for name in names:
        for m in ms:
            sched_name, given_spr = schedule_spec(_sweep_schedule_name(name, csv_dir, pp, m))
            if micro_batch_problem(sched_name, pp, m) is not None:
                continue
            spr = given_spr or (1 if name == "csv" or not is_multi_stage(sched_name) else 2)
            placement = stage_ranks(sched_name, pp, spr)
            plan = partition.plan_stages(body, pp, part, spr, placement, example=x[:1])
            splits[name] = {"layers": plan.layer_names, "placement": placement}
            mine = [
                (s, partition.stage_container(body, plan.layer_names[s]))
                for s in range(plan.num_stages)
                if placement[s] == rank
            ]
            if name == "csv":
                built = cpu_stages(mine, plan.num_stages, defer_linear=defers_linear(sched_name, split_backward))
                sched = torch_compat.csv_schedule(built, m, sched_name, loss_fn=gpt_loss)
            else:
                sched = build_schedule(name, mine, plan.num_stages, m, split_backward=split_backward)
            held = {s for s, _ in mine}
            cells[name, m] = (sched, 0 in held, plan.num_stages - 1 in held)
    params = list(piece.parameters()) + list(whole.parameters())

    def zero() -> None:
        for p in params:
            p.grad = None

    def step(name: str, m: int) -> None:
        sched, first, last = cells[name, m]
        pipeline_step(sched, first, last, x[:m], y[:m])

    times: dict[str, list[float]] = {}
    for round_ in range(warmup + reps):
        for m in ms:
            zero()
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                for i in range(m):
                    gpt_loss(whole(x[i : i + 1]), y[i : i + 1]).backward()
                if round_ >= warmup:
                    times.setdefault(f"base/{m}", []).append(time.perf_counter() - start)
            dist.barrier()
            for name in names:
                if (name, m) not in cells:
                    continue
                zero()
                dist.barrier()
                start = time.perf_counter()
                step(name, m)
                if round_ >= warmup:
                    times.setdefault(f"{name}/{m}", []).append(time.perf_counter() - start)
    bubbles: dict[str, dict[str, Any]] = {}
    for (name, m), (sched, _, _) in cells.items():
        zero()
        recorder = ScheduleRecorder()
        dist.barrier()
        with recorder.patch(sched):
            step(name, m)
        stats = bubble_stats(gather_timelines(recorder.timeline(sched, {"pp": rank})))
        bubbles[f"{name}/{m}"] = {
            "measured": stats["measured"],
            "theory": stats["theory"],
            "theory_source": stats.get("theory_source", "formula"),
            "span_ms": stats["span_ms"],
            # every rank's compute (forward, backward, weight-gradient, loss): against the one-process step it
            # says how much the schedule's split of the work costs besides the bubble
            "compute_ms": sum(r["compute_ms"] for r in stats["ranks"].values()),
        }
    gathered: list[Any] = [None] * pp
    dist.all_gather_object(gathered, times)
    rounds = {}
    for key in gathered[0]:
        if key.startswith("base/"):
            rounds[key] = gathered[0][key]
        else:  # the slowest rank's time, step by step
            rounds[key] = [max(per_rank) for per_rank in zip(*(g[key] for g in gathered))]
    return {"rounds": rounds, "bubbles": bubbles, "splits": splits}


def sweep_table(results: dict[str, Any], names: Sequence[str], ms: Sequence[int]) -> list[str]:
    """The sweep as a markdown table: one row per (pp, schedule), one column per m; each cell is the speed-up
    over one process divided by the ideal ``p m / (m + p - 1)``, then the measured / theoretical bubble."""
    lines = [
        "| pp | schedule | "
        + " | ".join(f"m={m}: speed-up/ideal (speed-up), bubble measured/theory, compute/1-process" for m in ms)
        + " |",
        "|---|---|" + "---|" * len(ms),
    ]
    for pp_key, per_pp in results.items():
        for name in names:
            cells = []
            for m in ms:
                cell = per_pp["cells"].get(f"{name}/{m}")
                if cell is None:
                    cells.append("not runnable")
                    continue
                cells.append(
                    f"{cell['ratio']:.2f} (x{cell['speedup']:.2f}), {cell['bubble_measured']:.0%}/"
                    f"{cell['bubble_theory']:.0%}, {cell['compute_over_baseline']:.2f}"
                )
            lines.append(f"| {pp_key} | {name} | " + " | ".join(cells) + " |")
    return lines


def zero_bubble_goals(results: dict[str, Any], ms: Sequence[int]) -> list[dict[str, Any]]:
    """The issue's goal per (pp, m, zero-bubble schedule): its speed at or above 1F1B's at the same m.

    Judged round by round, as B1 judges a schedule beside 1F1B: each round's 1F1B step time over the schedule's
    (the two ran back to back in that round), and the goal met when the median of those ratios is at least 1.
    Cells without their rounds (``rounds_ms``) compare the two speed-ups of the medians instead."""
    goals = []
    for pp_key, per_pp in results.items():
        for m in ms:
            ref = per_pp["cells"].get(f"1f1b/{m}")
            for name in ZERO_BUBBLE_SWEEP:
                cell = per_pp["cells"].get(f"{name}/{m}")
                if ref is None or cell is None:
                    continue
                paired = [a / b for a, b in zip(ref.get("rounds_ms", ()), cell.get("rounds_ms", ()))]
                over = median(paired) if paired else cell["speedup"] / ref["speedup"]
                goals.append(
                    {
                        "pp": pp_key,
                        "m": m,
                        "schedule": name,
                        "speedup": cell["speedup"],
                        "speedup_1f1b": ref["speedup"],
                        "over_1f1b": over,  # median over rounds of 1F1B's step time / this schedule's
                        "over_1f1b_range": [min(paired), max(paired)] if paired else [over, over],
                        "met": over >= 1.0,
                    }
                )
    return goals


def run_sweep(
    out: Path, reps: int = 7, warmup: int = 1, split_backward: str = "linear", partitioner: str = "uniform"
) -> dict[str, Any]:
    """``python -m benchmarks B1 --sweep --out DIR``: every schedule at pp = 2 (2 processes) and pp = 4 (4
    processes), m = 4, 8, 16, against one process; writes ``DIR/B1_sweep.json`` and ``DIR/B1_sweep.md``.

    A cell is ``warmup + reps`` steps (median of the timed ones; a step's time is the slowest rank's) plus one
    step recorded with the timeline for the measured bubble (mean over pipeline ranks of 1 - compute / step)
    beside the theoretical one (from the schedule's action list for the zero-bubble and CSV schedules, else
    ``(p - 1) / (v m + p - 1)``). The baseline is rank 0 alone running the whole model over the same m
    micro-batches (one sequence each), in the same rounds. The ideal is a balanced 1F1B pipeline's speed-up with
    free communication, ``p m / (m + p - 1)``: a zero-bubble schedule can exceed it. The zero-bubble goal (at or
    above 1F1B) is judged on the rounds' paired ratios (:func:`zero_bubble_goals`).
    """
    from lightning_3d.core.csv_schedule import write_zero_bubble_greedy_csv

    from .common import environment, launch, loadavg

    out.mkdir(parents=True, exist_ok=True)
    csv_dir = out / "B1_sweep_schedules"
    csv_dir.mkdir(exist_ok=True)
    env = environment()
    started = time.monotonic()
    results: dict[str, Any] = {}
    for pp in SWEEP_PPS:
        for m in SWEEP_MS:
            write_zero_bubble_greedy_csv(pp, m, sweep_csv_path(csv_dir, pp, m))
        res = launch(
            "b1_pipeline:sweep_worker",
            pp,
            {
                "names": list(SWEEP_SCHEDULES),
                "ms": list(SWEEP_MS),
                "csv_dir": str(csv_dir.resolve()),
                "reps": reps,
                "warmup": warmup,
                "model": SWEEP_MODEL,
                "split_backward": split_backward,
                "partitioner": partitioner,
            },
            timeout=600,
        )
        cells = {}
        for m in SWEEP_MS:
            base = median(res["rounds"][f"base/{m}"])
            ideal = pp * m / (m + pp - 1)
            for name in SWEEP_SCHEDULES:
                key = f"{name}/{m}"
                if key not in res["rounds"]:
                    continue
                t = median(res["rounds"][key])
                cells[key] = {
                    "ms": t * 1e3,
                    "baseline_ms": base * 1e3,
                    "speedup": base / t,
                    "ideal_speedup": ideal,
                    "ratio": base / t / ideal,
                    "bubble_measured": res["bubbles"][key]["measured"],
                    "bubble_theory": res["bubbles"][key]["theory"],
                    "theory_source": res["bubbles"][key]["theory_source"],
                    "compute_over_baseline": res["bubbles"][key]["compute_ms"] / (base * 1e3),
                    "rounds_ms": [v * 1e3 for v in res["rounds"][key]],
                }
        results[f"pp{pp}"] = {"processes": pp, "cells": cells, "splits": res["splits"]}
    table = sweep_table(results, SWEEP_SCHEDULES, SWEEP_MS)
    goals = zero_bubble_goals(results, SWEEP_MS)
    seconds = time.monotonic() - started
    record = {
        "id": "B1_sweep",
        "title": "every pipeline schedule at pp = 2 and 4, m = 4, 8, 16, against one process",
        "model": SWEEP_MODEL,
        "micro_batch": f"1 sequence x {SWEEP_MODEL['block_size']} tokens",
        "rounds": {
            "warmup": warmup,
            "timed": reps,
            "statistic": "median; pipelined step = slowest rank; goals: median of each round's 1F1B / schedule",
        },
        "ideal": "p m / (m + p - 1) (balanced 1F1B, free communication)",
        "split_backward": split_backward,
        "partitioner": partitioner,
        "results": results,
        "zero_bubble_goals": goals,
        "table_markdown": table,
        "environment": env,
        "loadavg_end": loadavg(),
        "seconds": seconds,
    }
    (out / "B1_sweep.json").write_text(json.dumps(record, indent=2, default=str))
    load = f"load average {env['loadavg_start']} -> {record['loadavg_end']}"
    met = sum(g["met"] for g in goals)
    summary = [
        f"B1 sweep ({env['time']}, {env['cpu_count']} cores, {load}, {seconds:.0f} s; split_backward {split_backward}, "
        f"partitioner {partitioner})",
        "",
        *table,
        "",
        f"zero-bubble schedules at or above 1F1B at the same pp and m, round by round: {met} of {len(goals)} cells"
        + " (1F1B's step time over the schedule's, median of the rounds, range)"
        + "".join(
            f"\n- {'met' if g['met'] else 'not met'}: {g['schedule']} at {g['pp']} m={g['m']}: "
            f"{g['over_1f1b']:.2f} ({g['over_1f1b_range'][0]:.2f}-{g['over_1f1b_range'][1]:.2f}); speed-up "
            f"x{g['speedup']:.2f} vs 1F1B x{g['speedup_1f1b']:.2f}"
            for g in goals
        ),
    ]
    (out / "B1_sweep.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary), flush=True)
    return record
