"""P1 planner check: every valid (tp, pp, dp, m) layout of the example GPT on 8 CPU processes, measured against
the planner's prediction (``lightning_3d.plan`` with the ``cpu8`` cluster file, written by ``calibrate=true``).

The model is the main job's GPT "small" (4 layers, hidden 128, 4 heads, sequence 64, bytes), the global batch 32
sequences. The layouts: tp in 1, 2, 4 (heads), pp in 1, 2, 4 (layers), dp = 8 / (tp pp), and for each the two
smallest micro-batch counts 1F1B takes (pp and 2 pp; 1 and 2 without a pipeline), replicated data parallelism, no
recomputation: 16 layouts. All of them run in ONE job of 8 processes (one ``Trainer.fit`` of a few steps per
layout, one thread each), so the start-up is paid once. A step is start-to-start of consecutive batches, the
slowest rank's median after warm-up steps; the spread is the timed steps' min and max.

Resumable: each measured layout is appended to ``OUT/P1_runs.jsonl`` as it finishes; a rerun measures only the
missing ones (``--fresh`` is not needed: delete the file to start over). The job has a hard time limit; what it
measured before the limit is kept.

Reported: the median absolute relative error of the predicted step time, Spearman's rank correlation between
predicted and measured times, and how much slower (measured) the planner's predicted best is than the measured
best. The prediction takes the runnable processes of other jobs just before the job starts (sampled for two
seconds, ``plan.calibrate.background_load``) as ``cluster.background_load``; on a quiet machine it is about 0.
Targets (issue 15): error <= 15%,
correlation >= 0.8, predicted best within 5% of the measured best.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .common import Record, median

ID = "P1"
TITLE = "planner: predicted vs measured step time of every (tp, pp, dp, m) layout, GPT small on 8 CPU processes"
MODEL: dict[str, Any] = {"preset": "small", "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}
TINY_MODEL: dict[str, Any] = {"preset": "tiny", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
GLOBAL_BATCH = 32
PROCESSES = 8


def layouts(model: dict[str, Any], global_batch: int = GLOBAL_BATCH, processes: int = PROCESSES) -> list[dict]:
    """Every (tp, pp, dp, m) this benchmark measures."""
    out = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if processes % (tp * pp) or pp > model["n_layer"] or model["n_head"] % tp:
                continue
            dp = processes // (tp * pp)
            replica = global_batch // dp
            for m in (pp, 2 * pp):
                if replica % m == 0:
                    out.append({"tp": tp, "pp": pp, "dp": dp, "m": m, "batch": replica})
    return out


def _key(lay: dict[str, int]) -> str:
    return f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} m{lay['m']}"


def worker(
    model: dict[str, Any], todo: list[dict[str, int]], steps: int, warmup: int, runs_file: str, background: float
) -> dict:
    """On every rank: one short ``Trainer.fit`` per layout; rank 0 appends each result to ``runs_file``."""
    import lightning as L
    import torch.distributed as dist

    from .common import fit_3d, init_distributed

    rank, _ = init_distributed()

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.starts.append(time.perf_counter())

    done = 0
    for lay in todo:
        clock = Clock()
        started = time.monotonic()
        fit_3d(
            model,
            clock,
            tp=lay["tp"],
            pp=lay["pp"],
            micro_batches=lay["m"],
            batch=lay["batch"],
            steps=warmup + steps,
            devices=lay["tp"] * lay["pp"] * lay["dp"],
        )
        steps_s = [b - a for a, b in zip(clock.starts, clock.starts[1:])][warmup:]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, steps_s)
        if rank == 0:
            slowest = max(gathered, key=median)
            record = {
                **lay,
                "key": _key(lay),
                "step_s": median(slowest),
                "min_s": min(slowest),
                "max_s": max(slowest),
                "steps_s": slowest,
                "fit_s": time.monotonic() - started,
                "background_load": background,
            }
            with open(runs_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        done += 1
    return {"done": done}


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def predict(model: dict[str, Any], lay: dict[str, int], cluster: Any) -> dict[str, float]:
    """The planner's step time and memory for a measured layout."""
    from lightning_3d.plan import Layout, evaluate, model_from_config

    spec = model_from_config(model)
    entry = evaluate(spec, cluster, Layout(lay["tp"], lay["pp"], lay["dp"], lay["m"], lay["batch"] // lay["m"]))
    parts = {f"t_{k}": v for k, v in entry.time.as_dict().items()}
    return {"step_s": entry.step_s, "memory_gib": entry.memory.gib, **parts}


def run(out: Path, tiny: bool = False) -> Record:
    """Measure the missing layouts (one 8-process job), predict all, compare."""
    from lightning_3d.plan import load_cluster

    from .common import LaunchError, launch

    model = dict(TINY_MODEL if tiny else MODEL)
    steps, warmup = (2, 1) if tiny else (5, 2)
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / ("P1_runs_tiny.jsonl" if tiny else "P1_runs.jsonl")
    measured: dict[str, dict[str, Any]] = {}
    if runs_file.exists():
        for line in runs_file.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                measured[rec["key"]] = rec
    all_layouts = layouts(model)
    todo = [lay for lay in all_layouts if _key(lay) not in measured]
    error = None
    if todo:
        from lightning_3d.plan.calibrate import background_load

        # Other jobs' runnable processes before ours start (sampled now, not the lagging load average, which would
        # still count a calibration that just ended): an input of the prediction (cluster.background_load).
        background = background_load()
        try:
            launch(
                "p1_planner:worker",
                PROCESSES,
                {
                    "model": model,
                    "todo": todo,
                    "steps": steps,
                    "warmup": warmup,
                    "runs_file": str(runs_file),
                    "background": background,
                },
                timeout=900,
            )
        except LaunchError as err:  # keep what was measured; a rerun continues
            error = str(err)[-2000:]
        for line in runs_file.read_text().splitlines() if runs_file.exists() else []:
            if line.strip():
                rec = json.loads(line)
                measured[rec["key"]] = rec
    cluster = load_cluster("cpu8")
    rows = []
    for lay in all_layouts:
        rec = measured.get(_key(lay))
        if rec is None:
            continue
        pred = predict(model, lay, dataclasses.replace(cluster, background_load=rec.get("background_load", 0.0)))
        error_rel = pred["step_s"] / rec["step_s"] - 1
        rows.append({**rec, "predicted_s": pred["step_s"], "error": error_rel, "prediction": pred})
    lines = [f"{'layout':<18} {'measured':>10} {'(min-max)':>17} {'predicted':>10} {'error':>7}"]
    for r in sorted(rows, key=lambda r: r["step_s"]):
        lines.append(
            f"{r['key']:<18} {r['step_s'] * 1e3:>8.1f}ms ({r['min_s'] * 1e3:>6.1f}-{r['max_s'] * 1e3:>6.1f}) "
            f"{r['predicted_s'] * 1e3:>8.1f}ms {r['error']:>+7.1%}"
        )
    if len(rows) >= 2:
        mae = median([abs(r["error"]) for r in rows])
        rho = _spearman([r["predicted_s"] for r in rows], [r["step_s"] for r in rows])
        best_measured = min(rows, key=lambda r: r["step_s"])
        best_predicted = min(rows, key=lambda r: r["predicted_s"])
        gap = best_predicted["step_s"] / best_measured["step_s"] - 1
        spread = median([(r["max_s"] - r["min_s"]) / r["step_s"] for r in rows])
        lines.append(
            f"{len(rows)} of {len(all_layouts)} layouts measured; median |error| {mae:.1%}, Spearman {rho:.2f}; "
            f"predicted best {best_predicted['key']} is {gap:+.1%} from the measured best {best_measured['key']}; "
            f"median spread (max-min)/median of the timed steps {spread:.0%}"
        )
        value = {"median_abs_error": mae, "spearman": rho, "best_gap": gap, "layouts": len(rows), "spread": spread}
    else:
        value = {"layouts": len(rows)}
    if error:
        lines.append(f"the job stopped early (rerun to continue): {error.splitlines()[0] if error else ''}")
    details = {
        "model": model,
        "global_batch": GLOBAL_BATCH,
        "processes": PROCESSES,
        "rows": rows,
        "error": error,
        "cluster": {k: getattr(cluster, k) for k in cluster.__dataclass_fields__},
    }
    ideal = {"median_abs_error": 0.15, "spearman": 0.8, "best_gap": 0.05}
    return Record(ID, TITLE, value, None, ideal, None, "", details, lines)
