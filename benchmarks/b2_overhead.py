"""B2 strategy overhead: ``Trainer(strategy=ThreeDStrategy)`` against a hand-written loop, same processes.

Two processes, one thread each, two variants: ``pp=2`` (1F1B, 8 micro-batches of one sequence) and ``tp=2``
(pp=1, one micro-batch of 8 sequences). Both sides train the benchmark GPT with the same split, the same
tensor-parallel plan (the strategy's automatic one, applied with ``parallelize_module``), torch's
``PipelineStage`` + ``Schedule1F1B`` and the module's own ``configure_optimizers`` (AdamW), on the same
batches from a ``DataLoader``. The hand-written loop is what a user of ``torch.distributed.pipelining`` writes::

    for x, y in loader:
        schedule.step(x) / schedule.step(target=y)   # first / last stage
        optimizer.step(); optimizer.zero_grad()

The strategy side is ``Trainer.fit`` of the unchanged example GPT (its ``training_step`` logs ``train_loss``
with ``sync_dist=True``, which the strategy relays from the last stage), with logger, progress bar,
checkpointing and model summary off. Order in the same processes: for pp=2 three rounds of hand loop /
Trainer / Trainer with ``on_nonfinite="off"`` and a last hand loop (each phase with its own fresh objects and
warm-up steps; the phases of one kind are pooled), for tp=2 hand loop / Trainer / hand loop. A step's time is
start-to-start of consecutive batches (batch fetch, step, optimizer, everything the loop does), the slower
rank's, median after warm-up steps. Time inside the schedule and in the optimizer step is recorded on both
sides (rank 0's: the first stage finishes a 1F1B step last), and on the strategy side also the batch runner
around the schedule (body-input capture, gradient stash, log relay) and the log relay alone, so the difference
splits into its parts.

Where ``ThreeDStrategy`` checks every step's loss and gradients for NaN/inf (``on_nonfinite``, on by default),
the strategy also runs a third time with ``on_nonfinite="off"`` to show what that check costs.

Ratio = strategy step (defaults) / hand-loop step (ideal 1.00).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "B2", "strategy overhead: ThreeDStrategy vs a hand-written loop over the same torch objects"


def _has_nonfinite_check() -> bool:
    import inspect

    from lightning_3d import ThreeDStrategy

    return "on_nonfinite" in inspect.signature(ThreeDStrategy.__init__).parameters


NONFINITE_CHECK = _has_nonfinite_check()
"""Whether this version of ``ThreeDStrategy`` checks every step's gradients for NaN/inf (``on_nonfinite``)."""


def _data(config: dict[str, Any], batch: int, steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from .common import token_batch

    x, y = token_batch(config, batch * steps, seed=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _hand_loop(config: dict[str, Any], tp: int, pp: int, m: int, batch: int, steps: int) -> dict[str, list[float]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_3d.core import partition
    from lightning_3d.core.tensor_parallel import resolve_plan

    from .common import build_gpt, gpt_loss

    model = build_gpt(config, seed=0)
    mesh = init_device_mesh("cpu", (1, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    body = partition.find_body(model)
    plan_stages = partition.plan_stages(body, pp, partition.get_partitioner("uniform"))
    keep = plan_stages.layer_names[pp_rank]
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        x_example = torch.zeros(2, 8, dtype=torch.long)
        plan = resolve_plan(body.module, tp, body_prefix=body.fqn, example_input=x_example)
    partition.prune_body(body, keep)
    if tp > 1:
        for name in keep:
            styles = plan.styles_for(name)
            if styles:
                parallelize_module(body.module._modules[name], mesh["tp"], styles)
    stage = PipelineStage(
        partition.stage_container(body, keep), pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule = Schedule1F1B(stage, m, loss_fn=gpt_loss)
    optimizer = model.configure_optimizers()
    first, last = pp_rank == 0, pp_rank == pp - 1
    starts, inside, opt = [], [], []
    for x, y in _data(config, batch, steps):
        starts.append(time.perf_counter())
        t = time.perf_counter()
        if first and last:
            schedule.step(x, target=y)
        elif first:
            schedule.step(x)
        else:
            schedule.step(target=y)
        inside.append(time.perf_counter() - t)
        t = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt.append(time.perf_counter() - t)
    return {"steps": [b - a for a, b in itertools.pairwise(starts)], "schedule": inside[:-1], "optimizer": opt[:-1]}


def _strategy_run(
    config: dict[str, Any], tp: int, pp: int, m: int, batch: int, steps: int, **strategy_kwargs: Any
) -> dict[str, list[float]]:
    import lightning as L

    from .common import fit_3d

    class Clock(L.Callback):
        """Step starts, and the time spent in the schedule, in the strategy's batch runner (schedule + input
        capture + gradient stash + log relay), in the log relay alone, and from the optimizer step to the
        batch's end."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.times: dict[str, list[float]] = {"schedule": [], "runner": [], "relay": [], "optimizer": []}
            self._before_opt = 0.0

        def _wrap(self, obj: Any, name: str, key: str) -> None:
            real = getattr(obj, name)
            times = self.times[key]

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    times.append(time.perf_counter() - t)

            obj.__dict__[name] = wrapper

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            runner = trainer.strategy.runner
            self._wrap(runner.runtime, "run", "schedule")
            self._wrap(runner, "run", "runner")
            self._wrap(runner, "_relay", "relay")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._before_opt = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times["optimizer"].append(time.perf_counter() - self._before_opt)

    clock = Clock()
    fit_3d(config, clock, tp=tp, pp=pp, micro_batches=m, batch=batch, steps=steps, devices=tp * pp, **strategy_kwargs)
    s = clock.starts
    return {"steps": [b - a for a, b in itertools.pairwise(s)], **{k: v[:-1] for k, v in clock.times.items()}}


def runs_of(gathered: list[Any], rank: int, phase: str, key: str) -> list[float]:
    """One rank's list of times for a phase and key."""
    return list(gathered[rank][phase][key])


def worker(variants: list[dict[str, int]], steps: int, warmup: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks: for every variant, rounds of hand loop / Trainer (/ Trainer without the non-finite
    check), then a last hand loop; returns the timed steps of every phase kind, pooled over the rounds."""
    import torch.distributed as dist

    from .common import init_distributed, model_config

    init_distributed()
    config = model_config(tiny)
    out: dict[str, Any] = {}
    for v in variants:
        args = (config, v["tp"], v["pp"], v["m"], v["batch"], steps + warmup + 1)
        phases: list[tuple[str, Any]] = []
        for _ in range(v.get("rounds", 1)):
            phases.append(("hand", _hand_loop))
            phases.append(("strategy", _strategy_run))
            if NONFINITE_CHECK and v.get("check_off", False):  # what the per-step NaN/inf check costs
                phases.append(("strategy_no_nonfinite_check", lambda *a: _strategy_run(*a, on_nonfinite="off")))
        phases.append(("hand", _hand_loop))
        runs = [(kind, fn(*args)) for kind, fn in phases]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, runs)
        merged: dict[str, dict[str, Any]] = {}
        for i, (kind, run) in enumerate(runs):
            pooled = merged.setdefault(kind, {"round_medians_ms": []})
            # a step is the slower rank's; its parts are rank 0's (the first stage, which finishes a 1F1B step last)
            for key in run:
                pooled.setdefault(key, []).extend(list(gathered[0][i][1][key])[warmup:])
            slowest = [max(vals) for vals in zip(*(g[i][1]["steps"] for g in gathered))][warmup:]
            pooled["steps"] = pooled["steps"][: -len(slowest)] + slowest
            pooled["round_medians_ms"].append(median(slowest) * 1e3)
        out[f"tp{v['tp']}_pp{v['pp']}"] = {"variant": v, **merged}
    return out


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    variants = [
        {"tp": 1, "pp": 2, "m": 8, "batch": 8, "rounds": 3, "check_off": True},
        {"tp": 2, "pp": 1, "m": 1, "batch": 8, "rounds": 1, "check_off": False},
    ]
    if tiny:
        variants = [
            {"tp": 1, "pp": 2, "m": 2, "batch": 4, "rounds": 1, "check_off": True},
            {"tp": 2, "pp": 1, "m": 1, "batch": 4, "rounds": 1, "check_off": False},
        ]
    steps, warmup = (3, 1) if tiny else (8, 2)
    res = launch("b2_overhead:worker", 2, {"variants": variants, "steps": steps, "warmup": warmup, "tiny": tiny})
    lines, table = [], {}
    for name, r in res.items():
        hand = {k: median(v) * 1e3 for k, v in r["hand"].items() if k != "round_medians_ms"}
        strat = {k: median(v) * 1e3 for k, v in r["strategy"].items() if k != "round_medians_ms"}
        hand["other"] = hand["steps"] - hand["schedule"] - hand["optimizer"]
        strat["runner_extra"] = strat["runner"] - strat["schedule"]
        strat["other"] = strat["steps"] - strat["runner"] - strat["optimizer"]
        ratio = strat["steps"] / hand["steps"]
        table[name] = {
            "variant": r["variant"],
            "hand_ms": hand,
            "strategy_ms": strat,
            "ratio": ratio,
            "hand_round_medians_ms": r["hand"]["round_medians_ms"],
            "strategy_round_medians_ms": r["strategy"]["round_medians_ms"],
            "raw_s": r,
        }
        v = r["variant"]
        rounds_text = (
            "hand "
            + "/".join(f"{x:.0f}" for x in r["hand"]["round_medians_ms"])
            + ", strategy "
            + "/".join(f"{x:.0f}" for x in r["strategy"]["round_medians_ms"])
        )
        lines.append(
            f"{name} (m={v['m']}, batch {v['batch']}): strategy {strat['steps']:.1f} ms/step vs hand loop "
            f"{hand['steps']:.1f} -> ratio {ratio:.3f} (phase medians: {rounds_text} ms)"
        )
        if "strategy_no_nonfinite_check" in r:
            off = {k: median(v) * 1e3 for k, v in r["strategy_no_nonfinite_check"].items() if k != "round_medians_ms"}
            table[name]["strategy_no_nonfinite_check_ms"] = off
            table[name]["ratio_no_nonfinite_check"] = off["steps"] / hand["steps"]
            lines.append(
                f"   with on_nonfinite='off' (no per-step NaN/inf check of every gradient): {off['steps']:.1f} ms/step "
                f"-> ratio {off['steps'] / hand['steps']:.3f}"
            )
        lines.append(
            f"   schedule {strat['schedule']:.1f} vs {hand['schedule']:.1f} ms; optimizer {strat['optimizer']:.1f} vs "
            f"{hand['optimizer']:.1f}; strategy's runner around the schedule {strat['runner_extra']:.1f} (log relay "
            f"{strat['relay']:.1f}); rest of the loop {strat['other']:.1f} vs {hand['other']:.1f} ms"
        )
    main = table["tp1_pp2"]
    details = {
        "table": table,
        "layout": "2 processes, 1 thread each; pp=2 (1F1B) and tp=2 (pp=1) variants",
        "steps": {"warmup": warmup, "timed": steps, "statistic": "median of start-to-start, slower rank"},
    }
    return Record(
        ID,
        TITLE,
        main["strategy_ms"]["steps"],
        main["hand_ms"]["steps"],
        1.0,
        main["ratio"],
        "ms per step (pp=2)",
        details,
        lines,
    )
