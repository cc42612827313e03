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

Ratio = strategy step (defaults) / hand-loop step (ideal 1.00), the ratio of the pooled medians. Its spread: each
strategy round's median over the mean of the two hand rounds around it (``ratio_min`` / ``ratio_max``), so a load
change during the run moves both sides of each per-round ratio.

The strategy's fixed cost around the schedule: per step, its ``training_step`` and ``backward`` less the schedule's
step (the batch runner, the log exchange, the non-finite flags, handing the gradients over), on rank 0, in wall
clock and in the CPU time of the thread (``time.thread_time``: what the strategy's own code costs, whatever the
other processes on the machine do). Measured at pp=2 with m=8 and m=4, the straight line through the two splits it
into a part per step and a part per micro-batch (``fixed_per_step_ms``, ``fixed_per_micro_batch_ms`` and their
``_cpu`` twins). It includes the one real ``self.log`` call per logged key that a plain Lightning step makes as
well (the strategy replays the user's calls through Lightning's own ``log``); the same split without that replay
(``fixed_own_cpu_per_step_ms``, ``fixed_own_cpu_per_micro_batch_ms``) is what the strategy itself adds. Inside it
the non-finite scan (one read of every gradient, ``nonfinite_scan_cpu_ms``) is device work, not host overhead: it
grows with the stage's gradient bytes (about 0.08 ms per MB on this CPU, memory bound), and on a GPU it is one fused
kernel per dtype that the host only launches. The strategy's host overhead, what the goals (<= 1 ms per step, <= 0.2
ms per micro-batch) are read against, is the CPU-time split less the user's ``self.log`` and less the scan
(``host_cpu_per_step_ms``; the per-micro-batch part is ``fixed_own_cpu_per_micro_batch_ms``).

``--model hf_llama`` (record ``B2_hf_llama``, pp=2 only): the Hugging Face Llama of ``hf_llama.py``. The strategy
splits it at its block container and runs the example's unchanged ``training_step`` (the whole Hugging Face
forward and loss) on each stage, the other stage's modules stood in for. The hand-written side drives torch's
``PipelineStage`` + ``Schedule1F1B`` over stage modules built by hand (:class:`LlamaStage`: stage 0 = embedding +
the first half of the layers, stage 1 = the second half + final norm + LM head, each computing the causal mask
and rotary position embeddings the way ``LlamaModel.forward`` does; mean cross-entropy as the loss) with the
example's AdamW groups. Both sides start from the same weights (the model built from seed 0, not on the meta
device) and read the same batches, so their losses must agree step by step: the largest difference is reported.
Rounds alternate hand / strategy / hand / ... (three strategy rounds, four hand rounds) in the same processes.
"""

from __future__ import annotations

import itertools
import time
import types
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "B2", "strategy overhead: ThreeDStrategy vs a hand-written loop over the same torch objects"
MODELS: tuple[str, ...] = ("gpt", "hf_llama")
"""The models this benchmark runs on (``--model``; the hand loop holds no tied weights)."""


def _has_nonfinite_check() -> bool:
    import dataclasses
    import inspect

    from lightning_3d import ThreeDStrategy

    if "on_nonfinite" in inspect.signature(ThreeDStrategy.__init__).parameters:
        return True
    try:  # the settings are a dataclass that ThreeDStrategy(**kwargs) fills in
        from lightning_3d.settings import ThreeDSettings
    except ImportError:
        return False
    return "on_nonfinite" in {f.name for f in dataclasses.fields(ThreeDSettings)}


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
                parallelize_module(body.module.get_submodule(name), mesh["tp"], styles)
    stage = PipelineStage(
        partition.stage_container(body, keep), pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    schedule = Schedule1F1B(stage, m, loss_fn=gpt_loss)
    optimizer = model.configure_optimizers()
    first, last = pp_rank == 0, pp_rank == pp - 1
    starts, inside, opt, zero = [], [], [], []
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
        c = time.thread_time()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients (the strategy frees them in its step)
        zero.append(time.thread_time() - c)
        opt.append(time.perf_counter() - t)
    return {
        "steps": [b - a for a, b in itertools.pairwise(starts)],
        "schedule": inside[:-1],
        "optimizer": opt[:-1],
        "zero_grad_cpu": zero[:-1],
    }


def _strategy_run(
    config: dict[str, Any],
    tp: int,
    pp: int,
    m: int,
    batch: int,
    steps: int,
    module: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **strategy_kwargs: Any,
) -> dict[str, list[float]]:
    import lightning as L

    from .common import fit_3d

    class Clock(L.Callback):
        """Step starts, and the time spent in the schedule, in the strategy's batch runner (schedule + input
        capture + gradient stash + log relay), in the log relay alone, and from the optimizer step to the
        batch's end."""

        SUMS = tuple(f"{k}{c}" for k in ("log_replay", "scan", "discard", "lightning_hooks") for c in ("", "_cpu"))

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.times: dict[str, list[float]] = {
                "schedule": [],
                "runner": [],
                "relay": [],
                "exchange": [],
                "optimizer": [],
                "training_step": [],
                "backward": [],
                "schedule_cpu": [],
                "training_step_cpu": [],
                "backward_cpu": [],
                "log_replay": [],
                "log_replay_cpu": [],
                "scan": [],
                "scan_cpu": [],
                "discard": [],
                "discard_cpu": [],
                "lightning_hooks": [],
                "lightning_hooks_cpu": [],
            }
            self._patched: list[tuple[Any, str, Any]] = []  # (owner, name, original or None: an instance's)
            self._sums: dict[str, float] = {}
            self._before_opt = 0.0
            self.losses: list[float] = []

        def _wrap(self, obj: Any, name: str, key: str) -> None:
            real = getattr(obj, name)
            times = self.times[key]
            cpu = self.times.get(f"{key}_cpu")  # this thread's CPU time too: robust to other processes' load

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return real(*args, **kwargs)
                finally:
                    times.append(time.perf_counter() - t)
                    if cpu is not None:
                        cpu.append(time.thread_time() - c)

            obj.__dict__[name] = wrapper

        def _sum_into(self, owner: Any, name: str, key: str) -> None:
            """Add the wall and CPU time of every call of ``owner.name`` (a module's function, or an object's
            method) to the step's ``key`` (restored at the end of the run: the phases of one process patch it in
            turn)."""
            real = getattr(owner, name)
            sums = self._sums

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return real(*args, **kwargs)
                finally:
                    sums[key] = sums.get(key, 0.0) + time.perf_counter() - t
                    sums[f"{key}_cpu"] = sums.get(f"{key}_cpu", 0.0) + time.thread_time() - c

            if isinstance(owner, types.ModuleType):
                setattr(owner, name, wrapper)
                self._patched.append((owner, name, real))
            else:  # shadow the bound method on the instance; dropping the shadow restores it
                owner.__dict__[name] = wrapper
                self._patched.append((owner, name, None))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from lightning_3d.core import runner as runner_module
            from lightning_3d.core import torch_compat

            # the replay of the user's self.log calls through Lightning's own log (a plain Lightning step makes
            # the same calls), and the non-finite scan of the gradients (reads every gradient once)
            self._sum_into(runner_module, "replay", "log_replay")
            self._sum_into(torch_compat, "foreach_non_finite", "scan")
            # freeing the previous step's gradients, which Lightning's zero_grad (set_to_none) would otherwise
            # free after training_step (it then finds none): moved into the window, not added
            self._sum_into(runner_module, "drop_grads", "discard")
            # Lightning's own hooks around backward (callbacks' on_before/after_backward): any strategy runs them
            for hook in ("pre_backward", "post_backward"):
                self._sum_into(trainer.strategy.precision_plugin, hook, "lightning_hooks")
            runner = trainer.strategy.runner
            self._wrap(runner.runtime, "run", "schedule")
            self._wrap(runner, "run", "runner")
            self._wrap(runner, "_relay", "relay")
            self._wrap(runner, "_exchange", "exchange")
            self._wrap(trainer.strategy, "training_step", "training_step")  # the strategy's code, schedule included
            self._wrap(trainer.strategy, "backward", "backward")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.perf_counter())
            self._sums.clear()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._before_opt = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times["optimizer"].append(time.perf_counter() - self._before_opt)
            for key in self.SUMS:
                self.times[key].append(self._sums.get(key, 0.0))
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss) if loss is not None else float("nan"))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            for owner, name, real in reversed(self._patched):
                if real is None:
                    owner.__dict__.pop(name, None)
                else:
                    setattr(owner, name, real)
            self._patched.clear()

    clock = Clock()
    fit_3d(
        config,
        clock,
        tp=tp,
        pp=pp,
        micro_batches=m,
        batch=batch,
        steps=steps,
        devices=tp * pp,
        module=module,
        trainer_kwargs=trainer_kwargs,
        **strategy_kwargs,
    )
    s = clock.starts
    out = {"steps": [b - a for a, b in itertools.pairwise(s)], **{k: v[:-1] for k, v in clock.times.items()}}
    # the strategy's own CPU time around the schedule: its training_step and backward, less the schedule's step
    for suffix in ("", "_cpu"):
        parts = (out[f"training_step{suffix}"], out[f"backward{suffix}"], out[f"schedule{suffix}"])
        out[f"fixed{suffix}"] = [t + b - x for t, b, x in zip(*parts, strict=False)]
        # less the user's own self.log calls (replayed through Lightning's log; plain Lightning pays them too)
        replayed = out[f"log_replay{suffix}"]
        out[f"fixed_own{suffix}"] = [f - r for f, r in zip(out[f"fixed{suffix}"], replayed, strict=False)]
        # the host overhead: less also the scan (device work), the moved free and Lightning's own hooks
        others = zip(*(out[f"{k}{suffix}"] for k in ("scan", "discard", "lightning_hooks")), strict=False)
        out[f"host{suffix}"] = [f - sum(o) for f, o in zip(out[f"fixed_own{suffix}"], others, strict=False)]
    if module is not None:  # the loss of every batch (on the last stage), to compare with the hand loop's
        out["losses"] = clock.losses[:-1]
    return out


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
        out[v.get("key", f"tp{v['tp']}_pp{v['pp']}")] = {"variant": v, **_pool(runs, gathered, warmup)}
    return out


def _pool(runs: list[tuple[str, Any]], gathered: list[Any], warmup: int) -> dict[str, dict[str, Any]]:
    """The timed steps of every phase kind, pooled over its rounds (after ``warmup`` steps of each phase)."""
    merged: dict[str, dict[str, Any]] = {}
    for i, (kind, run) in enumerate(runs):
        pooled = merged.setdefault(kind, {"round_medians_ms": []})
        # a step is the slower rank's; its parts are rank 0's (the first stage, which finishes a 1F1B step last)
        for key in run:
            pooled.setdefault(key, []).extend(list(gathered[0][i][1][key])[warmup:])
        slowest = [max(vals) for vals in zip(*(g[i][1]["steps"] for g in gathered))][warmup:]
        pooled["steps"] = pooled["steps"][: -len(slowest)] + slowest
        pooled["round_medians_ms"].append(median(slowest) * 1e3)
    return merged


def run(out: Path, tiny: bool = False, model: str = "gpt") -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    if model != "gpt":
        return run_llama(out, tiny, model)

    variants = [
        {"tp": 1, "pp": 2, "m": 8, "batch": 8, "rounds": 3, "check_off": True},
        {"tp": 1, "pp": 2, "m": 4, "batch": 8, "rounds": 1, "check_off": False, "key": "tp1_pp2_m4"},
        {"tp": 2, "pp": 1, "m": 1, "batch": 8, "rounds": 1, "check_off": False},
    ]
    if tiny:
        variants = [
            {"tp": 1, "pp": 2, "m": 4, "batch": 4, "rounds": 1, "check_off": True},
            {"tp": 1, "pp": 2, "m": 2, "batch": 4, "rounds": 1, "check_off": False, "key": "tp1_pp2_m4"},
            {"tp": 2, "pp": 1, "m": 1, "batch": 4, "rounds": 1, "check_off": False},
        ]
    steps, warmup = (3, 1) if tiny else (8, 2)
    kwargs = {"variants": variants, "steps": steps, "warmup": warmup, "tiny": tiny}
    res = launch("b2_overhead:worker", 2, kwargs, timeout=420)  # about 150 s on a quiet machine
    lines, table = [], {}
    for name, r in res.items():
        hand = {k: median(v) * 1e3 for k, v in r["hand"].items() if k != "round_medians_ms"}
        strat = {k: median(v) * 1e3 for k, v in r["strategy"].items() if k != "round_medians_ms"}
        hand["other"] = hand["steps"] - hand["schedule"] - hand["optimizer"]
        strat["runner_extra"] = strat["runner"] - strat["schedule"]
        strat["other"] = strat["steps"] - strat["runner"] - strat["optimizer"]
        ratio = strat["steps"] / hand["steps"]
        rounds = round_ratios(r["strategy"]["round_medians_ms"], r["hand"]["round_medians_ms"])
        table[name] = {
            "round_ratios": rounds,
            "round_ratio_min": min(rounds) if rounds else None,
            "round_ratio_max": max(rounds) if rounds else None,
            "fixed_ms": strat.get("fixed"),
            "fixed_cpu_ms": strat.get("fixed_cpu"),
            "fixed_own_ms": strat.get("fixed_own"),
            "fixed_own_cpu_ms": strat.get("fixed_own_cpu"),
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
            f"{hand['steps']:.1f} -> ratio {ratio:.3f}, per round {min(rounds):.3f}-{max(rounds):.3f} "
            f"(phase medians: {rounds_text} ms); strategy's own time around the schedule {strat['fixed']:.2f} ms/step"
        )
        if "strategy_no_nonfinite_check" in r:
            off = {k: median(v) * 1e3 for k, v in r["strategy_no_nonfinite_check"].items() if k != "round_medians_ms"}
            table[name]["strategy_no_nonfinite_check_ms"] = off
            table[name]["ratio_no_nonfinite_check"] = off["steps"] / hand["steps"]
            lines.append(
                f"   with on_nonfinite='off' (no per-step NaN/inf check of every gradient): {off['steps']:.1f} ms/step "
                f"-> ratio {off['steps'] / hand['steps']:.3f}; strategy's own time around the schedule "
                f"{off.get('fixed', float('nan')):.2f} ms/step ({off.get('fixed_cpu', float('nan')):.2f} ms CPU)"
            )
        lines.append(
            f"   schedule {strat['schedule']:.1f} vs {hand['schedule']:.1f} ms; optimizer {strat['optimizer']:.1f} vs "
            f"{hand['optimizer']:.1f}; strategy's runner around the schedule {strat['runner_extra']:.1f} (log exchange "
            f"{strat.get('exchange', float('nan')):.1f}, object relay {strat['relay']:.1f}); rest of the loop "
            f"{strat['other']:.1f} vs {hand['other']:.1f} ms"
        )
    main = table["tp1_pp2"]
    pp2 = ("tp1_pp2", "tp1_pp2_m4")
    fixed, fixed_cpu, own, own_cpu = (
        fixed_cost({table[k]["variant"]["m"]: table[k][key] for k in pp2 if table[k][key]})
        for key in ("fixed_ms", "fixed_cpu_ms", "fixed_own_ms", "fixed_own_cpu_ms")
    )
    for what, f in (("wall clock", fixed), ("CPU time of the thread", fixed_cpu)):
        if f is not None:
            lines.append(
                f"strategy's fixed cost around the schedule (training_step + backward - schedule step, pp=2 rank 0, "
                f"m={'/'.join(str(k) for k in sorted(f['at']))}, {what}): {f['per_step_ms']:.2f} ms per step + "
                f"{f['per_micro_batch_ms']:.3f} ms per micro-batch"
            )
    parts = {k: main["strategy_ms"].get(k, float("nan")) for k in ("log_replay_cpu", "scan_cpu")}
    for what, f in (("wall clock", own), ("CPU time", own_cpu)):
        if f is not None:
            lines.append(
                "   less the user's own self.log calls (replayed through Lightning's log, "
                f"{parts['log_replay_cpu']:.2f} ms CPU per step; a plain Lightning step makes them too), {what}: "
                f"{f['per_step_ms']:.2f} ms per step + "
                f"{f['per_micro_batch_ms']:.3f} ms per micro-batch; of which the non-finite "
                f"scan reading every gradient once {parts['scan_cpu']:.2f} ms CPU (grows with the stage's gradient "
                "bytes; none with on_nonfinite='off')"
            )
    host = fixed_cost({table[k]["variant"]["m"]: table[k]["strategy_ms"]["host_cpu"] for k in pp2})
    host_cpu = host["per_step_ms"] if host else None
    moved = {k: main["strategy_ms"].get(k, float("nan")) for k in ("discard_cpu", "lightning_hooks_cpu")}
    hand_zero = main["hand_ms"].get("zero_grad_cpu", float("nan"))
    if host is not None:
        lines.append(
            "   the strategy's host overhead (CPU time, less the user's self.log, less the scan's pass over the "
            "gradients, which is device work: one fused kernel per dtype on a GPU, less freeing the previous "
            f"step's gradients, {moved['discard_cpu']:.2f} ms, which Lightning's zero_grad would free otherwise "
            f"and the hand loop's zero_grad frees, {hand_zero:.2f} ms, and less Lightning's own hooks around "
            f"backward, {moved['lightning_hooks_cpu']:.2f} ms): {host['per_step_ms']:.2f} ms per step + "
            f"{host['per_micro_batch_ms']:.3f} ms per micro-batch (goals <= 1 and <= 0.2)"
            + (
                f" [the line through m={'/'.join(str(k) for k in sorted(host['at']))} sloped down: read as flat, the "
                "mean of the two]"
                if host["clamped"]
                else ""
            )
        )
    details = {
        "fixed_cost": fixed,
        "fixed_cost_cpu": fixed_cpu,
        "fixed_cost_less_user_log": own,
        "fixed_cost_less_user_log_cpu": own_cpu,
        "user_log_replay_cpu_ms": parts["log_replay_cpu"],
        "nonfinite_scan_cpu_ms": parts["scan_cpu"],
        "host_overhead_cpu_per_step_ms": host_cpu,
        "host_overhead_cpu": host,
        "previous_grads_free_cpu_ms": moved["discard_cpu"],
        "hand_loop_zero_grad_cpu_ms": hand_zero,
        "lightning_backward_hooks_cpu_ms": moved["lightning_hooks_cpu"],
        "ratio_spread": {
            "min": main["round_ratio_min"],
            "max": main["round_ratio_max"],
            "rounds": main["round_ratios"],
        },
        "table": table,
        "layout": "2 processes, 1 thread each; pp=2 (1F1B, m=8 and m=4) and tp=2 (pp=1) variants",
        "steps": {"warmup": warmup, "timed": steps, "statistic": "median of start-to-start, slower rank"},
    }
    extra = {
        "ratio_min": main["round_ratio_min"],
        "ratio_max": main["round_ratio_max"],
        "fixed_per_step_ms": fixed["per_step_ms"] if fixed else None,
        "fixed_per_micro_batch_ms": fixed["per_micro_batch_ms"] if fixed else None,
        "fixed_cpu_per_step_ms": fixed_cpu["per_step_ms"] if fixed_cpu else None,
        "fixed_cpu_per_micro_batch_ms": fixed_cpu["per_micro_batch_ms"] if fixed_cpu else None,
        "fixed_own_cpu_per_step_ms": own_cpu["per_step_ms"] if own_cpu else None,
        "fixed_own_cpu_per_micro_batch_ms": own_cpu["per_micro_batch_ms"] if own_cpu else None,
        "nonfinite_scan_cpu_ms": parts["scan_cpu"],
        "host_cpu_per_step_ms": host_cpu,
        "host_cpu_per_micro_batch_ms": host["per_micro_batch_ms"] if host else None,
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
        extra=extra,
    )


def round_ratios(strategy_ms: list[float], hand_ms: list[float]) -> list[float]:
    """Each strategy round's median over the mean of the hand rounds just before and after it (the rounds
    alternate hand / strategy / hand / ...), so a load change during the run moves both sides of a ratio."""
    out = []
    for i, s in enumerate(strategy_ms):
        around = hand_ms[i : i + 2]
        if around:
            out.append(s / (sum(around) / len(around)))
    return out


def fixed_cost(by_m: dict[int, float]) -> dict[str, Any] | None:
    """Split the strategy's time around the schedule, measured at two micro-batch counts, into a part per step
    and a part per micro-batch (a straight line through the two points); ``None`` without two counts.

    A cost cannot shrink as micro-batches are added, so a line sloping down is noise: it is read as flat (no
    part per micro-batch, the per-step part the mean of the two points; ``clamped``) instead of extrapolated to a
    per-step part above both measurements."""
    if len(by_m) < 2:
        return None
    (m1, f1), (m2, f2) = sorted(by_m.items())[:2]
    per_micro = (f2 - f1) / (m2 - m1)
    if per_micro < 0:
        return {"per_step_ms": (f1 + f2) / 2, "per_micro_batch_ms": 0.0, "at": by_m, "clamped": True}
    return {"per_step_ms": f1 - m1 * per_micro, "per_micro_batch_ms": per_micro, "at": by_m, "clamped": False}


# ---------------------------------------------------------------------- the Hugging Face Llama (--model hf_llama)
def _llama_stage_class() -> type:
    """:class:`LlamaStage`, built lazily (torch and transformers import inside)."""
    import torch
    from torch import nn
    from transformers.masking_utils import create_causal_mask

    class LlamaStage(nn.Module):
        """One pipeline stage of a ``LlamaForCausalLM``, written by hand: what ``LlamaModel.forward`` and
        ``LlamaForCausalLM.forward`` compute, restricted to this stage's modules (shared with the model).

        Args:
            hf: the ``LlamaForCausalLM``.
            layers: indices of the decoder layers of this stage.
            first: holds the embedding (input: token ids); last: holds the final norm and the LM head (output:
                logits).
        """

        def __init__(self, hf: nn.Module, layers: range, first: bool, last: bool) -> None:
            super().__init__()
            base = hf.model
            self.config = base.config
            self.embed_tokens = base.embed_tokens if first else None
            self.layers = nn.ModuleList(base.layers[i] for i in layers)
            self.rotary_emb = base.rotary_emb
            self.norm = base.norm if last else None
            self.lm_head = hf.lm_head if last else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = create_causal_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
            )
            position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
            for layer in self.layers:
                hidden = layer(
                    hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids
                )
            if self.lm_head is not None:
                hidden = self.lm_head(self.norm(hidden))
            return hidden

    return LlamaStage


def llama_loss(logits: Any, targets: Any) -> Any:
    """Mean cross-entropy over every position, in float32 (Hugging Face's ``ForCausalLMLoss`` with
    ``shift_labels`` given and nothing ignored)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _hand_loop_llama(config: dict[str, Any], m: int, batch: int, steps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from .hf_llama import build_llama

    module = build_llama(config, seed=0)
    rank, pp = dist.get_rank(), dist.get_world_size()
    n_layers = int(config["num_hidden_layers"])
    per_stage = n_layers // pp
    first, last = rank == 0, rank == pp - 1
    stage_module = _llama_stage_class()(
        module.model, range(rank * per_stage, (rank + 1) * per_stage), first=first, last=last
    )
    stage = PipelineStage(stage_module, rank, pp, torch.device("cpu"))
    schedule = Schedule1F1B(stage, m, loss_fn=llama_loss)
    # the example's configure_optimizers, on this stage's parameters
    hp = module.hparams
    params = [p for p in stage_module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=(0.9, 0.95))
    starts, inside, opt, losses = [], [], [], []
    for x, y in _data(config, batch, steps):
        starts.append(time.perf_counter())
        t = time.perf_counter()
        if first:
            schedule.step(x)
        else:
            mb_losses: list[Any] = []
            schedule.step(target=y, losses=mb_losses)
            losses.append(float(sum(float(v) for v in mb_losses) / len(mb_losses)))
        inside.append(time.perf_counter() - t)
        t = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt.append(time.perf_counter() - t)
    out = {"steps": [b - a for a, b in itertools.pairwise(starts)], "schedule": inside[:-1], "optimizer": opt[:-1]}
    out["losses"] = losses[:-1]
    return out


def worker_llama(model: str, m: int, batch: int, steps: int, warmup: int, rounds: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks: rounds of hand loop / Trainer, then a last hand loop, on the Llama at pp=2."""
    import torch.distributed as dist

    from .common import init_distributed
    from .hf_llama import build_llama, llama_config

    init_distributed()
    config = llama_config(model, tiny)
    n = steps + warmup + 1

    def hand() -> dict[str, list[float]]:
        return _hand_loop_llama(config, m, batch, n)

    def strategy() -> dict[str, list[float]]:
        # batches in order, as the hand loop reads them (Lightning's sampler would shuffle them)
        module = build_llama(config, seed=0)
        return _strategy_run(
            config, 1, 2, m, batch, n, module=module, trainer_kwargs={"use_distributed_sampler": False}
        )

    phases = [phase for _ in range(rounds) for phase in (("hand", hand), ("strategy", strategy))]
    phases.append(("hand", hand))
    runs = [(kind, fn()) for kind, fn in phases]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, runs)
    last = dist.get_world_size() - 1
    losses = {kind: gathered[last][i][1]["losses"] for i, (kind, _) in enumerate(runs[:2])}  # first round's
    pooled = _pool(runs, gathered, warmup)
    for kind in pooled:
        pooled[kind].pop("losses", None)  # rank 0's (the first stage's): not the loss
    return {
        "tp1_pp2": {"variant": {"tp": 1, "pp": 2, "m": m, "batch": batch, "rounds": rounds}, **pooled},
        "losses": losses,
        "config": config,
    }


def run_llama(out: Path, tiny: bool, model: str) -> Record:
    """B2 on the Hugging Face Llama (pp=2): launch the two processes and build ``B2_<model>``."""
    from .common import launch

    if model != "hf_llama":
        raise ValueError(f"B2 runs on the example GPT or hf_llama (its hand loop holds no tied weights), not {model}")
    steps, warmup, rounds = (2, 1, 1) if tiny else (6, 2, 3)
    m, batch = (2, 4) if tiny else (8, 8)
    args = {"model": model, "m": m, "batch": batch, "steps": steps, "warmup": warmup, "rounds": rounds, "tiny": tiny}
    res = launch("b2_overhead:worker_llama", 2, args, timeout=600)
    r = res["tp1_pp2"]
    hand = {k: median(v) * 1e3 for k, v in r["hand"].items() if k != "round_medians_ms"}
    strat = {k: median(v) * 1e3 for k, v in r["strategy"].items() if k != "round_medians_ms"}
    hand["other"] = hand["steps"] - hand["schedule"] - hand["optimizer"]
    strat["runner_extra"] = strat["runner"] - strat["schedule"]
    strat["other"] = strat["steps"] - strat["runner"] - strat["optimizer"]
    ratio = strat["steps"] / hand["steps"]
    hand_rounds, strat_rounds = r["hand"]["round_medians_ms"], r["strategy"]["round_medians_ms"]
    # each strategy round against the mean of the hand rounds before and after it (alternating order)
    paired = [s / ((hand_rounds[i] + hand_rounds[i + 1]) / 2) for i, s in enumerate(strat_rounds)]
    losses = res["losses"]
    diffs = [abs(a - b) for a, b in zip(losses["hand"], losses["strategy"])]
    lines = [
        f"{model}, pp=2 (1F1B, m={m}, batch {batch}), {rounds} strategy rounds between {rounds + 1} hand rounds, "
        f"{steps} timed steps each after {warmup} warm-up",
        f"strategy {strat['steps']:.1f} ms/step vs hand loop {hand['steps']:.1f} -> ratio {ratio:.3f}",
        "phase medians in run order (ms): "
        + ", ".join(
            f"{kind} {x:.0f}"
            for pair in itertools.zip_longest(hand_rounds, strat_rounds)
            for kind, x in zip(("hand", "strategy"), pair)
            if x is not None
        ),
        "each strategy round / mean of the hand rounds around it: "
        + ", ".join(f"{x:.3f}" for x in paired)
        + f" (spread {min(paired):.3f}..{max(paired):.3f})",
        f"   schedule {strat['schedule']:.1f} vs {hand['schedule']:.1f} ms; optimizer {strat['optimizer']:.1f} vs "
        f"{hand['optimizer']:.1f}; strategy's runner around the schedule {strat['runner_extra']:.1f} (log relay "
        f"{strat['relay']:.1f}); rest of the loop {strat['other']:.1f} vs {hand['other']:.1f} ms",
        f"same computation: losses of the first round, hand {[round(x, 5) for x in losses['hand']]} vs strategy "
        f"{[round(x, 5) for x in losses['strategy']]}, largest difference {max(diffs, default=float('nan')):.2e}",
    ]
    details = {
        "model": model,
        "config": res["config"],
        "table": {
            "tp1_pp2": {
                "variant": r["variant"],
                "hand_ms": hand,
                "strategy_ms": strat,
                "ratio": ratio,
                "hand_round_medians_ms": hand_rounds,
                "strategy_round_medians_ms": strat_rounds,
                "strategy_round_over_neighbouring_hand_rounds": paired,
                "raw_s": r,
            }
        },
        "losses_first_round": losses,
        "largest_loss_difference": max(diffs, default=None),
        "layout": "2 processes, 1 thread each; pp=2 (1F1B); machine shared: timings are noisy",
        "steps": {"warmup": warmup, "timed": steps, "statistic": "median of start-to-start, slower rank"},
    }
    return Record(
        f"{ID}_{model}",
        f"{TITLE} ({model}, hand-built Llama stages)",
        strat["steps"],
        hand["steps"],
        1.0,
        ratio,
        "ms per step (pp=2)",
        details,
        lines,
    )
