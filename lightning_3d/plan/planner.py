"""Rank the layouts of a model on a cluster: enumerate, drop what does not fit, predict, sort, explain.

:func:`plan` returns a :class:`Plan`: the ranked :class:`Entry` list (fastest predicted step first), and when
nothing is left, a :class:`NoLayout` error says why and what would help (the memory per device the smallest layout
needs and the knob that lowers it most; the nearest global batch sizes some layout divides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .cluster import ClusterSpec
from .layouts import Layout, Rejections, Search, enumerate_layouts, unsupported_reason
from .memory import GIB, Memory, fits, layout_memory
from .model import ModelSpec
from .timing import StepTime, step_time


class NoLayout(ValueError):
    """No layout is left; the message says why and what would help."""


@dataclass(frozen=True)
class Entry:
    """One ranked layout: its memory, its predicted step and whether ``ThreeDStrategy`` runs it today."""

    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_step: int
    flops_per_step: float
    world: int
    peak_flops: float
    unsupported: str | None = None

    @property
    def step_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        """Model FLOPs (no recomputation counted) per second and device, in TFLOP/s."""
        return self.flops_per_step / self.step_s / self.world / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def runnable(self) -> bool:
        return self.unsupported is None

    def as_dict(self) -> dict[str, Any]:
        """The JSON record of the entry."""
        return {
            **self.layout.as_dict(),
            "memory_gib": round(self.memory.gib, 4),
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "runnable": self.runnable,
            "unsupported": self.unsupported,
            "memory_breakdown_gib": self.memory.as_gib(),
            "time_breakdown_s": self.time.as_dict(),
        }


@dataclass
class Plan:
    """The ranked layouts (fastest first) and how many were considered."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    entries: list[Entry]
    considered: int
    too_big: int
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Entry:
        return self.entries[0]

    def best_runnable(self) -> Entry | None:
        """The fastest layout ``ThreeDStrategy`` can run today."""
        return next((e for e in self.entries if e.runnable), None)


def strategy_features() -> frozenset[str]:
    """The settings ``ThreeDStrategy`` has (its ``ThreeDSettings`` fields, and ``schedule:NAME`` for each schedule it
    runs); empty when it cannot be imported."""
    try:
        from ..core.pipeline import RUNNABLE_SCHEDULES
        from ..settings import ThreeDSettings
    except Exception:  # the planner itself needs no torch
        return frozenset()
    schedules = {f"schedule:{name}" for name in RUNNABLE_SCHEDULES}
    return frozenset(f.name for f in dataclasses.fields(ThreeDSettings)) | schedules


def evaluate(model: ModelSpec, cluster: ClusterSpec, layout: Layout, features: frozenset[str] = frozenset()) -> Entry:
    """Memory and predicted time of one layout."""
    tokens = layout.world // (layout.tp * layout.pp) * layout.replica_batch * model.seq_len
    return Entry(
        layout=layout,
        memory=layout_memory(model, cluster, layout),
        time=step_time(model, cluster, layout),
        tokens_per_step=tokens,
        flops_per_step=model.flops_per_token() * tokens,
        world=layout.world,
        peak_flops=cluster.peak_flops,
        unsupported=unsupported_reason(layout, features),
    )


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    search: Search | None = None,
    features: frozenset[str] | None = None,
) -> Plan:
    """Rank every layout of ``model`` on ``cluster`` that fits in memory, fastest predicted step first.

    Args:
        model: the model's shape.
        cluster: the devices.
        global_batch: samples per optimizer step.
        search: pins of the search space.
        features: ``ThreeDStrategy``'s settings (for marking layouts it cannot run); None reads them.

    Returns:
        The plan (at least one entry).

    Raises:
        NoLayout: nothing fits or nothing divides, with what would help.
    """
    if global_batch < 1:
        raise NoLayout(f"plan: global_batch_size must be >= 1, got {global_batch}.")
    search = search or Search()
    features = strategy_features() if features is None else features
    rejections = Rejections()
    entries, too_big, considered = [], [], 0
    for layout in enumerate_layouts(model, cluster, global_batch, search, rejections):
        considered += 1
        entry = evaluate(model, cluster, layout, features)
        (entries if fits(entry.memory, cluster) else too_big).append(entry)
    if not considered:
        raise NoLayout(_nothing_enumerated(model, cluster, global_batch, search, rejections))
    if not entries:
        raise NoLayout(_nothing_fits(model, cluster, global_batch, search, too_big))
    entries.sort(key=lambda e: (e.step_s, e.memory.total, 0 if e.runnable else 1))
    return Plan(model, cluster, global_batch, entries, considered, len(too_big))


# ---------------------------------------------------------------------------------------------- bad input
def nearest_batches(model: ModelSpec, cluster: ClusterSpec, global_batch: int, search: Search) -> list[int]:
    """The nearest global batch sizes below and above ``global_batch`` that some layout divides."""
    found: list[int] = []
    for step in (-1, 1):
        b = global_batch + step
        while 1 <= b <= 4 * global_batch + 64:
            if next(iter(enumerate_layouts(model, cluster, b, search)), None) is not None:
                found.append(b)
                break
            b += step
    return found


def _nothing_enumerated(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, search: Search, rejections: Rejections
) -> str:
    reasons = ", ".join(f"{r}: {n}" for r, n in rejections.counts.most_common()) or "the search pins exclude all"
    if rejections.shapes:
        near = nearest_batches(model, cluster, global_batch, search)
        if near:
            return (
                f"plan: no layout divides global_batch_size={global_batch} on {cluster.world} devices "
                f"(dropped: {reasons}); the nearest that work: {' and '.join(map(str, near))}."
            )
    return f"plan: no layout of {model.name} on {cluster.name} ({cluster.world} devices) passes the checks: {reasons}."


def _min_memory(entries: Iterable[Entry]) -> Entry | None:
    return min(entries, key=lambda e: e.memory.total, default=None)


def _nothing_fits(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, search: Search, too_big: list[Entry]
) -> str:
    smallest = _min_memory(too_big)
    assert smallest is not None
    need = smallest.memory.gib
    # (0: fits at this size / 1: fits with more nodes / 2: only lowers it, GiB, text)
    knobs: list[tuple[int, float, str]] = []
    for name in ("activation_checkpointing", "data_parallel", "tp", "pp", "micro_batch_size", "micro_batches"):
        if getattr(search, name) is None:
            continue
        freed = search.unpinned(name)
        best = _min_memory(
            evaluate(model, cluster, lay) for lay in enumerate_layouts(model, cluster, global_batch, freed)
        )
        if best is not None and best.memory.gib < need - 1e-9:
            rank = 0 if fits(best.memory, cluster) else 2
            knobs.append(
                (rank, best.memory.gib, f"unpin search.{name} ({best.layout.short()}: {best.memory.gib:.1f} GiB)")
            )
    nodes, first = cluster.nodes, None
    for _ in range(16):  # more nodes, doubling: the fewest at which some layout fits
        nodes *= 2
        more = dataclasses.replace(cluster, nodes=nodes)
        bigger = _min_memory(evaluate(model, more, lay) for lay in enumerate_layouts(model, more, global_batch, search))
        if bigger is None:
            break
        first = first or (nodes, bigger)
        if fits(bigger.memory, more):
            knobs.append(
                (
                    1,
                    bigger.memory.gib,
                    f"cluster.nodes={nodes}, the fewest (doubling) at which one fits "
                    f"({bigger.layout.short()}: {bigger.memory.gib:.1f} GiB)",
                )
            )
            break
    else:
        if first is not None and first[1].memory.gib < need - 1e-9:
            knobs.append(
                (
                    2,
                    first[1].memory.gib,
                    f"cluster.nodes={first[0]} ({first[1].layout.short()}: {first[1].memory.gib:.1f} GiB)",
                )
            )
    knobs.sort()
    parts = ", ".join(f"{k}: {v:.2f}" for k, v in smallest.memory.as_gib().items() if k != "total")
    text = (
        f"plan: {model.name} fits no layout on {cluster.name}: the smallest ({smallest.layout.short()}) needs "
        f"{need:.1f} GiB per device ({parts}) and a device has {cluster.memory_gib:g} GiB."
    )
    if knobs:
        text += f" What helps most: {knobs[0][2]}" + (f"; then {knobs[1][2]}" if len(knobs) > 1 else "") + "."
    else:
        text += " No single knob of the search brings it under; a larger cluster or a smaller model is needed."
    return text


def memory_needed_gib(entries: Iterable[Entry]) -> float:
    """The least memory per device among ``entries`` (GiB)."""
    best = _min_memory(entries)
    return best.memory.total / GIB if best is not None else float("nan")
