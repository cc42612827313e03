"""Pipeline stages and schedules: the rank's stage holder over ``torch.distributed.pipelining``.

A rank holds one or more stages (one for 1F1B and GPipe; several for interleaved schedules). For each
distinct micro-batch shape (training batches, a short last batch, validation batches of another size) a
``PipelineStage`` and a schedule are created once and cached, because a stage allocates its receive
buffers from the first micro-batch it sees.

Schedules, by name: ``"1f1b"`` (default; warm-up of p - 1 - stage forwards, then one forward / one backward
in steady state, then a cool-down of the remaining backwards), ``"gpipe"`` (all forwards, then all
backwards), and torch's multi-stage schedules when a rank holds several stages: ``"interleaved1f1b"``,
``"loopedbfs"``, ``"interleavedzerobubble"`` (ZB1P: backward split into input-gradient ``I`` and deferred
weight-gradient ``W`` actions that fill the bubble; with one stage per rank too, ZB-H1) and the V schedules
``"zbvzerobubble"`` and ``"dualpipev"``
(exactly two stages per rank, placed in a V: stage ``i`` and stage ``2p - 1 - i`` on pp rank ``i``, so the first
and the last stage share rank 0). :func:`stage_ranks` is the placement every part of the project uses.
Evaluation always runs forward-only, breadth-first order over the same placement: with no backward there is
nothing to interleave.

A schedule may also be a CSV action list (``schedule="path/to/actions.csv"``, see ``csv_schedule.py``): torch's
``_PipelineScheduleRuntime`` runs it, the file fixes the stage placement and the micro-batch count, and every
function here answers for it from the file.
"""

from __future__ import annotations

import contextlib
import csv
import os
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from . import torch_compat
from .csv_schedule import is_csv_schedule, read_csv_schedule
from .fsdp import RESHARD_AFTER_BACKWARD_ATTR, reshard_after_eval
from .rng import BodyRandomness
from .weight_grad_store import WeightGradStage

SINGLE_STAGE_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe"}
#: Every schedule this project runs (lower-case names, as the settings accept them, case-insensitively).
RUNNABLE_SCHEDULES = (
    "1f1b",
    "gpipe",
    "interleaved1f1b",
    "loopedbfs",
    "interleavedzerobubble",
    "zbvzerobubble",
    "dualpipev",
)
#: Schedules that place exactly two stages per rank in a V (stage i and 2p - 1 - i on rank i).
V_SCHEDULES = frozenset({"zbvzerobubble", "dualpipev"})
#: Schedules that split each backward into an input-gradient and a deferred weight-gradient action.
ZERO_BUBBLE_SCHEDULES = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev"})
#: Multi-stage schedules that also run with one stage per rank: torch's interleaved zero-bubble schedule then splits
#: 1F1B's backwards into ``I`` and ``W`` (ZB-H1 of Qi et al.: bubble ``(p - 1) / (3 m + p - 1)`` in its action list,
#: ``pp`` micro-batches in flight on every rank, against 1F1B's ``pp - rank``).
ONE_STAGE_PER_RANK_TOO = frozenset({"interleavedzerobubble"})
#: Schedules that run micro-batches in rounds of ``max(1, m // pp)`` and need ``m`` divisible by the round count.
_ROUND_SCHEDULES = frozenset({"interleaved1f1b", "interleavedzerobubble"})


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` (a name or a CSV action list) runs each backward as an input-gradient and a later
    weight-gradient action."""
    if is_csv_schedule(name):
        return read_csv_schedule(name).split_backward
    return name.lower() in ZERO_BUBBLE_SCHEDULES


def schedule_class(name: str) -> type:
    """The torch schedule class for a (case-insensitive) name such as ``"1f1b"`` or ``"interleaved1f1b"`` (a
    CSV action list: a ``PipelineScheduleMulti``, torch's runtime for action lists)."""
    if is_csv_schedule(name):
        return PipelineScheduleMulti
    return get_schedule_class(SINGLE_STAGE_SCHEDULES.get(name.lower(), name))


def check_schedule_name(name: str) -> None:
    """Raise ``ValueError`` (with the list of names) unless the project runs the schedule ``name``.

    torch's own list has base classes (``PipelineScheduleSingle`` / ``PipelineScheduleMulti``) that are not
    schedules: those are refused too.
    """
    runnable = (
        f"The schedules lightning_3d runs are {', '.join(repr(n) for n in RUNNABLE_SCHEDULES)} (case-insensitive)."
    )
    if not isinstance(name, str):
        raise ValueError(f"ThreeDStrategy(schedule={name!r}): a schedule is a name. {runnable}")
    if is_csv_schedule(name):
        read_csv_schedule(name)  # a missing or invalid file fails here, saying why
        return
    try:
        schedule_class(name)
    except ValueError as unknown:  # torch's message names torch's list
        raise ValueError(f"ThreeDStrategy(schedule={name!r}): {unknown}. {runnable}") from None
    if name.lower() not in RUNNABLE_SCHEDULES:
        raise ValueError(f"ThreeDStrategy(schedule={name!r}) is a base class in torch, not a schedule. {runnable}")


def is_multi_stage(name: str) -> bool:
    return issubclass(schedule_class(name), PipelineScheduleMulti)


def is_v_schedule(name: str) -> bool:
    """Whether the schedule places its stages in a V (two per rank, the first and the last stage on rank 0)."""
    return name.lower() in V_SCHEDULES


def stage_ranks(name: str, pp: int, stages_per_rank: int) -> list[int]:
    """The pp rank of every stage under the schedule ``name``: ``[rank of stage 0, rank of stage 1, ...]``.

    Looping placement (stage ``s`` on rank ``s % pp``) for every schedule but the V schedules, where the stages
    go down the ranks and back up: with ``pp = 2``, stages 0, 1, 2, 3 sit on ranks 0, 1, 1, 0. This is torch's
    own placement for these schedules (``generate_stage_to_rank_mapping``), which the schedules' action lists
    assume; the model is split the same way so each rank holds the layers of the stages it runs.
    """
    if is_csv_schedule(name):  # the file's placement (the settings check that it fits pp and stages_per_rank)
        return list(read_csv_schedule(name).placement)
    num_stages = pp * stages_per_rank
    if not is_v_schedule(name):
        return [s % pp for s in range(num_stages)]
    return [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(num_stages)]


def min_micro_batches(name: str, pp: int) -> int:
    """Fewest micro-batches a schedule accepts: 1F1B-style schedules need one per stage in flight, V schedules
    one per stage (``2 * pp``: two stages per rank); a CSV action list exactly its own count."""
    if is_csv_schedule(name):
        return read_csv_schedule(name).micro_batches
    if schedule_class(name) is ScheduleGPipe:
        return 1
    return 2 * pp if is_v_schedule(name) else pp


def micro_batch_problem(name: str, pp: int, micro_batches: int) -> str | None:
    """Why schedule ``name`` cannot run ``micro_batches`` micro-batches at this ``pp`` (``None``: it can).

    Besides the minimum (:func:`min_micro_batches`), the interleaved schedules run micro-batches in rounds of
    ``max(1, m // pp)`` and need ``m`` divisible by the number of rounds (torch raises in the first step
    otherwise).
    """
    if is_csv_schedule(name):
        fixed = read_csv_schedule(name).micro_batches
        if micro_batches != fixed:
            return (
                f"micro_batches={micro_batches} under schedule={name!r}: the action list runs exactly {fixed} "
                f"micro-batches per batch"
            )
        return None
    minimum = min_micro_batches(name, pp)
    if micro_batches < minimum:
        if is_v_schedule(name):
            return (
                f"micro_batches={micro_batches} < 2 * pp = {minimum} under schedule={name!r}: a V schedule runs two "
                f"stages per rank and keeps one micro-batch in flight per stage, so it needs micro_batches >= {minimum}"
            )
        return (
            f"micro_batches={micro_batches} < pp={pp} under schedule={name!r}: that schedule keeps one micro-batch "
            f"in flight per stage, so it needs micro_batches >= {minimum}"
        )
    rounds = max(1, micro_batches // pp)
    if name.lower() in _ROUND_SCHEDULES and micro_batches % rounds != 0:
        return (
            f"micro_batches={micro_batches} under schedule={name!r} at pp={pp}: that schedule runs micro-batches in "
            f"{rounds} rounds (micro_batches // pp) and needs micro_batches divisible by them"
        )
    return None


def schedule_actions(name: str, pp: int, stages_per_rank: int, micro_batches: int) -> dict[int, list[Any]] | None:
    """The compute action list of a multi-stage schedule (torch's) or of a CSV file, per pp rank: ``{rank:
    [action or None per time slot]}``; ``None`` for the single-stage schedules (1F1B, GPipe), which have none.

    torch computes a multi-stage schedule's list for every rank when the schedule is built; it is built here over
    stand-in stages (no process group, no model). The gradient-reduction actions torch adds are left out.
    """
    if is_csv_schedule(name):
        return torch_compat.parse_schedule_actions(read_csv_schedule(name).rows)
    if not is_multi_stage(name):
        return None
    placement = stage_ranks(name, pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    stand_ins = [
        types.SimpleNamespace(
            num_stages=num_stages,
            group_size=pp,
            group_rank=0,
            stage_index=s,
            is_first=s == 0,
            is_last=s == num_stages - 1,
            submod=nn.Identity(),
            stage_index_to_group_rank={},
        )
        for s in range(num_stages)
        if placement[s] == 0
    ]
    order = schedule_class(name)(stand_ins, micro_batches).pipeline_order
    return {rank: [a for a in order[rank] if a is None or torch_compat.is_compute_action(a)] for rank in range(pp)}


def held_micro_batches(actions: Sequence[Any], stage: int) -> tuple[int, int]:
    """From one rank's action list, the most micro-batches of ``stage`` whose activations are held at once, and
    the most held only for their weight gradient.

    A micro-batch is held from its forward ``F`` until its backward is complete: a full ``B``, or the ``W`` after
    its ``I`` (torch's input-gradient backward keeps the graph for the weight-gradient one). The second count is
    the most whose ``I`` has run but not yet their ``W``. An overlapped forward-backward (DualPipeV's
    ``OVERLAP_F_B``) counts as its parts, in order.
    """
    live = deferred = peak = peak_deferred = 0
    flat: list[Any] = []
    for action in actions:
        flat.extend(torch_compat.action_parts(action))
    for action in flat:
        if action is None or getattr(action, "stage_index", None) != stage:
            continue
        kind = torch_compat.action_kind(action)
        if kind == "F":
            live += 1
        elif kind == "B":
            live -= 1
        elif kind == "I":
            deferred += 1
        elif kind == "W":
            live -= 1
            deferred -= 1
        peak, peak_deferred = max(peak, live), max(peak_deferred, deferred)
    return peak, peak_deferred


def activations_in_flight(name: str, pp: int, stages_per_rank: int, micro_batches: int) -> list[int]:
    """Per stage, the most micro-batches whose activations the schedule holds at once during a training step.

    1F1B: ``min(p - s, m)`` on stage ``s`` of ``p`` (its warm-up forwards plus one); GPipe: all ``m``; a
    multi-stage schedule or a CSV file: counted on its action list (:func:`held_micro_batches`).
    """
    num_stages = pp * stages_per_rank
    order = schedule_actions(name, pp, stages_per_rank, micro_batches)
    if order is None:
        if name.lower() == "gpipe":
            return [micro_batches] * num_stages
        return [min(num_stages - s, micro_batches) for s in range(num_stages)]
    placement = stage_ranks(name, pp, stages_per_rank)
    return [held_micro_batches(order[placement[s]], s)[0] for s in range(num_stages)]


def write_csv_schedule(name: str, pp: int, stages_per_rank: int, micro_batches: int, path: str | os.PathLike) -> Path:
    """Write the compute action list of torch's multi-stage schedule ``name`` (``"interleaved1f1b"``,
    ``"interleavedzerobubble"``, ``"zbvzerobubble"``, ...) at this shape to ``path``: a known-good CSV schedule
    (torch's lowering adds the gradient-reduction actions back when the file is loaded).
    """
    if is_csv_schedule(name) or not is_multi_stage(name):
        raise ValueError(f"write_csv_schedule: {name!r} is not a multi-stage schedule.")
    order = schedule_actions(name, pp, stages_per_rank, micro_batches)
    assert order is not None
    rows = [["" if a is None else str(a) for a in order[rank]] for rank in range(pp)]
    out = Path(path)
    with open(out, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return out


@contextlib.contextmanager
def cast_cache(enabled: bool, device: torch.device) -> Iterator[None]:
    """Inside a stage's forward under mixed precision: let autocast keep its low-precision copy of each weight.

    Lightning's precision plugin runs the step under ``torch.autocast(..., cache_enabled=False)``, so every
    micro-batch's forward would cast every weight again (``m`` casts of the whole stage per step, where a
    hand-written loop under one caching autocast casts once). Here the stage's forwards run with the cache on, so
    the first micro-batch's casts serve the others. Only casts made inside these windows are cached, and torch
    caches none made under ``no_grad`` (user code in the window that runs a weight under ``no_grad`` cannot leave a
    copy without ``grad_fn`` behind: ``tests/unit/test_pipeline_casts.py`` pins it); the runner clears the cache
    when the batch ends (``torch.clear_autocast_cache``), before the optimizer changes the weights. Nothing happens when
    ``enabled`` is false (FSDP, whose gathered weights must not outlive their unit; split backward schedules),
    gradients are off, or autocast is not on for this device type."""
    kind = device.type
    if not (enabled and torch.is_grad_enabled() and torch.is_autocast_enabled(kind)):
        yield
        return
    with torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), cache_enabled=True):
        yield


class _Stage(WeightGradStage):
    """A ``PipelineStage`` that can defer its data-parallel gradient all-reduce (and, under a split backward,
    its linear layers' weight gradients: ``weight_grad_store.py``).

    Under gradient accumulation the gradients of every batch but the last of an accumulation window stay
    local (``defer_grad_sync``), so data parallelism all-reduces once per optimizer step, as Lightning's DDP
    does with ``no_sync``. The stage still runs its end-of-step bookkeeping (``replicate``/FSDP post-backward,
    which puts the parameters back in their sharded form and keeps the gradients accumulating), only with
    gradient sync switched off. In the batch that syncs, the last micro-batch's backward runs with sync on, so
    each ``replicate`` group (a gradient bucket, see ``data_parallel.py``) is all-reduced as soon as its
    gradients are ready, during that backward.

    FSDP stages marked by ``fsdp_reshard_after_backward`` (``fsdp.RESHARD_AFTER_BACKWARD_ATTR``) run ZeRO-3 under
    micro-batches instead: every full backward reshards each unit after its backward and reduce-scatters its
    gradients there (the sharded gradients accumulate over micro-batches and accumulation batches), deferred or
    not, so a unit is gathered, with its unsharded gradients, only while its own backward runs. HSDP's all-reduce
    across the replicas is held back (FSDP2 sums the reduced shards meanwhile) until the optimizer step's last
    backward, so it still runs once per unit and optimizer step.
    """

    defer_grad_sync: bool = False
    randomness: BodyRandomness | None = None
    # Told which micro-batch each forward belongs to (stages that run the user's step, see stage_exec.py).
    on_chunk: Callable[[int, int | None], None] | None = None

    # Keep autocast's casts of the weights for the rest of the batch (see ``cast_cache``).
    cache_casts: bool = False

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.on_chunk is not None:
            self.on_chunk(self.stage_index, fwd_chunk_id)
        with cast_cache(self.cache_casts, self.device):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def shape_inference_context(self) -> contextlib.AbstractContextManager[Any]:
        # torch's shape inference runs a real forward (under a forked default generator); the body's own
        # random streams must not advance either, or a rebuilt schedule (after a resume) would shift them.
        if self.on_chunk is not None:
            self.on_chunk(self.stage_index, None)  # no chunk: a shape-inference forward
        if self.randomness is None:
            return contextlib.nullcontext()
        return self.randomness.frozen()

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        module = self.submod
        if getattr(module, RESHARD_AFTER_BACKWARD_ATTR, False) and isinstance(module, FSDPModule):
            # ZeRO-3: reshard and reduce-scatter after every micro-batch's backward (the settings refuse split
            # backwards); HSDP all-reduces across replicas on the optimizer step's last backward only. Every
            # backward is FSDP2's "last" one, so its final callback also waits for and frees the reduce-scatter
            # buffer it keeps in flight (one unit's flat gradients), which would otherwise live through the next
            # micro-batch's forward; that callback also drops the forward order backward prefetch reads, which this
            # mode turns off (fsdp.no_backward_prefetch).
            final = last_backward and not self.defer_grad_sync
            with _forced(module, "set_reshard_after_backward", True), _forced(module, "set_is_last_backward", True):
                with _forced_sync(module, all_reduce=final):
                    return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if not (last_backward and backward_type == "full" and not self.defer_grad_sync):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if not (isinstance(module, FSDPModule) and torch_compat.is_replicated(module)):
            # fully_shard (data_parallel="fsdp") keeps torch's path: resharding after this backward would make its
            # backward prefetch gather a unit again (one more all-gather per step)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # The optimizer step's last backward: torch turns gradient sync off for every micro-batch and reduces
        # after the last one; keep it on for this backward instead, so each replicate group (bucket) all-reduces
        # its gradients as soon as autograd has produced them, while the backward of earlier blocks still runs
        # (torch's perform_reduce_grad afterwards finds nothing left to reduce). A split backward (input and
        # weight gradients apart) keeps torch's behaviour: the weights' gradients would come after the hook.
        with _forced(module, "set_is_last_backward", True), _forced(module, "set_reshard_after_backward", True):
            with _forced(module, "set_requires_gradient_sync", True):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        module = self.submod
        if not (self.defer_grad_sync and isinstance(module, FSDPModule)):
            super().perform_reduce_grad(grad_scale_factor)
            return
        # torch's implementation turns gradient sync on before its post-backward; keep it off instead.
        with _forced(module, "set_requires_gradient_sync", False):
            super().perform_reduce_grad(grad_scale_factor)


@contextlib.contextmanager
def _forced(module: nn.Module, setter: str, value: bool) -> Iterator[None]:
    """While inside, every call of ``module.<setter>(...)`` (an FSDPModule flag setter) sets ``value`` instead."""
    real = getattr(module, setter)
    module.__dict__[setter] = lambda _requested, **kw: real(value, **kw)
    try:
        yield
    finally:
        module.__dict__.pop(setter, None)


@contextlib.contextmanager
def _forced_sync(module: FSDPModule, *, all_reduce: bool) -> Iterator[None]:
    """While inside, ``module.set_requires_gradient_sync(...)`` turns the reduce-scatter on, and HSDP's all-reduce
    across the replicas to ``all_reduce`` (FSDP2 accumulates the reduced shards until an all-reducing backward)."""
    real = module.set_requires_gradient_sync

    def sync(_requested: bool, **kw: Any) -> None:
        real(True, **kw)
        module.set_requires_all_reduce(all_reduce, **kw)

    module.__dict__["set_requires_gradient_sync"] = sync
    try:
        yield
    finally:
        module.__dict__.pop("set_requires_gradient_sync", None)


class RuntimeObserver(Protocol):
    """Sees every batch a :class:`PipelineRuntime` runs (opt-in tools such as the pipeline timeline).

    ``before_batch`` runs right before the schedule's ``step`` (or ``eval``), ``after_batch`` right after it,
    also when it raised; ``after_batch`` runs only for observers whose ``before_batch`` returned.
    """

    def before_batch(self, schedule: Any, train: bool) -> None:
        """Called with the torch schedule about to run the batch (the same object for every batch of a shape)."""

    def after_batch(self, schedule: Any, train: bool) -> None:
        """Called when that schedule's ``step``/``eval`` has returned or raised."""


@dataclass(frozen=True)
class StageSpec:
    """One stage this rank runs: its global index and its module (tensor- and data-parallel already)."""

    index: int
    module: nn.Module


class PipelineRuntime:
    """Runs whole batches through this rank's stages with a cached schedule per micro-batch shape.

    ``schedule`` returns the schedule for a micro-batch count, batch shape, mode and schedule name (built on
    first use); ``run`` runs one batch through it, and ``current`` is that schedule while it runs.
    ``defer_grad_sync`` (set by the caller per batch) keeps the data-parallel gradients of a training batch
    local (not the last batch of an accumulation window); the next batch that syncs all-reduces what has
    accumulated, and ``flush_deferred_grads`` does it first when a new schedule must be built (torch's shape
    inference would clear the gradients).

    Args:
        stages: the stages this rank holds, in increasing index order.
        num_stages: total number of stages in the pipeline.
        group: the pipeline process group (the pp sub-mesh's group; ``None``: the default group).
        device: the device of this rank.
        schedule: schedule name for training; evaluation runs forward-only GPipe order (``loopedbfs`` when the
            rank holds several stages), and so does training under ``"gpipe"`` with several local stages.
        loss_fn: called by the last stage as ``loss_fn(output, target)`` for every micro-batch, training and
            evaluation alike.
        cache_size: how many schedules to keep (keyed by micro-batch count, batch shape, mode and schedule name;
            the least recently used goes first).
        randomness: the stages' random streams (frozen during torch's shape inference).
    """

    def __init__(
        self,
        stages: Sequence[StageSpec],
        num_stages: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        schedule: str,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        cache_size: int = 8,
        randomness: BodyRandomness | None = None,
        on_chunk: Callable[[int, int | None], None] | None = None,
    ) -> None:
        self.on_chunk = on_chunk
        self.stages = list(stages)
        self.randomness = randomness
        self.num_stages = num_stages
        self.group = group
        self.group_size = num_stages // max(1, len(self.stages))  # pp: every rank holds as many stages
        self.device = device
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self.current: Any = None
        self._sync_pending = False
        self._observers: list[RuntimeObserver] = []

    def add_observer(self, observer: RuntimeObserver) -> None:
        """Call ``observer`` around every batch from now on (see :class:`RuntimeObserver`)."""
        self._observers.append(observer)

    def remove_observer(self, observer: RuntimeObserver) -> None:
        """Stop calling ``observer`` (nothing happens when it is not registered)."""
        self._observers = [o for o in self._observers if o is not observer]

    @property
    def observers(self) -> tuple[RuntimeObserver, ...]:
        """The registered observers, in the order they are called before a batch."""
        return tuple(self._observers)

    @property
    def has_first(self) -> bool:
        return self.stages[0].index == 0

    @property
    def has_last(self) -> bool:
        return self.stages[-1].index == self.num_stages - 1

    def _build(self, n_micro: int, train: bool, name: str) -> Any:
        csv_train = train and is_csv_schedule(name)
        cls = schedule_class(name) if train and not csv_train else ScheduleGPipe
        if len(self.stages) > 1 and not csv_train and (cls is ScheduleGPipe or not train):
            # forward-only or fill-drain order over several local stages, placed as the configured schedule places
            # them (a V schedule's or a CSV schedule's batch that falls back to GPipe, or its evaluation, keeps its
            # placement)
            placement = stage_ranks(self.schedule_name, self.group_size, len(self.stages))
            if placement != [s % self.group_size for s in range(self.num_stages)]:
                cls = torch_compat.looped_bfs_placed(placement, backward=train)
            else:
                cls = schedule_class("loopedbfs")
        built = [_Stage(s.module, s.index, self.num_stages, self.device, group=self.group) for s in self.stages]
        # A split backward (zero-bubble, or a CSV schedule's I/W actions) tracks each micro-batch's autograd
        # nodes apart, which a weight cast shared by all micro-batches would join; FSDP's gathered weights must not
        # be kept in low precision for the whole batch.
        cache_casts = train and not csv_train and name not in ZERO_BUBBLE_SCHEDULES and not self._fsdp_sharded()
        for stage in built:
            stage.randomness = self.randomness
            stage.on_chunk = self.on_chunk
            stage.cache_casts = cache_casts
        kwargs = {"loss_fn": self.loss_fn, "scale_grads": False}
        if csv_train:
            return torch_compat.csv_schedule(built, n_micro, read_csv_schedule(name).path, **kwargs)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(built[0], n_micro, **kwargs)
        return cls(built, n_micro, **kwargs)

    def _fsdp_sharded(self) -> bool:
        """Whether a module of this rank's stages is sharded by ``fully_shard`` (not merely ``replicate``)."""
        return any(
            isinstance(m, FSDPModule) and not torch_compat.is_replicated(m)
            for s in self.stages
            for m in s.module.modules()
        )

    def schedule(self, n_micro: int, shape_key: tuple, train: bool, name: str | None = None) -> Any:
        """The cached schedule for this micro-batch count, batch shape and mode (built on first use)."""
        name = name or self.schedule_name
        key = (n_micro, shape_key, train, name)
        sched = self._cache.get(key)
        if sched is None:
            if self._sync_pending:
                # A new stage runs torch's shape inference, which clears the module's gradients: reduce the
                # gradients held back so far first (the caller has moved them aside).
                self.flush_deferred_grads()
            sched = self._build(n_micro, train, name)
            self._cache[key] = sched
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return sched

    def run(
        self,
        body_input: torch.Tensor | None,
        target: torch.Tensor,
        n_micro: int,
        shape_key: tuple,
        train: bool,
        schedule: str | None = None,
        defer_grad_sync: bool = False,
    ) -> None:
        """Run one batch: forward (and backward when ``train``) of ``n_micro`` micro-batches.

        Args:
            body_input: the body's input for the whole batch (read on the rank holding stage 0).
            target: passed to ``loss_fn`` on the last stage, split on dim 0 like the input.
            n_micro: number of micro-batches.
            shape_key: identifies the micro-batch shapes (a new key builds new stages).
            train: forward and backward, or forward only.
            schedule: schedule name for this batch (default: the runtime's).
            defer_grad_sync: keep the data-parallel gradient reduction for a later batch (accumulation).
        """
        sched = self.schedule(n_micro, shape_key, train, schedule)
        defer = defer_grad_sync and train
        for stage in _stages_of(sched):
            stage.defer_grad_sync = defer
        args = (body_input,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": target} if self.has_last else {}
        self.current = sched
        try:
            with contextlib.ExitStack() as observing:
                for observer in list(self._observers):
                    observer.before_batch(sched, train)
                    observing.callback(observer.after_batch, sched, train)
                if train:
                    torch_compat.schedule_step(sched, *args, **kwargs)
                else:
                    sched.eval(*args, **kwargs)
        finally:
            self.current = None
            if any(stage.cache_casts for stage in _stages_of(sched)):
                torch.clear_autocast_cache()  # the weights change before the next batch; a caller's own autocast stays
        if train:
            self._sync_pending = defer
        else:  # FSDP: an evaluation forward gathered the parameters (not resharded under a pipeline)
            reshard_after_eval(s.module for s in self.stages)

    def current_initialised(self) -> bool:
        """Whether the running schedule has finished torch's shape inference (its dummy loss call).

        ``True`` when no schedule is running. Raises ``torch_compat.TorchCompatError`` when the installed
        torch no longer exposes the flag (never guesses: see ``torch_compat.shape_inference_done``).
        """
        if self.current is None:
            return True
        return torch_compat.shape_inference_done(self.current)

    def flush_deferred_grads(self) -> None:
        """All-reduce the gradients held back by ``defer_grad_sync`` (one all-reduce per gradient bucket)."""
        done: set[int] = set()
        for sched in self._cache.values():
            for stage in _stages_of(sched):
                if stage.stage_index not in done:
                    done.add(stage.stage_index)
                    PipelineStage.perform_reduce_grad(stage, 1)
        self._sync_pending = False


def _stages_of(sched: Any) -> list[_Stage]:
    return torch_compat.schedule_stages(sched)  # type: ignore[return-value]  # built by PipelineRuntime._build
