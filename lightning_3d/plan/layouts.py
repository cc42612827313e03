"""The layouts the planner considers: (tp, pp, dp, micro-batches, micro-batch size, schedule, data-parallel mode,
activation checkpointing), and which of them ``ThreeDStrategy`` can run today.

:func:`enumerate_layouts` yields every combination the model and the cluster allow (and the search pins keep):
``tp`` within a node and dividing the heads, key-value heads, FFN width and vocabulary; ``pp * stages_per_rank`` at
most the layer count (uneven splits allowed: the time model charges the fullest stage); ``dp`` what ``tp * pp``
leave of the devices; ``micro_batches * micro_batch_size * dp`` = the global batch; each schedule's minimum
micro-batch count. :func:`enumeration_problems` says why nothing came out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from .cluster import ClusterSpec
from .model import ModelSpec

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved1f1b", "interleavedzerobubble", "zbvzerobubble")
"""Schedule names (torch's). Interleaved and zero-bubble ones place two stages on each rank; the interleaved
zero-bubble one is also considered over one stage per rank (ZB-H1: 1F1B's placement, split backwards)."""
MULTI_STAGE: frozenset[str] = frozenset({"interleaved1f1b", "interleavedzerobubble", "zbvzerobubble"})
#: Stages per rank considered for each schedule (two for the multi-stage ones; ZB-H1 too).
STAGE_COUNTS: dict[str, tuple[int, ...]] = {"interleavedzerobubble": (2, 1)}
ZERO_BUBBLE: frozenset[str] = frozenset({"interleavedzerobubble", "zbvzerobubble"})
DATA_PARALLEL: tuple[str, ...] = ("replicate", "fsdp")
ACTIVATION_CHECKPOINTING: tuple[str, ...] = ("none", "full")
MICRO_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Layout:
    """One way to run a training step.

    Attributes:
        tp: tensor-parallel degree.
        pp: pipeline ranks.
        dp: data-parallel replicas.
        micro_batches: micro-batches per step and replica.
        micro_batch_size: samples per micro-batch.
        schedule: pipeline schedule (``"1f1b"`` also for pp = 1: no pipeline).
        stages_per_rank: stages per pipeline rank (2 for interleaved and zero-bubble schedules; 1 or 2 for
            ``"interleavedzerobubble"``).
        data_parallel: ``"replicate"`` (DDP) or ``"fsdp"`` (parameters, gradients and optimizer states sharded).
        activation_checkpointing: ``"none"`` or ``"full"`` (each block's input kept, the block recomputed).
    """

    tp: int
    pp: int
    dp: int
    micro_batches: int
    micro_batch_size: int
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    data_parallel: str = "replicate"
    activation_checkpointing: str = "none"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def replica_batch(self) -> int:
        """Samples per step and replica (``micro_batches * micro_batch_size``)."""
        return self.micro_batches * self.micro_batch_size

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def short(self) -> str:
        """``tp2 pp4 dp8 m16x2 1f1b`` (and fsdp / ac when used)."""
        text = f"tp{self.tp} pp{self.pp} dp{self.dp} m{self.micro_batches}x{self.micro_batch_size}"
        one = self.schedule in MULTI_STAGE and self.stages_per_rank == 1  # ZB-H1: named as the benchmarks name it
        text += f" {self.schedule}{':1' if one else ''}" if self.pp > 1 else ""
        text += " fsdp" if self.data_parallel == "fsdp" else ""
        text += " ac" if self.activation_checkpointing == "full" else ""
        return text


@dataclass(frozen=True)
class Search:
    """Pins of the search space: ``None`` means every value, a list keeps only those (``search.tp=[8]``)."""

    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    dp: Sequence[int] | None = None
    micro_batches: Sequence[int] | None = None
    micro_batch_size: Sequence[int] | None = None
    schedule: Sequence[str] | None = None
    data_parallel: Sequence[str] | None = None
    activation_checkpointing: Sequence[str] | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("schedule", SCHEDULES),
            ("data_parallel", DATA_PARALLEL),
            ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
        ):
            values = getattr(self, name)
            if values is not None and (bad := [v for v in values if v not in allowed]):
                raise ValueError(f"plan: search.{name} has {bad}; choose from {list(allowed)}.")

    def keeps(self, name: str, value: object) -> bool:
        values = getattr(self, name)
        return values is None or value in values

    def unpinned(self, name: str) -> Search:
        """The same search with dimension ``name`` free."""
        return Search(**{**{k: getattr(self, k) for k in self.__dataclass_fields__}, name: None})


@dataclass
class Rejections:
    """Why candidate layouts were dropped, counted by reason (for messages when nothing is left)."""

    counts: Counter[str] = field(default_factory=Counter)
    shapes: int = 0  # (tp, pp, dp) triples that passed the structural checks

    def add(self, reason: str) -> None:
        self.counts[reason] += 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_problem(model: ModelSpec, cluster: ClusterSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard this model on this cluster (None when it can)."""
    if tp > cluster.gpus_per_node:
        return f"tp > {cluster.gpus_per_node} devices per node"
    for label, size in (
        ("heads", model.n_head),
        ("kv heads", model.n_kv_head),
        ("ffn", model.ffn),
        ("vocab", model.vocab),
    ):
        if size % tp:
            return f"tp does not divide the {label} ({size})"
    return None


def min_micro_batches(schedule: str, pp: int) -> int:
    """Fewest micro-batches the schedule takes (torch's rules: one per stage in flight except GPipe)."""
    return 1 if schedule == "gpipe" or pp == 1 else pp


def enumerate_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    search: Search | None = None,
    rejections: Rejections | None = None,
) -> Iterator[Layout]:
    """Every layout of ``model`` on all of ``cluster``'s devices for ``global_batch`` samples per step.

    Args:
        model: the model's shape.
        cluster: the devices (all are used: ``tp * pp * dp`` = ``cluster.world``).
        global_batch: samples per optimizer step.
        search: pins; None for the whole space.
        rejections: filled with the reasons candidates were dropped.

    Yields:
        Layouts, in no particular order.
    """
    search = search or Search()
    rejections = rejections if rejections is not None else Rejections()
    world = cluster.world
    for tp in divisors(world):
        if not search.keeps("tp", tp):
            continue
        if problem := tp_problem(model, cluster, tp):
            rejections.add(problem)
            continue
        for pp in divisors(world // tp):
            if not search.keeps("pp", pp):
                continue
            if pp > model.n_layer:
                rejections.add("pp > layers")
                continue
            dp = world // (tp * pp)
            if not search.keeps("dp", dp):
                continue
            rejections.shapes += 1
            if global_batch % dp:
                rejections.add("dp does not divide the global batch")
                continue
            replica = global_batch // dp
            yield from _inner(model, tp, pp, dp, replica, search, rejections)


def _inner(
    model: ModelSpec, tp: int, pp: int, dp: int, replica: int, search: Search, rejections: Rejections
) -> Iterator[Layout]:
    schedules = ("1f1b",) if pp == 1 else SCHEDULES
    for mbs in MICRO_BATCH_SIZES:
        if replica % mbs or not search.keeps("micro_batch_size", mbs):
            continue
        m = replica // mbs
        if not search.keeps("micro_batches", m):
            continue
        for schedule in schedules:
            if not search.keeps("schedule", schedule) and pp > 1:
                continue
            if m < min_micro_batches(schedule, pp):
                rejections.add(f"micro_batches < {schedule}'s minimum")
                continue
            for v in STAGE_COUNTS.get(schedule, (2 if schedule in MULTI_STAGE else 1,)):
                if v > 1 and (m % pp or pp * v > model.n_layer):
                    rejections.add(f"{schedule} needs micro_batches % pp == 0 and 2 pp <= layers")
                    continue
                if schedule in MULTI_STAGE and m % max(1, m // pp):  # torch's rounds of m // pp (one stage per rank)
                    rejections.add(f"{schedule} needs whole rounds of micro_batches // pp")
                    continue
                for data_parallel in DATA_PARALLEL:
                    if not search.keeps("data_parallel", data_parallel) or (data_parallel == "fsdp" and dp == 1):
                        continue
                    for ac in ACTIVATION_CHECKPOINTING:
                        if search.keeps("activation_checkpointing", ac):
                            yield Layout(tp, pp, dp, m, mbs, schedule, v, data_parallel, ac)


def unsupported_reason(layout: Layout, features: frozenset[str]) -> str | None:
    """Why ``ThreeDStrategy`` cannot run ``layout`` yet (None when it can); ``features`` are the settings it has."""
    if layout.schedule in ZERO_BUBBLE and layout.pp > 1 and f"schedule:{layout.schedule}" not in features:
        return f"ThreeDStrategy does not run schedule {layout.schedule!r} yet"
    if layout.data_parallel == "fsdp" and "data_parallel" not in features:
        return "ThreeDStrategy has no FSDP (sharded) data parallelism yet"
    if layout.activation_checkpointing == "full" and "activation_checkpointing" not in features:
        return "ThreeDStrategy has no activation checkpointing setting yet"
    return None
