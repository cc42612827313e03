"""B3 activation memory in flight: saved-tensor bytes per stage under GPipe, 1F1B and interleaved 1F1B.

Two processes, pp=2, m=8 micro-batches of one sequence, the benchmark GPT. During one training step (after a
warm-up step that exchanges shapes) ``torch.autograd.graph.saved_tensors_hooks`` tracks every tensor autograd
saves for backward: a tensor is counted by its storage (several saves of one storage count once) from the
moment it is packed until the graph lets it go (after its backward), parameters excluded. Each saved tensor
is charged to the stage running at that moment (its ``forward_one_chunk``, or the loss on the last stage), and
the peak of the live bytes is taken per stage and per rank. Counting, not timing: the numbers are exact and
repeatable.

Baseline: 1F1B. Ideal GPipe / 1F1B per stage ``s``: ``m / min(m, p - s)`` (GPipe keeps all m micro-batches,
1F1B keeps ``p - s`` in flight on stage ``s``; torch's 1F1B warms up with ``p - s`` forwards). The measured
ratio sits a hair under the ideal because the micro-batches' token ids and targets are views of one batch
tensor, whose storage is counted once however many micro-batches are in flight. Interleaved 1F1B (2 stages
per rank, 4 stages) is reported per rank against 1F1B. The record's ratio is the lowest per-stage (GPipe / 1F1B) /
ideal. GPipe runs three more times: with every block under full activation checkpointing, with every block
compiled (``aot_eager``), and compiled and checkpointed (the strategy's order: the checkpoint around the compiled
forward); each checkpointed run is reported against its run without checkpointing.

``--model hf_llama`` (record ``B3_hf_llama``): the Hugging Face Llama of ``hf_llama.py`` trained through
``Trainer.fit`` with ``ThreeDStrategy(pp=2, schedule=...)`` (split at its block container; every stage runs the
example's ``training_step``, Hugging Face's own loss included), GPipe and 1F1B, m=8 micro-batches of one sequence.
The same tracker runs around the strategy's schedule during step 1 (an observer of its pipeline runtime). No
interleaved run.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import Record
from .hf_llama import MODEL_NAMES

ID, TITLE = "B3", "activation memory in flight: saved-tensor bytes per stage, GPipe vs 1F1B vs interleaved"
MODELS: tuple[str, ...] = ("gpt", *MODEL_NAMES)
"""The models this benchmark runs on (``--model``)."""


class _Saved:
    """What a pack hook returns: keeps the tensor, and tells the tracker when autograd drops it."""

    __slots__ = ("ptr", "tensor", "tracker")

    def __init__(self, tracker: SavedTensorTracker, ptr: int, tensor: Any) -> None:
        self.tracker, self.ptr, self.tensor = tracker, ptr, tensor

    def __del__(self) -> None:
        self.tracker._release(self.ptr)


class SavedTensorTracker:
    """Live and peak bytes of the tensors autograd saved, by storage, per stage (and per rank).

    Args:
        exclude: storages (``data_ptr``) not to count, e.g. the parameters'.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.current: int = -1
        self.live: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.rank_live = 0
        self.rank_peak = 0
        self.backward_stage: int = -1  # the stage whose backward runs (what :meth:`hold` charges)
        self._storages: dict[int, list[int]] = {}  # ptr -> [count, nbytes, stage]

    def _count(self, tensor: Any, stage: int) -> int | None:
        """Count one more reference to ``tensor``'s storage (charged to ``stage`` if new); its ``data_ptr``, or
        ``None`` when it is not counted (no storage, or excluded)."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.exclude:
            return None
        entry = self._storages.get(ptr)
        if entry is not None:
            entry[0] += 1
        else:
            nbytes = storage.nbytes()
            self._storages[ptr] = [1, nbytes, stage]
            self.live[stage] += nbytes
            self.peak[stage] = max(self.peak[stage], self.live[stage])
            self.rank_live += nbytes
            self.rank_peak = max(self.rank_peak, self.rank_live)
        return ptr

    def _pack(self, tensor: Any) -> Any:
        ptr = self._count(tensor, self.current)
        return tensor if ptr is None else _Saved(self, ptr, tensor)

    def hold(self, tensor: Any) -> None:
        """Count ``tensor``'s storage while this tensor object lives (the linear split's kept input and output
        gradient: held outside autograd from ``I`` to ``W``), charged to the stage whose backward runs."""
        import weakref

        ptr = self._count(tensor, self.backward_stage)
        if ptr is not None:
            weakref.finalize(tensor, self._release, ptr)

    def holds(self, ptr: int) -> bool:
        """Whether the storage at ``ptr`` is counted now (saved by autograd or held, and not yet released)."""
        return ptr in self._storages

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, ptr: int) -> None:
        entry = self._storages.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[ptr]
            self.live[entry[2]] -= entry[1]
            self.rank_live -= entry[1]

    @contextlib.contextmanager
    def track(self, schedule: Any) -> Iterator[SavedTensorTracker]:
        """Track saved tensors during ``schedule.step`` inside the block, charged to the running stage, and what
        the linear split (``split_backward="linear"``) keeps from ``I`` to ``W``, charged to the stage whose ``I``
        kept it."""
        import torch

        from lightning_3d.core import torch_compat, weight_grad_store

        undo: list[Callable[[], None]] = []

        def charging(
            stage_of: Callable[[tuple[Any, ...]], int], attr: str = "current"
        ) -> Callable[[Callable[..., Any]], Any]:
            def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    previous = getattr(self, attr)
                    setattr(self, attr, stage_of(args))
                    try:
                        return real(*args, **kwargs)
                    finally:
                        setattr(self, attr, previous)

                return wrapper

            return wrap

        tracker = self

        class _HeldList(list):  # type: ignore[type-arg]
            """The list ``deferring`` yields: each kept ``(weight, input, output gradient)`` is counted while held."""

            def append(self, entry: Any) -> None:
                for tensor in entry[1:]:
                    tracker.hold(tensor)
                super().append(entry)

        real_deferring = weight_grad_store.deferring

        def deferring() -> contextlib.AbstractContextManager[list[Any]]:
            return real_deferring(_HeldList())

        try:
            for stage in torch_compat.schedule_stages(schedule):
                index = int(stage.stage_index)
                undo.append(torch_compat.wrap_method(stage, "forward_one_chunk", charging(lambda args, s=index: s)))
                undo.append(
                    torch_compat.wrap_method(
                        stage, "backward_one_chunk", charging(lambda args, s=index: s, "backward_stage")
                    )
                )
            # the loss is charged to the stage it runs on (its first argument)
            undo.append(torch_compat.wrap_schedule_loss(schedule, charging(lambda args: int(args[0].stage_index))))
            weight_grad_store.deferring = deferring  # type: ignore[assignment]
            undo.append(lambda: setattr(weight_grad_store, "deferring", real_deferring))
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for remove in reversed(undo):
                remove()


def _checkpoint_stage_blocks(
    model: Any, stages: list[tuple[int, Any]], x: Any, clock: dict[str, float], checkpointed: bool, compiled: bool
) -> int:
    """Compile (``aot_eager``) and/or checkpoint the blocks of this rank's stages, in the strategy's order (compile,
    then the checkpoint around the compiled forward); returns the bytes of the blocks' inputs per micro-batch (one
    ``(1, T, n_embd)`` activation per block, the theory of full checkpointing). The blocks' own forwards add their
    wall time to ``clock["forward"]``, or to ``clock["recompute"]`` when they run inside the backward."""
    from lightning_3d.core import partition, torch_compat
    from lightning_3d.core.blocks import sequential_blocks
    from lightning_3d.core.checkpointing import checkpoint_blocks
    from lightning_3d.core.compile import compile_blocks

    # which layers are blocks is decided over the whole body (a stage may hold one block only)
    names = {n for n, _ in sequential_blocks(list(partition.find_body(model).module.named_children()))}
    total = 0
    for _, container in stages:
        blocks = [(n, layer) for n, layer in container.named_children() if n in names]
        if compiled:
            compile_blocks(blocks, {"backend": "aot_eager"})
        for _, block in blocks:
            block.forward = _timed(block.forward, clock, torch_compat.in_backward)
        if not checkpointed:
            continue
        checkpoint_blocks(blocks, "full")
        for _, block in blocks:
            width = next(p for n, p in block.named_parameters() if p.dim() == 1).numel()  # a norm's n_embd
            total += x.shape[1] * width * 4  # float32, one sequence per micro-batch
    return total


def _timed(forward: Callable[..., Any], clock: dict[str, float], in_backward: Callable[[], bool]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            clock["recompute" if in_backward() else "forward"] += time.perf_counter() - started

    return run


def worker(m: int, tiny: bool, steps: int = 2) -> dict[str, Any]:
    """Runs on both ranks: one tracked step per schedule; returns every rank's peaks (bytes)."""
    import copy
    import gc

    import torch.distributed as dist

    from .common import (
        build_gpt,
        build_schedule,
        init_distributed,
        model_config,
        pipeline_step,
        stage_modules,
        token_batch,
    )

    rank, world = init_distributed()
    config = model_config(tiny)
    model = build_gpt(config)
    x, y = token_batch(config, m)
    result: dict[str, Any] = {}
    runs = [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("gpipe_ac", 1), ("gpipe_compiled", 1)]
    runs += [("gpipe_compiled_ac", 1)]
    for name, per_rank in runs:
        schedule_name, checkpointed, compiled = name.split("_")[0], name.endswith("_ac"), "_compiled" in name
        piece = copy.deepcopy(model)
        stages = stage_modules(piece, world, rank, per_rank)
        block_input, clock = 0, {"forward": 0.0, "recompute": 0.0}
        if checkpointed or compiled:  # full activation checkpointing and/or compile, as the strategy applies them
            block_input = _checkpoint_stage_blocks(piece, stages, x, clock, checkpointed, compiled)
        num_stages = world * per_rank
        first = any(s == 0 for s, _ in stages)
        last = any(s == num_stages - 1 for s, _ in stages)
        sched = build_schedule(schedule_name, stages, num_stages, m)
        params = {p.untyped_storage().data_ptr() for p in piece.parameters()}
        pipeline_step(sched, first, last, x, y)  # shapes are exchanged on the first step
        for p in piece.parameters():
            p.grad = None
        gc.collect()
        tracker = SavedTensorTracker(params)
        dist.barrier()
        with tracker.track(sched):
            pipeline_step(sched, first, last, x, y)
        gc.collect()
        dist.barrier()
        clock.update(forward=0.0, recompute=0.0)
        started = time.perf_counter()  # untracked steps: the tracker's hooks would weigh on the time
        for _ in range(steps):
            pipeline_step(sched, first, last, x, y)
        dist.barrier()
        step_s = (time.perf_counter() - started) / steps
        mine = {
            "stages": [s for s, _ in stages],
            "peak_per_stage": {str(s): tracker.peak[s] for s, _ in stages},
            "rank_peak": tracker.rank_peak,
            "unattributed_peak": tracker.peak.get(-1, 0),
            "left_after_step": tracker.rank_live,
            "step_s": step_s,
            "blocks_forward_s": clock["forward"] / steps,
            "blocks_recompute_s": clock["recompute"] / steps,
            "block_input_bytes_per_microbatch": block_input,
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        result[name] = gathered
    return result


def run(out: Path, tiny: bool = False, model: str = "gpt") -> Record:
    """Launch the two processes and build the record."""
    from .common import launch

    if model != "gpt":
        return run_llama(out, tiny, model)

    m, p = (4 if tiny else 8), 2
    res = launch("b3_activations:worker", 2, {"m": m, "tiny": tiny})
    per_stage = {name: {} for name in res}
    for name, ranks in res.items():
        for r in ranks:
            per_stage[name].update({int(s): v for s, v in r["peak_per_stage"].items()})
    lines = ["stage | 1F1B MB | GPipe MB | GPipe/1F1B | ideal m/min(m,p-s) | ratio"]
    measured, baseline, ideal, ratios = {}, {}, {}, {}
    for s in range(p):
        one, gp = per_stage["1f1b"][s], per_stage["gpipe"][s]
        ideal_s = m / min(m, p - s)
        measured[str(s)], baseline[str(s)], ideal[str(s)] = gp / one, one / 2**20, ideal_s
        ratios[str(s)] = gp / one / ideal_s
        mb = f"{one / 2**20:7.2f} | {gp / 2**20:8.2f}"
        lines.append(f"{s:5d} | {mb} | {gp / one:10.3f} | {ideal_s:18.3f} | {ratios[str(s)]:.3f}")
    rank_peaks = {name: [r["rank_peak"] for r in ranks] for name, ranks in res.items()}
    lines.append(
        "per rank peak MB: "
        + "; ".join(f"{name} " + ", ".join(f"{b / 2**20:.2f}" for b in peaks) for name, peaks in rank_peaks.items())
    )
    inter = [a / b for a, b in zip(rank_peaks["interleaved1f1b"], rank_peaks["1f1b"])]
    lines.append(
        "interleaved 1F1B (v=2) / 1F1B per rank: "
        + ", ".join(f"{r:.3f}" for r in inter)
        + " (per stage MB: "
        + ", ".join(f"{s}: {v / 2**20:.2f}" for s, v in sorted(per_stage["interleaved1f1b"].items()))
        + ")"
    )
    per_mb = {str(s): per_stage["gpipe"][s] / m for s in range(p)}
    ac = _checkpointing_summary(res, per_stage, m, p)
    lines += ac.pop("lines")
    ac_compiled = _checkpointing_summary(res, per_stage, m, p, base="gpipe_compiled")
    lines += ac_compiled.pop("lines")
    details = {
        "raw": res,
        "per_stage_bytes": {k: {str(s): v for s, v in d.items()} for k, d in per_stage.items()},
        "rank_peak_bytes": rank_peaks,
        "interleaved_over_1f1b_per_rank": inter,
        "gpipe_bytes_per_microbatch": per_mb,
        "ratios_per_stage": ratios,
        "layout": f"pp=2 on 2 processes, m={m}, micro-batch 1 sequence; interleaved: 2 stages per rank",
        "activation_checkpointing": ac,
        "activation_checkpointing_compiled": ac_compiled,
    }
    return Record(
        ID,
        TITLE,
        measured,
        baseline,
        ideal,
        min(ratios.values()),
        "GPipe/1F1B per stage",
        details,
        lines,
        "MB (1F1B peak per stage)",
    )


def _checkpointing_summary(
    res: dict[str, Any], per_stage: dict[str, Any], m: int, p: int, base: str = "gpipe"
) -> dict[str, Any]:
    """GPipe with every block checkpointed (``base="gpipe_compiled"``: every block compiled, with and without
    checkpointing): saved bytes per micro-batch against the blocks' inputs (what full checkpointing keeps of the
    blocks), and the step time it adds against the GPipe step without it."""
    with_ac, what = f"{base}_ac", "full activation checkpointing" + (" of compiled blocks" if base != "gpipe" else "")
    out: dict[str, Any] = {"per_stage": {}, "lines": []}
    for s in range(p):
        ranks = [r for r in res[with_ac] if s in r["stages"]]
        theory = ranks[0]["block_input_bytes_per_microbatch"]
        got = per_stage[with_ac][s] / m
        plain = per_stage[base][s] / m
        out["per_stage"][str(s)] = {
            "bytes_per_microbatch": got,
            "without_checkpointing": plain,
            "blocks_input_bytes": theory,
            "over_blocks_input": got / theory if theory else None,
            "saved_fraction": got / plain,
        }
        out["lines"].append(
            f"{what}, stage {s}: {got / 2**20:.3f} MB per micro-batch in flight (without: "
            f"{plain / 2**20:.3f}); blocks' inputs {theory / 2**20:.3f} MB: ratio {got / theory if theory else 0:.2f} "
            "(the rest: embedding, head and loss, not checkpointed)"
        )
    plain_s = max(r["step_s"] for r in res[base])
    ac_s = max(r["step_s"] for r in res[with_ac])
    # the blocks' forwards timed in the forward and again inside the backward (the recomputation), per step, on
    # the slowest rank: full checkpointing recomputes every block once, so the ideal is 1
    forward = max(r["blocks_forward_s"] for r in res[with_ac])
    recompute = max(r["blocks_recompute_s"] for r in res[with_ac])
    out["step_s"] = {base: plain_s, with_ac: ac_s, "blocks_forward": forward, "blocks_recompute": recompute}
    out["recompute_over_forward"] = recompute / forward if forward else None
    out["lines"].append(
        f"recompute per step {recompute:.3f} s = {recompute / forward if forward else 0:.2f} x the blocks' forward "
        f"({forward:.3f} s; ideal 1); step time {base} {plain_s:.3f} s, with full checkpointing {ac_s:.3f} s"
    )
    return out


def worker_llama(model: str, m: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks: ``Trainer.fit`` of the Llama under GPipe, then 1F1B; step 1 tracked; returns every
    rank's peaks (bytes)."""
    import gc

    import lightning as L
    import torch.distributed as dist

    from .common import fit_3d
    from .hf_llama import build_llama, llama_config

    config = llama_config(model, tiny)
    result: dict[str, Any] = {}

    class Track(L.Callback):
        """Tracks saved tensors while the strategy's schedule runs step 1 (a pipeline runtime observer)."""

        def __init__(self) -> None:
            self.tracker: SavedTensorTracker | None = None
            self.mine: dict[str, Any] = {}
            self._ctx: Any = None

        def before_batch(self, schedule: Any, train: bool) -> None:
            assert self.tracker is not None
            self._ctx = self.tracker.track(schedule)
            self._ctx.__enter__()

        def after_batch(self, schedule: Any, train: bool) -> None:
            self._ctx.__exit__(None, None, None)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != 1:
                return
            gc.collect()
            self.tracker = SavedTensorTracker({p.untyped_storage().data_ptr() for p in pl_module.parameters()})
            self.runtime = trainer.strategy.runner.runtime
            self.runtime.add_observer(self)
            dist.barrier()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.tracker is None or self.mine:
                return
            self.runtime.remove_observer(self)
            gc.collect()
            tracker = self.tracker
            stages = [s.index for s in self.runtime.stages]
            self.mine = {
                "stages": stages,
                "peak_per_stage": {str(s): tracker.peak[s] for s in stages},
                "rank_peak": tracker.rank_peak,
                "unattributed_peak": tracker.peak.get(-1, 0),
                "left_after_step": tracker.rank_live,
            }

    for name in ("gpipe", "1f1b"):
        track = Track()
        module = build_llama(config, build=False)
        fit_3d(config, track, tp=1, pp=2, micro_batches=m, batch=m, steps=2, devices=2, module=module, schedule=name)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, track.mine)
        result[name] = gathered
    return {"runs": result, "config": config}


def run_llama(out: Path, tiny: bool, model: str) -> Record:
    """B3 on the Hugging Face Llama through the strategy: launch the two processes, build ``B3_<model>``."""
    from .common import launch
    from .hf_llama import check_model

    m, p = (4 if tiny else 8), 2
    res = launch("b3_activations:worker_llama", 2, {"model": check_model(model), "m": m, "tiny": tiny}, timeout=300)
    runs = res["runs"]
    per_stage: dict[str, dict[int, int]] = {name: {} for name in runs}
    for name, ranks in runs.items():
        for r in ranks:
            per_stage[name].update({int(s): v for s, v in r["peak_per_stage"].items()})
    lines = [
        f"{model} through ThreeDStrategy(pp=2), m={m} micro-batches of one sequence of {res['config']['block_size']}",
        "stage | 1F1B MB | GPipe MB | GPipe/1F1B | ideal m/min(m,p-s) | ratio",
    ]
    measured, baseline, ideal, ratios = {}, {}, {}, {}
    for s in range(p):
        one, gp = per_stage["1f1b"][s], per_stage["gpipe"][s]
        ideal_s = m / min(m, p - s)
        measured[str(s)], baseline[str(s)], ideal[str(s)] = gp / one, one / 2**20, ideal_s
        ratios[str(s)] = gp / one / ideal_s
        lines.append(
            f"{s:5d} | {one / 2**20:7.2f} | {gp / 2**20:8.2f} | {gp / one:10.3f} | {ideal_s:18.3f} | "
            f"{ratios[str(s)]:.3f}"
        )
    left = {name: [r["left_after_step"] for r in ranks] for name, ranks in runs.items()}
    unattributed = {name: [r["unattributed_peak"] for r in ranks] for name, ranks in runs.items()}
    lines.append(f"bytes still saved after the step (per rank): {left}; saved outside any stage: {unattributed}")
    details = {
        "model": model,
        "config": res["config"],
        "raw": runs,
        "per_stage_bytes": {k: {str(s): v for s, v in d.items()} for k, d in per_stage.items()},
        "gpipe_bytes_per_microbatch": {str(s): per_stage["gpipe"][s] / m for s in range(p)},
        "ratios_per_stage": ratios,
        "layout": f"pp=2 on 2 processes through ThreeDStrategy, m={m}, micro-batch 1 sequence",
    }
    return Record(
        f"{ID}_{model}",
        f"{TITLE} ({model}, through the strategy)",
        measured,
        baseline,
        ideal,
        min(ratios.values()),
        "GPipe/1F1B per stage",
        details,
        lines,
        "MB (1F1B peak per stage)",
    )


# ---------------------------------------------------------------------- one schedule (--schedule NAME)
def in_flight_theory(actions: list[Any], stage: int) -> dict[str, int]:
    """From one rank's action list, the most micro-batches of ``stage`` whose activations are held at once
    (``in_flight``) and the most held only for their weight gradient (``deferred``): the count the memory
    partitioner uses (:func:`lightning_3d.core.pipeline.held_micro_batches`)."""
    from lightning_3d.core.pipeline import held_micro_batches

    in_flight, deferred = held_micro_batches(actions, stage)
    return {"in_flight": in_flight, "deferred": deferred}


def schedule_worker(schedules: list[str], m: int, tiny: bool) -> dict[str, Any]:
    """Runs on both ranks (pp = 2): :func:`_one_schedule` for each schedule, in one launch."""
    return {schedule: _one_schedule(schedule, m, tiny) for schedule in schedules}


def _one_schedule(schedule: str, m: int, tiny: bool) -> dict[str, Any]:
    """The schedule's split and placement; one tracked step of the schedule with torch's split backward
    (``schedule``), one with the linear split where the schedule splits its backward (``linear``, the default
    ``split_backward``), and one of breadth-first order over the same stages (every micro-batch in flight: the bytes
    per micro-batch)."""
    import copy
    import gc

    import torch
    import torch.distributed as dist

    from lightning_3d.core import partition, torch_compat
    from lightning_3d.core.csv_schedule import is_csv_schedule
    from lightning_3d.core.pipeline import is_multi_stage, schedule_class, splits_backward, stage_ranks

    from .common import (
        build_gpt,
        cpu_stages,
        gpt_loss,
        init_distributed,
        model_config,
        pipeline_step,
        schedule_spec,
        token_batch,
    )

    rank, pp = init_distributed()
    config = model_config(tiny)
    model = build_gpt(config)
    x, y = token_batch(config, m)
    csv = is_csv_schedule(schedule)
    schedule, given = (schedule, None) if csv else schedule_spec(schedule)  # NAME:STAGES_PER_RANK
    spr = given or (1 if not is_multi_stage(schedule) else (len(stage_ranks(schedule, pp, 1)) // pp if csv else 2))
    placement = stage_ranks(schedule, pp, spr)
    result: dict[str, Any] = {}
    for run in ("schedule", "all_in_flight", *(("linear",) if splits_backward(schedule) else ())):
        piece = copy.deepcopy(model)
        body = partition.find_body(piece)
        plan = partition.plan_stages(body, pp, partition.get_partitioner("uniform"), spr, placement)
        mine = [(s, partition.stage_container(body, plan.layer_names[s])) for s in range(plan.num_stages)]
        mine = [(s, mod) for s, mod in mine if placement[s] == rank]
        built = cpu_stages(mine, plan.num_stages, defer_linear=run == "linear")
        if run == "all_in_flight":
            cls = torch_compat.looped_bfs_placed(placement) if len(built) > 1 else schedule_class("gpipe")
        else:
            cls = None if csv else schedule_class(schedule)
        if cls is None:
            sched = torch_compat.csv_schedule(built, m, schedule, loss_fn=gpt_loss)
        elif len(built) == 1 and not issubclass(cls, torch.distributed.pipelining.schedules.PipelineScheduleMulti):
            sched = cls(built[0], m, loss_fn=gpt_loss)
        else:
            sched = cls(built, m, loss_fn=gpt_loss)
        held = {s for s, _ in mine}
        first, last = 0 in held, plan.num_stages - 1 in held
        params = {p.untyped_storage().data_ptr() for p in piece.parameters()}
        pipeline_step(sched, first, last, x, y)  # shapes are exchanged on the first step
        for p in piece.parameters():
            p.grad = None
        gc.collect()
        tracker = SavedTensorTracker(params)
        dist.barrier()
        with tracker.track(sched):
            pipeline_step(sched, first, last, x, y)
        gc.collect()
        dist.barrier()
        multi = isinstance(sched, torch.distributed.pipelining.schedules.PipelineScheduleMulti)
        order = (getattr(sched, "pipeline_order", None) or {}) if multi else {}  # single-stage: the formula
        theory = {str(s): in_flight_theory(list(order.get(rank, [])), s) for s, _ in mine} if order else {}
        mine_out = {
            "stages": sorted(held),
            "peak_per_stage": {str(s): tracker.peak[s] for s in held},
            "rank_peak": tracker.rank_peak,
            "theory": theory,
            "class": type(sched).__name__,
        }
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, mine_out)
        result[run] = gathered
    return {"runs": result, "placement": placement, "stages_per_rank": spr}


def run_schedules(out: Path, schedules: str, tiny: bool = False) -> list[Record]:
    """``--schedule A,B,...``: :func:`run_schedule` for each, in one launch (one record each)."""
    from .common import checked_stages_per_rank, launch

    names = [n.strip() for n in schedules.split(",") if n.strip()]
    for name in names:
        checked_stages_per_rank(name)
    m = 4 if tiny else 8
    res = launch("b3_activations:schedule_worker", 2, {"schedules": names, "m": m, "tiny": tiny}, timeout=900)
    return [_schedule_record(name, res[name], m) for name in names]


def run_schedule(out: Path, schedule: str, tiny: bool = False) -> Record:
    """``python -m benchmarks B3 --schedule NAME``: the activation memory one schedule keeps in flight per stage
    (pp = 2 on 2 processes, m = 8; m = 4 with ``tiny``) against its theory: the most micro-batches in flight
    on the stage (from the schedule's action list; 1F1B ``min(m, p - s)``, GPipe ``m``) times the stage's bytes
    per micro-batch (measured with every micro-batch in flight: breadth-first order over the same stages).
    Zero-bubble schedules also report the most micro-batches whose weight-gradient is deferred (``I`` run, ``W``
    not yet), and run the step twice: with torch's split backward (``split_backward="autograd"``: the activations
    stay saved until ``W``, torch keeps the graph for it) and with the linear split, the default (the graph goes in
    ``I``; the linear layers' inputs and output gradients are held until ``W``, counted with autograd's saved
    tensors by storage)."""
    from .common import checked_stages_per_rank, launch

    checked_stages_per_rank(schedule)
    m = 4 if tiny else 8
    res = launch("b3_activations:schedule_worker", 2, {"schedules": [schedule], "m": m, "tiny": tiny}, timeout=300)
    return _schedule_record(schedule, res[schedule], m)


def _schedule_record(schedule: str, res: dict[str, Any], m: int) -> Record:
    """One schedule's record: per stage, micro-batches in flight (peak bytes / bytes per micro-batch) under the
    default split backward (the linear split where the schedule splits its backward) and under torch's split,
    against the action list's count. The ratio is the default split's lowest measured / theory."""
    runs = res["runs"]
    label = Path(schedule).name if schedule.lower().endswith(".csv") else schedule.lower().replace(":", "-")
    linear = "linear" in runs
    lines = [
        f"schedule {label} at pp=2, m={m} (stages per rank {res['stages_per_rank']}, placement {res['placement']})",
        "stage | MB per micro-batch | in flight, torch's split (peak MB) | "
        + ("linear split, the default (peak MB) | " if linear else "")
        + "theory | deferred W",
    ]
    stages: dict[str, Any] = {}
    ratios = []
    linear_ranks = runs["linear"] if linear else [None] * len(runs["schedule"])
    for mine, full, lin in zip(runs["schedule"], runs["all_in_flight"], linear_ranks):
        for s in mine["stages"]:
            per_mb = full["peak_per_stage"][str(s)] / m
            peak = mine["peak_per_stage"][str(s)]
            if mine["theory"]:
                theory = mine["theory"][str(s)]
            else:  # single-stage schedules: no action list on this torch; the formula
                flight = m if label == "gpipe" else min(m, 2 - s)
                theory = {"in_flight": flight, "deferred": 0}
            measured = peak / per_mb if per_mb else 0.0
            peak_linear = lin["peak_per_stage"][str(s)] if lin else None
            measured_linear = peak_linear / per_mb if lin and per_mb else None
            default = measured_linear if lin else measured
            ratio = default / theory["in_flight"] if theory["in_flight"] and default is not None else None
            if ratio is not None:
                ratios.append(ratio)
            stages[str(s)] = {
                "bytes_per_microbatch": per_mb,
                "peak_bytes": peak,
                "measured_in_flight": measured,
                "peak_bytes_linear": peak_linear,
                "measured_in_flight_linear": measured_linear,
                "theory_in_flight": theory["in_flight"],
                "theory_deferred_weight": theory["deferred"],
                "ratio": ratio,
            }
            linear_cell = f"{measured_linear:5.2f} ({peak_linear / 2**20:6.2f}) | " if lin else ""
            lines.append(
                f"{s:5d} | {per_mb / 2**20:18.3f} | {measured:5.2f} ({peak / 2**20:6.2f}) | {linear_cell}"
                f"{theory['in_flight']:6d} | {theory['deferred']:10d}"
            )
    for run in ("schedule", *(("linear",) if linear else ())):
        name = "torch's split" if run == "schedule" else "linear split"
        lines.append(f"per rank peak MB, {name}: " + ", ".join(f"{r['rank_peak'] / 2**20:.2f}" for r in runs[run]))
    key = "measured_in_flight_linear" if linear else "measured_in_flight"
    details = {
        "schedule": label,
        "class": runs["schedule"][0]["class"],
        "m": m,
        "placement": res["placement"],
        "per_stage": stages,
        "rank_peak_bytes": [r["rank_peak"] for r in runs["schedule"]],
        "rank_peak_bytes_linear": [r["rank_peak"] for r in runs["linear"]] if linear else None,
        "raw": runs,
    }
    worst = min(ratios) if ratios else None
    return Record(
        f"{ID}_{label.removesuffix('.csv')}",
        f"activation memory in flight under {label}: measured against the schedule's micro-batches in flight",
        {k: v[key] for k, v in stages.items()},
        {k: v["bytes_per_microbatch"] / 2**20 for k, v in stages.items()},
        {k: v["theory_in_flight"] for k, v in stages.items()},
        worst,
        "micro-batches in flight per stage (peak saved bytes / bytes per micro-batch; the default split backward)",
        details,
        lines,
        "MB per micro-batch",
    )
