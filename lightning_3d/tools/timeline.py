"""A picture of the pipeline: what every rank did during one schedule step.

For a profiled step the schedule's stages and torch's point-to-point helpers are wrapped (instance attributes
of the stages and the schedule, and the schedules' two point-to-point helpers, all through
``lightning_3d.core.torch_compat`` and removed right after the step), and each rank records the start and end of:

===============  ================================================================================
``F<i>``         ``stage.forward_one_chunk`` of micro-batch *i* (category ``forward``)
``B<i>``         ``stage.backward_one_chunk`` (``backward``); under zero-bubble schedules
                 (``interleavedzerobubble``, ``zbvzerobubble``, ``dualpipev``) the backward is split:
                 ``I<i>`` the input-gradient part (``backward``) and ``W<i>`` the deferred weight-gradient
                 part (``weight``)
``loss<i>``      the schedule's loss function on the last stage (``loss``; under ``ThreeDStrategy`` this
                 is the user's ``training_step`` on micro-batch *i*)
``post ...``     posting sends / receives (``torch_compat.wrap_batch_p2p``; category ``post``)
``wait ...``     waiting for them (``torch_compat.wrap_wait_batch_p2p``; ``recv`` when the batch holds a
                 receive, else ``send``): a stage that waits for its neighbour shows it here
``reduce grad``  ``perform_reduce_grad`` after the last backward: the data-parallel all-reduce (and torch's
                 gradient scaling by 1 / m when the schedule has ``scale_grads=True``)
``step``         the whole ``schedule.step`` call
===============  ================================================================================

The events of every rank are gathered (one ``all_gather_object``) and written as

* a Chrome trace (open it in https://ui.perfetto.dev or ``chrome://tracing``): one process row per rank,
  named with its stage and (dp, tp) coordinates, one thread row per stage;
* a Gantt chart (PNG, needs matplotlib: ``pip install 'lightning-3d[plot]'``) with one row per stage and
  the measured bubble fraction beside the theoretical ``(p - 1) / (m + p - 1)``
  (``(p - 1) / (v m + p - 1)`` with ``v`` stages per rank). For the zero-bubble schedules (``W`` actions fill
  the 1F1B bubble, so that formula does not hold) and a CSV action list the theory is the schedule's own: each
  pipeline rank's idle slots over all slots of its action list (``schedule.pipeline_order``), one slot per
  action, the list played slot by slot so that a list written without its idle slots (as a hand-written CSV
  file usually is) gets the ones its dependencies force (:func:`played_order`).

The measured bubble of a pipeline rank is ``1 - compute / span``: ``compute`` is the union of its forward,
backward, weight and loss intervals and ``span`` runs from the first rank's ``step`` start to the last
rank's ``step`` end; the reported figure is the mean over pipeline ranks. It includes everything that is not
compute (waiting for a neighbour, communication, Python between the calls, the final gradient all-reduce),
so it is the bubble *as paid*, to compare with the theory that counts idle slots only.

Two ways in:

>>> trainer = Trainer(strategy=ThreeDStrategy(pp=2, micro_batches=8),
...                   callbacks=[PipelineTimeline(out_dir="timeline")])  # doctest: +SKIP

or, around a hand-built torch schedule (all ranks):

>>> recorder = ScheduleRecorder()  # doctest: +SKIP
>>> with recorder.patch(schedule):  # doctest: +SKIP
...     schedule.step(x)
>>> timelines = gather_timelines(recorder.timeline(schedule))  # doctest: +SKIP
>>> write_chrome_trace(timelines, "trace.json"); plot_gantt(timelines, "gantt.png")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..core import torch_compat

COMPUTE_CATEGORIES: tuple[str, ...] = ("forward", "backward", "weight", "loss")
"""Event categories that count as compute in the bubble measurement."""

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight": "#55A868",
    "loss": "#8172B3",
    "recv": "#9A9A9A",
    "send": "#CFCFCF",
    "post": "#E5E5E5",
    "reduce_grad": "#C44E52",
}

MATPLOTLIB_MISSING = (
    "The pipeline Gantt chart needs matplotlib, which is an optional extra: pip install 'lightning-3d[plot]' "
    "(or matplotlib itself), or pass gantt=False to write the Chrome trace only."
)


@dataclass
class TimelineEvent:
    """One interval on one rank.

    Attributes:
        name: ``"F3"``, ``"B3"``, ``"loss3"``, ``"wait recv F3"``, ``"reduce grad"``, ``"step"``...
        cat: ``forward``, ``backward``, ``weight``, ``loss``, ``post``, ``recv``, ``send``, ``reduce_grad``
            or ``step``.
        stage: global stage index (``None`` for the step envelope).
        micro_batch: micro-batch index, when the event has one.
        start_ns: start, in the recorder's clock (``time.perf_counter_ns``: one clock per host).
        end_ns: end.
        args: extra details (peers and bytes of point-to-point operations).
        cpu_ns: CPU time of the recording thread during the event; well below ``end_ns - start_ns`` on a compute
            or post event means the thread was descheduled (another process or thread had its core).
    """

    name: str
    cat: str
    stage: int | None
    micro_batch: int | None
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)
    cpu_ns: int | None = None


@dataclass
class RankTimeline:
    """Everything one rank recorded for one schedule step.

    Attributes:
        rank: global rank.
        stages: the global stage indices this rank holds.
        num_stages: stages in the whole pipeline.
        pp: pipeline ranks (``num_stages / len(stages)``).
        n_micro: micro-batches in the step.
        schedule: the torch schedule class name.
        coords: the rank's mesh coordinates (``{"dp": .., "pp": .., "tp": ..}``), when known.
        host: host name (clocks are compared as they are only between ranks of one host).
        events: the intervals, in the order they ended.
        order_bubble: the theoretical bubble of this rank from the schedule's action list (zero-bubble
            schedules; ``None``: the formula applies).
    """

    rank: int
    stages: list[int]
    num_stages: int
    pp: int
    n_micro: int
    schedule: str
    coords: dict[str, int] = field(default_factory=dict)
    host: str = ""
    events: list[TimelineEvent] = field(default_factory=list)
    order_bubble: float | None = None

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RankTimeline:
        """Inverse of ``dataclasses.asdict``."""
        events = [TimelineEvent(**e) for e in data.get("events", [])]
        return RankTimeline(**{**data, "events": events})


def _first_arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> int | None:
    value = args[0] if args else kwargs.get(name)
    return int(value) if isinstance(value, int) else None


class ScheduleRecorder:
    """Records the events of schedule steps on this rank (see the module docstring).

    Args:
        clock: nanosecond clock; the default ``time.perf_counter_ns`` is system-wide on Linux, so ranks of one
            host share it.
    """

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.events: list[TimelineEvent] = []
        self._op_tags: dict[int, tuple[Any, str, str, int, int]] = {}
        self._works: dict[int, tuple[list[Any], list[tuple[str, str, int, int]], list[dict[str, Any]]]] = {}

    def clear(self) -> None:
        """Forget the recorded events."""
        self.events = []

    def _add(
        self,
        name: str,
        cat: str,
        stage: int | None,
        mb: int | None,
        start: tuple[int, int],
        args: dict[str, Any] | None = None,
    ) -> None:
        cpu = time.thread_time_ns() - start[1]
        self.events.append(TimelineEvent(name, cat, stage, mb, start[0], self.clock(), dict(args or {}), cpu))

    def _now(self) -> tuple[int, int]:
        return self.clock(), time.thread_time_ns()

    # ------------------------------------------------------------------ wrappers
    def _timed(self, fn: Callable[..., Any], cat: str, stage: int | None, prefix: str, arg: str | None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mb = _first_arg(args, kwargs, arg) if arg else None
            start = self._now()
            # a zero-bubble schedule's input-gradient half of a backward (its weight half is a later W)
            name = "I" if prefix == "B" and kwargs.get("full_backward", True) is False else prefix
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(f"{name}{'' if mb is None else mb}", cat, stage, mb, start)

        return wrapper

    def _tagging(self, fn: Callable[..., Any], kind: str, direction: str, stage: int) -> Any:
        def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            ops = fn(chunk_id, *args, **kwargs)
            for op in ops:
                self._op_tags[id(op)] = (op, kind, direction, int(chunk_id), stage)
            return ops

        return wrapper

    def _loss(self, fn: Callable[..., Any], has_loss: bool) -> Any:
        def wrapper(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
            if not (getattr(stage, "is_last", False) and has_loss):
                return fn(stage, output, target_mbs, mb_index, *args, **kwargs)
            start = self._now()
            try:
                return fn(stage, output, target_mbs, mb_index, *args, **kwargs)
            finally:
                self._add(f"loss{mb_index}", "loss", int(stage.stage_index), int(mb_index), start)

        return wrapper

    def _posting(self, fn: Callable[..., Any]) -> Any:
        def wrapper(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
            if not p2p_ops:
                return fn(p2p_ops, *args, **kwargs)
            labels, details = [], []
            for op in p2p_ops:
                tag = self._op_tags.pop(id(op), None)
                kind, direction, mb, stage = tag[1:] if tag is not None else ("p2p", "?", -1, -1)
                labels.append((kind, direction, mb, stage))
                details.append(
                    {"op": kind, "peer": int(op.peer), "bytes": op.tensor.numel() * op.tensor.element_size()}
                )
            start = self._now()
            works = fn(p2p_ops, *args, **kwargs)
            self._add("post " + _label(labels), "post", labels[0][3], labels[0][2], start, {"ops": details})
            self._works[id(works)] = (works, labels, details)
            return works

        return wrapper

    def _waiting(self, fn: Callable[..., Any]) -> Any:
        def wrapper(work: list[Any], *args: Any, **kwargs: Any) -> Any:
            entry = self._works.pop(id(work), None)
            if entry is None or entry[0] is not work:
                return fn(work, *args, **kwargs)
            _, labels, details = entry
            start = self._now()
            try:
                return fn(work, *args, **kwargs)
            finally:
                cat = "recv" if any(k == "recv" for k, *_ in labels) else "send"
                self._add("wait " + _label(labels), cat, labels[0][3], labels[0][2], start, {"ops": details})

        return wrapper

    # ------------------------------------------------------------------ install / restore
    @contextlib.contextmanager
    def patch(self, schedule: Any) -> Iterator[ScheduleRecorder]:
        """Record every step of ``schedule`` run inside the block; everything is restored on exit."""
        undo: list[Callable[[], None]] = []
        wrap = torch_compat.wrap_method
        try:
            for stage in torch_compat.schedule_stages(schedule):
                index = int(stage.stage_index)
                for method, cat, prefix, arg in (
                    ("forward_one_chunk", "forward", "F", "fwd_chunk_id"),
                    ("backward_one_chunk", "backward", "B", "bwd_chunk_id"),
                    ("backward_weight_one_chunk", "weight", "W", "bwd_chunk_id"),
                    ("perform_reduce_grad", "reduce_grad", "reduce grad", None),
                ):
                    if hasattr(stage, method):
                        timed = partial(self._timed, cat=cat, stage=index, prefix=prefix, arg=arg)
                        undo.append(wrap(stage, method, timed))
                for getter, kind, direction in (
                    ("get_fwd_recv_ops", "recv", "F"),
                    ("get_fwd_send_ops", "send", "F"),
                    ("get_bwd_recv_ops", "recv", "B"),
                    ("get_bwd_send_ops", "send", "B"),
                ):
                    tagging = partial(self._tagging, kind=kind, direction=direction, stage=index)
                    undo.append(wrap(stage, getter, tagging))
            undo.append(
                torch_compat.wrap_schedule_loss(
                    schedule, partial(self._loss, has_loss=torch_compat.schedule_has_loss(schedule))
                )
            )
            undo.append(wrap(schedule, "step", partial(self._timed, cat="step", stage=None, prefix="step", arg=None)))
            undo.append(torch_compat.wrap_batch_p2p(self._posting))
            undo.append(torch_compat.wrap_wait_batch_p2p(self._waiting))
            yield self
        finally:
            for restore in reversed(undo):
                restore()
            self._op_tags.clear()
            self._works.clear()

    def timeline(self, schedule: Any, coords: dict[str, int] | None = None) -> RankTimeline:
        """This rank's events as a :class:`RankTimeline` (and a fresh, empty event list for the next step)."""
        stages = torch_compat.schedule_stages(schedule)
        num_stages = int(stages[0].num_stages) if stages else 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        events, self.events = self.events, []
        return RankTimeline(
            rank=rank,
            stages=[int(s.stage_index) for s in stages],
            num_stages=num_stages,
            pp=max(1, num_stages // max(1, len(stages))),
            n_micro=torch_compat.schedule_micro_batches(schedule),
            schedule=type(schedule).__name__,
            coords=dict(coords or {}),
            host=socket.gethostname(),
            events=events,
            order_bubble=schedule_order_bubble(schedule, int(stages[0].stage_index) if stages else None),
        )


def _label(labels: Sequence[tuple[str, str, int, int]]) -> str:
    return " + ".join(f"{kind} {direction}{mb}" for kind, direction, mb, _ in labels)


def gather_timelines(local: RankTimeline, group: Any = None) -> list[RankTimeline]:
    """Every rank's timeline, on every rank (collective over ``group``; default: the world).

    Ranks on another host than the first rank get their clock shifted by the difference of the instants at
    which they left a barrier (ranks of one host share ``perf_counter_ns`` and are left as they are).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    dist.barrier(group=group)
    after_barrier = time.perf_counter_ns()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (asdict(local), after_barrier), group=group)
    timelines = [RankTimeline.from_dict(data) for data, _ in gathered]
    ref_host, ref_clock = timelines[0].host, gathered[0][1]
    for tl, (_, clock) in zip(timelines, gathered):
        if tl.host != ref_host:
            shift = ref_clock - clock
            for e in tl.events:
                e.start_ns += shift
                e.end_ns += shift
    return sorted(timelines, key=lambda t: t.rank)


# ---------------------------------------------------------------------- analysis
def _union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def representative_ranks(timelines: Sequence[RankTimeline]) -> dict[int, RankTimeline]:
    """One timeline per pipeline rank: the lowest global rank among those holding the same stages
    (dp 0 / tp 0 in the usual mesh)."""
    chosen: dict[int, RankTimeline] = {}
    for tl in sorted(timelines, key=lambda t: t.rank):
        if tl.stages and tl.stages[0] not in chosen:
            chosen[tl.stages[0]] = tl
    return dict(sorted(chosen.items()))


def theoretical_bubble(pp: int, n_micro: int, stages_per_rank: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: the idle share of a balanced 1F1B/GPipe (``v = 1``) or interleaved step."""
    return (pp - 1) / (stages_per_rank * n_micro + pp - 1)


#: torch's zero-bubble schedules and its runtime for CSV action lists (``schedule="path.csv"``): their theoretical
#: bubble comes from their action list, not the 1F1B formula.
ZERO_BUBBLE_CLASSES = frozenset(
    {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "_PipelineScheduleRuntime"}
)


def _needs(action: Any, last_stage: int) -> list[tuple[int, str, Any]]:
    """What a computation waits for: a forward for the previous stage's forward of its micro-batch, a full or
    input-gradient backward for the next stage's (``"G"``: either kind) or, on the last stage, its own forward; a
    weight gradient for its stage's input gradient."""
    stage, kind, mb = action.stage_index, torch_compat.action_kind(action), action.microbatch_index
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if kind in ("B", "I"):
        return [(stage, "F", mb)] if stage == last_stage else [(stage + 1, "G", mb)]
    if kind == "W":
        return [(stage, "G", mb)]
    return []


def played_order(pipeline_order: dict[int, Sequence[Any]]) -> dict[int, list[Any]]:
    """A schedule's action list played in unit time slots: the time-aligned list it stands for.

    Slot by slot, each rank runs its next action once everything it waits for (:func:`_needs`) ran in an earlier
    slot on any rank, and otherwise idles for the slot (``None``); a ``None`` in the list is an idle slot as
    written. torch's multi-stage schedules build their lists with their idle slots in place, and so does
    ``csv_schedule.zero_bubble_greedy_rows``: playing them changes no rank's idle share (it may move an idle slot
    from the end of a shorter list to where the wait is). A list written by hand or read from a CSV file usually
    has no idle slot written; played, 1F1B's order shows its ``(p - 1) / (m + p - 1)``.

    Raises:
        ValueError: the list cannot run (some action waits for one that no rank runs before it).
    """
    stages = [
        part.stage_index
        for acts in pipeline_order.values()
        for a in acts
        if a is not None
        for part in torch_compat.action_parts(a)
    ]
    last_stage = max(stages, default=0)
    pointer = dict.fromkeys(pipeline_order, 0)
    played: dict[int, list[Any]] = {rank: [] for rank in pipeline_order}
    done: set[tuple[int, str, Any]] = set()
    while any(pointer[rank] < len(actions) for rank, actions in pipeline_order.items()):
        finished, moved = set(), False
        for rank, actions in pipeline_order.items():
            if pointer[rank] >= len(actions):
                continue
            action = actions[pointer[rank]]
            ready = action is None or all(
                need in done for part in torch_compat.action_parts(action) for need in _needs(part, last_stage)
            )
            played[rank].append(action if ready else None)
            if ready:
                pointer[rank] += 1
                moved = True
                for part in () if action is None else torch_compat.action_parts(action):
                    kind = torch_compat.action_kind(part)
                    finished.add((part.stage_index, "G" if kind in ("B", "I") else kind, part.microbatch_index))
        if not moved:
            waiting = {
                rank: str(actions[pointer[rank]])
                for rank, actions in pipeline_order.items()
                if pointer[rank] < len(actions)
            }
            raise ValueError(f"the action list cannot run: every rank waits ({waiting})")
        done |= finished
    return played


def order_bubbles(pipeline_order: dict[int, Sequence[Any]]) -> dict[int, float]:
    """Each pipeline rank's idle share of a schedule's action list, played in unit time slots
    (:func:`played_order`): idle slots over all slots.

    Args:
        pipeline_order: ``{pp rank: [action or None per time slot]}`` (torch's ``schedule.pipeline_order``);
            a rank's list shorter than the longest one is idle for the remaining slots.

    Returns:
        ``{pp rank: idle slots / slots}``, one slot per action (forward, backward, input- or weight-gradient).
    """
    played = played_order(pipeline_order)
    total = max((len(actions) for actions in played.values()), default=0)
    if total == 0:
        return {rank: 0.0 for rank in played}
    return {rank: (total - sum(action is not None for action in actions)) / total for rank, actions in played.items()}


def rank_of_stage(pipeline_order: dict[int, Sequence[Any]], stage: int) -> int | None:
    """The pipeline rank whose actions run stage ``stage`` (``None`` if no action names it)."""
    for rank, actions in pipeline_order.items():
        if any(action is not None and getattr(action, "stage_index", None) == stage for action in actions):
            return rank
    return None


def schedule_order_bubble(schedule: Any, stage: int | None) -> float | None:
    """The theoretical bubble of the rank holding ``stage`` from a zero-bubble schedule's action list
    (``None`` for the other schedules, or when the schedule has no action list)."""
    order = getattr(schedule, "pipeline_order", None)
    if type(schedule).__name__ not in ZERO_BUBBLE_CLASSES or not order or stage is None:
        return None
    rank = rank_of_stage(order, stage)
    return None if rank is None else order_bubbles(order)[rank]


def bubble_stats(timelines: Sequence[RankTimeline]) -> dict[str, Any]:
    """Measured bubble per pipeline rank and on average, with the theory and a breakdown of the step.

    Returns a dict with ``span_ms``, ``theory``, ``measured`` (mean over pipeline ranks) and ``ranks``: for each
    pipeline rank (its first stage's index as key) ``compute_ms``, ``forward_ms``, ``backward_ms``, ``loss_ms``,
    ``recv_wait_ms``, ``send_ms`` (posting and waiting on sends), ``reduce_grad_ms``, ``other_ms`` (the rest of
    the span: outside the step or between calls), ``fill_ms`` (before its first compute), ``stall_ms`` (not
    computing between its first and last compute: waiting in the steady state), ``drain_ms`` (after its last
    compute), ``descheduled_ms`` (wall minus thread CPU time of its compute and post events: time its thread was
    off the CPU while it should have been running), ``bubble`` and ``theory`` (its theoretical bubble: from the
    schedule's action list for the zero-bubble schedules, else the formula; ``theory_source`` says which).
    """
    reps = representative_ranks(timelines)
    if not reps:
        return {}
    steps = [e for tl in reps.values() for e in tl.events if e.cat == "step"]
    if steps:
        t0, t1 = min(e.start_ns for e in steps), max(e.end_ns for e in steps)
    else:
        every = [e for tl in reps.values() for e in tl.events]
        t0, t1 = min(e.start_ns for e in every), max(e.end_ns for e in every)
    span = max(1, t1 - t0)
    first_tl = next(iter(reps.values()))
    ranks: dict[str, dict[str, float]] = {}
    for stage, tl in reps.items():
        ev = [e for e in tl.events if e.cat != "step"]

        def total(cats: Sequence[str], events: list[TimelineEvent] = ev) -> int:
            return _union_ns([(e.start_ns, e.end_ns) for e in events if e.cat in cats])

        compute = total(COMPUTE_CATEGORIES)
        busy = _union_ns([(e.start_ns, e.end_ns) for e in ev])
        computing = [e for e in ev if e.cat in COMPUTE_CATEGORIES]
        first = min((e.start_ns for e in computing), default=t0)
        last = max((e.end_ns for e in computing), default=t0)
        ranks[str(stage)] = {
            "stages": list(tl.stages),
            "global_rank": tl.rank,
            "compute_ms": compute / 1e6,
            "forward_ms": total(("forward",)) / 1e6,
            "backward_ms": total(("backward", "weight")) / 1e6,
            "loss_ms": total(("loss",)) / 1e6,
            "recv_wait_ms": total(("recv",)) / 1e6,
            "send_ms": total(("send", "post")) / 1e6,
            "reduce_grad_ms": total(("reduce_grad",)) / 1e6,
            "descheduled_ms": sum(
                e.end_ns - e.start_ns - e.cpu_ns
                for e in ev
                if e.cpu_ns is not None and e.cat in (*COMPUTE_CATEGORIES, "post")
            )
            / 1e6,
            "other_ms": (span - busy) / 1e6,
            "fill_ms": (first - t0) / 1e6,
            "stall_ms": max(0, last - first - compute) / 1e6,
            "drain_ms": (t1 - last) / 1e6,
            "bubble": 1.0 - compute / span,
        }
    v = max(1, len(first_tl.stages))
    formula = theoretical_bubble(first_tl.pp, first_tl.n_micro, v)
    from_order = all(tl.order_bubble is not None for tl in reps.values())
    for stage, tl in reps.items():  # each rank's measured bubble beside its theoretical one
        ranks[str(stage)]["theory"] = tl.order_bubble if from_order else formula
    measured = sum(r["bubble"] for r in ranks.values()) / len(ranks)
    return {
        "schedule": first_tl.schedule,
        "pp": first_tl.pp,
        "stages_per_rank": v,
        "n_micro": first_tl.n_micro,
        "span_ms": span / 1e6,
        "theory": sum(r["theory"] for r in ranks.values()) / len(ranks) if from_order else formula,
        "theory_source": "action list" if from_order else "formula",
        "measured": measured,
        "ranks": ranks,
    }


# ---------------------------------------------------------------------- output
def chrome_trace(timelines: Sequence[RankTimeline]) -> dict[str, Any]:
    """The timelines as a Chrome trace (JSON object format): one process per rank, one thread per stage."""
    every = [e for tl in timelines for e in tl.events]
    t0 = min((e.start_ns for e in every), default=0)
    out: list[dict[str, Any]] = []
    for tl in timelines:
        where = ", ".join(f"{k} {v}" for k, v in tl.coords.items())
        stages = "+".join(str(s) for s in tl.stages)
        out.append(
            {"ph": "M", "name": "process_name", "pid": tl.rank, "args": {"name": f"rank {tl.rank}: stage {stages}"}}
        )
        if where:
            out.append({"ph": "M", "name": "process_labels", "pid": tl.rank, "args": {"labels": where}})
        out.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": tl.rank,
                "args": {"sort_index": (tl.stages[0] if tl.stages else 0) * 100000 + tl.rank},
            }
        )
        out.append({"ph": "M", "name": "thread_name", "pid": tl.rank, "tid": -1, "args": {"name": "schedule step"}})
        for s in tl.stages:
            out.append({"ph": "M", "name": "thread_name", "pid": tl.rank, "tid": s, "args": {"name": f"stage {s}"}})
        for e in tl.events:
            args = {**e.args}
            if e.micro_batch is not None:
                args["micro_batch"] = e.micro_batch
            if e.cpu_ns is not None:
                args["thread_cpu_ms"] = e.cpu_ns / 1e6
            out.append(
                {
                    "name": e.name,
                    "cat": e.cat,
                    "ph": "X",
                    "pid": tl.rank,
                    "tid": -1 if e.stage is None else e.stage,
                    "ts": (e.start_ns - t0) / 1e3,
                    "dur": max(0.0, (e.end_ns - e.start_ns) / 1e3),
                    "args": args,
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timelines: Sequence[RankTimeline], path: str | Path, summary: dict[str, Any] | None = None
) -> Path:
    """Write :func:`chrome_trace` (with ``summary`` under ``otherData``) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(timelines)
    trace["otherData"] = {"bubble": summary if summary is not None else bubble_stats(timelines)}
    path.write_text(json.dumps(trace))
    return path


def matplotlib_available() -> bool:
    """Whether the Gantt chart can be drawn."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_gantt(
    timelines: Sequence[RankTimeline],
    path: str | Path,
    title: str | None = None,
    summary: dict[str, Any] | None = None,
) -> Path:
    """Draw one row per stage (from the lowest rank holding it) and save a PNG to ``path``.

    Raises:
        ImportError: matplotlib is not installed (it is the ``plot`` extra).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(MATPLOTLIB_MISSING) from err
    summary = summary if summary is not None else bubble_stats(timelines)
    reps = representative_ranks(timelines)
    rows: dict[int, tuple[RankTimeline, list[TimelineEvent]]] = {}
    for tl in reps.values():
        for s in tl.stages:
            rows[s] = (tl, [e for e in tl.events if e.stage == s])
    every = [e for tl in reps.values() for e in tl.events]
    t0 = min((e.start_ns for e in every), default=0)
    t1 = max((e.end_ns for e in every), default=1)
    n = max(1, len(rows))
    fig = Figure(figsize=(13, 1.4 + 0.9 * n))
    ax = fig.add_subplot()
    for y, (stage, (tl, events)) in enumerate(sorted(rows.items())):
        for e in events:
            x, w = (e.start_ns - t0) / 1e6, (e.end_ns - e.start_ns) / 1e6
            if e.cat in COMPUTE_CATEGORIES or e.cat == "reduce_grad":
                ax.broken_barh([(x, w)], (y - 0.32, 0.64), facecolors=_COLORS[e.cat], edgecolor="white", lw=0.3)
                if w > (t1 - t0) / 1e6 / 70:
                    ax.text(x + w / 2, y, e.name.replace("reduce grad", "RG"), ha="center", va="center", fontsize=7)
            elif e.cat in ("recv", "send", "post"):
                ax.broken_barh([(x, w)], (y + 0.34, 0.14), facecolors=_COLORS[e.cat], hatch="///", edgecolor="#666")
        rank_stats = summary.get("ranks", {}).get(str(tl.stages[0]), {})
        if rank_stats and stage == tl.stages[0]:
            ax.text(
                1.005,
                1 - (y + 0.5) / n,
                f"rank {tl.rank}\nbubble {rank_stats['bubble']:.1%}"
                + (f" (theory {rank_stats['theory']:.1%})" if "theory" in rank_stats else "")
                + f"\nwait {rank_stats['recv_wait_ms']:.1f} ms",
                transform=ax.transAxes,
                fontsize=8,
                va="center",
            )
    ax.set_yticks(range(n), [f"stage {s}" for s in sorted(rows)])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel("ms since the first event")
    if title is None and summary:
        title = (
            f"{summary['schedule']}, p={summary['pp']}"
            + (f", v={summary['stages_per_rank']}" if summary["stages_per_rank"] > 1 else "")
            + f", m={summary['n_micro']}: measured bubble {summary['measured']:.1%} "
            f"(theory {summary['theory']:.1%}), step {summary['span_ms']:.1f} ms"
        )
    ax.set_title(title or "pipeline timeline", fontsize=10)
    present = {e.cat for _, events in rows.values() for e in events}
    names = {"reduce_grad": "reduce grad (DP all-reduce / scaling)"}
    handles = [
        Patch(color=_COLORS[c], label=names.get(c, c))
        for c in (*COMPUTE_CATEGORIES, "reduce_grad")
        if c in present or c in ("forward", "backward")
    ]
    handles.append(Patch(facecolor=_COLORS["recv"], hatch="///", edgecolor="#666", label="p2p wait (recv)"))
    handles.append(Patch(facecolor=_COLORS["post"], hatch="///", edgecolor="#666", label="p2p post / send"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 + 0.1 / n, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------- Lightning callback
class RecordingObserver:
    """A pipeline-runtime observer (``PipelineRuntime.add_observer``) that records every batch it sees.

    Each batch runs inside ``recorder.patch(schedule)``; :attr:`schedule` is the last schedule seen.

    Args:
        recorder: where the events go.
    """

    def __init__(self, recorder: ScheduleRecorder) -> None:
        self.recorder = recorder
        self.schedule: Any = None
        self._patched = contextlib.ExitStack()

    def before_batch(self, schedule: Any, train: bool) -> None:
        """Start recording ``schedule``'s step."""
        self.schedule = schedule
        self._patched.enter_context(self.recorder.patch(schedule))

    def after_batch(self, schedule: Any, train: bool) -> None:
        """Stop recording: every wrapper is removed again."""
        self._patched.close()


class PipelineTimeline(Callback):
    """Record the pipeline schedule of chosen training steps on every rank; rank 0 writes the pictures.

    Works with ``ThreeDStrategy`` (it uses ``trainer.strategy.runner.runtime``). For a profiled step it writes
    ``OUT/timeline_step<N>.json`` (Chrome trace, with the bubble summary under ``otherData``) and, unless
    ``gantt=False``, ``OUT/timeline_step<N>.png``. The summaries stay in ``self.summaries`` (on every rank).

    Args:
        out_dir: folder for the files.
        first_step: first global step to profile; the default 1 skips step 0, where torch's schedules
            exchange shapes.
        every_n_steps: profile again every this many steps after ``first_step`` (``None``: once).
        max_profiles: stop after this many profiled steps (``None``: no limit).
        gantt: draw the PNG (needs matplotlib, the ``plot`` extra; checked when the callback is made).
        trace: write the Chrome trace.

    Example:
        >>> Trainer(strategy=ThreeDStrategy(pp=2, micro_batches=8),
        ...         callbacks=[PipelineTimeline(out_dir="timeline", every_n_steps=100)])  # doctest: +SKIP
    """

    def __init__(
        self,
        out_dir: str | Path = "timeline",
        first_step: int = 1,
        every_n_steps: int | None = None,
        max_profiles: int | None = None,
        gantt: bool = True,
        trace: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"PipelineTimeline: every_n_steps must be >= 1 or None, got {every_n_steps}.")
        if gantt and not matplotlib_available():
            raise ImportError(MATPLOTLIB_MISSING)
        self.out_dir = Path(out_dir)
        self.first_step = first_step
        self.every_n_steps = every_n_steps
        self.max_profiles = max_profiles
        self.gantt = gantt
        self.trace = trace
        self.summaries: list[dict[str, Any]] = []
        self.files: list[Path] = []
        self._recorder = ScheduleRecorder()
        self._observer = RecordingObserver(self._recorder)
        self._active: tuple[Any, int] | None = None  # (runtime observed, global step)
        self._profiled_steps: set[int] = set()

    def _wanted(self, step: int) -> bool:
        if step in self._profiled_steps or step < self.first_step:
            return False
        if self.max_profiles is not None and len(self._profiled_steps) >= self.max_profiles:
            return False
        if self.every_n_steps is None:
            return step == self.first_step
        return (step - self.first_step) % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Observe the pipeline runtime during this step if it is one to profile."""
        step = trainer.global_step
        if not self._wanted(step):
            return
        runner = getattr(trainer.strategy, "runner", None)
        if runner is None:
            raise RuntimeError("PipelineTimeline works with ThreeDStrategy (trainer.strategy.runner is missing).")
        self._recorder.clear()
        self._observer.schedule = None
        runner.runtime.add_observer(self._observer)
        self._active = (runner.runtime, step)
        self._profiled_steps.add(step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop observing, gather every rank's events and (rank 0) write the files."""
        if self._active is None:
            return
        runtime, step = self._active
        runtime.remove_observer(self._observer)
        self._active = None
        schedule, self._observer.schedule = self._observer.schedule, None
        if schedule is None:
            return
        mesh = trainer.strategy.device_mesh
        coords = {name: mesh[name].get_local_rank() for name in ("dp", "pp", "tp")}
        timelines = gather_timelines(self._recorder.timeline(schedule, coords))
        summary = bubble_stats(timelines)
        summary["global_step"] = step
        self.summaries.append(summary)
        if trainer.global_rank != 0:
            return
        stem = self.out_dir / f"timeline_step{step}"
        if self.trace:
            self.files.append(write_chrome_trace(timelines, stem.with_suffix(".json"), summary))
        if self.gantt:
            self.files.append(plot_gantt(timelines, stem.with_suffix(".png"), summary=summary))
        written = ", ".join(str(f) for f in self.files if f.stem == stem.name)
        rank_zero_info(
            f"timeline of step {step}: bubble {summary['measured']:.1%} measured vs {summary['theory']:.1%} in "
            f"theory ({summary.get('theory_source', 'formula')}); {written or 'no file asked for'}"
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Say so when there is no pipeline to record (pp = 1): the callback then records nothing."""
        settings = getattr(trainer.strategy, "settings", None)
        if getattr(settings, "pp", None) == 1:
            rank_zero_warn("PipelineTimeline: pp=1, there is no pipeline schedule to record; it records nothing.")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Never leave the runtime observed (e.g. after an exception inside a profiled step)."""
        if self._active is not None:
            self._active[0].remove_observer(self._observer)
            self._active = None
