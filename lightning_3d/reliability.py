"""Reliability of a 3D job: same configuration everywhere, bounded waits, no training on non-finite numbers.

``Reliability`` is owned by ``ThreeDStrategy`` and called from a few marked places in it (``# ---- reliability``),
each call handing over what that hook needs (it never sees the strategy itself):

==========================  ======================================================================================
``on_process_group_ready``  setup timeout on every process group; a layout check (tp, pp, dp, world) BEFORE the
                            mesh is built (a mismatched mesh hangs in ``new_group``); starts the ``FailureWatch``
``check_consistency``       twice in ``_parallelize``: a hash of every ``ThreeDSettings`` field, the Trainer
                            settings and the model's tensors, compared across ranks before planning (which may
                            itself communicate: the compute partitioner's timing), then again with the plan
                            (stage split, tensor-parallel plan); on mismatch, every rank raises
                            ``ConsistencyError`` naming the keys that differ and their values on which ranks
``on_model_ready``          the module and this rank's stages, for ``after_backward``
``check_replica_batch``     the first batch of training and of each evaluation hook: the ranks of one
                            data-parallel replica (its stages and tensor-parallel shards) hold the same batch
                            (a hash of it, one all-gather); else every rank raises ``ConsistencyError``
``after_train_step``        after the first training step: a barrier, then the shorter ``train_timeout`` on every
                            process group (the mesh's sub-groups included) and on pipeline receives (gloo)
``local_flags``             per batch, inside the training step: a non-finite flag per stage and for the loss,
                            summed over all ranks in the step's one exchange (``BatchRunner.run(flags=...)``)
``after_backward``          non-finite loss or gradients, agreed by all ranks from those flags (read once per batch);
                            ``on_nonfinite="raise"``: every rank raises ``NonFiniteError`` at the same step,
                            ``"skip"``: every rank drops the gradients of that optimizer step
``on_exception``            fail fast (``failure_watch.py``)
``teardown``                stops the watch and restores the setup timeout, then a barrier (success path only)
==========================  ======================================================================================
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import math
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.tensor import DTensor

from .core import torch_compat
from .core.agreed import is_agreed, mark_agreed
from .core.grad_groups import GradGrouper, GroupKey, Groups
from .core.grad_norm import ScanNorms
from .core.parallelize import ModelPlan
from .core.partition import TensorSpec, full_model_spec
from .core.pipeline import StageSpec
from .core.topology import Topology
from .settings import ThreeDSettings, as_timedelta
from .tools.dp_check import DPConsistencyCheck, DPDivergenceError
from .tools.failure_watch import FailureWatch

log = logging.getLogger(__name__)


class ConsistencyError(ValueError):
    """The ranks of one job were started with different settings or models (raised by every rank)."""


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``on_nonfinite="raise"`` (raised by every rank at the same step)."""


# ---------------------------------------------------------------------------------------------- consistency
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _text(value: Any) -> str:
    return _ADDRESS.sub("", repr(value))


# The settings that decide the mesh: compared before the mesh is built (a mismatched mesh hangs in new_group).
LAYOUT_SETTINGS = ("tp", "pp", "dp", "stages_per_rank", "process_group_backend", "data_parallel", "dp_shard")


def _setting_text(value: Any) -> str:
    """A setting's value as text that is the same on every rank: a callable (a custom partitioner) by its
    qualified name, anything else by its ``repr`` without memory addresses."""
    if callable(value) and not isinstance(value, (str, type)):
        value = value if hasattr(value, "__qualname__") else type(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _text(value)


def settings_items(settings: ThreeDSettings, names: Iterable[str] | None = None) -> dict[str, str]:
    """``{"strategy.<name>": value text}`` for every field of ``settings`` (or the fields ``names``): a new
    setting is compared across ranks without being listed anywhere."""
    wanted = None if names is None else set(names)
    return {
        f"strategy.{f.name}": _setting_text(getattr(settings, f.name))
        for f in dataclasses.fields(settings)
        if wanted is None or f.name in wanted
    }


def layout_items(settings: ThreeDSettings, world_size: int) -> dict[str, str]:
    """The settings that decide the mesh, the world size and the process-group backend in use."""
    items = settings_items(settings, LAYOUT_SETTINGS)
    items["world_size"] = _text(world_size)
    items["process_group.backend"] = _text(dist.get_backend() if dist.is_initialized() else None)
    return items


_TRAINER_SETTINGS = (
    "accumulate_grad_batches",
    "max_steps",
    "max_epochs",
    "min_steps",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "limit_train_batches",
    "limit_val_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
)


def config_items(
    settings: ThreeDSettings,
    world_size: int,
    precision: Precision,
    module: LightningModule | None,
    model: ModelPlan | None,
) -> dict[str, str]:
    """Strategy and Trainer settings and the model's structure, as ``{key: value text}`` (same on every rank).

    Args:
        settings: the strategy's settings (every field is compared).
        world_size: processes in the job.
        precision: Lightning's precision plugin.
        module: the LightningModule (its class and its Trainer's settings).
        model: what ``plan_model`` decided (tensor shapes, tensor-parallel plan); ``None`` if planning failed.
    """
    items = settings_items(settings)
    items.update(layout_items(settings, world_size))
    items["strategy.precision"] = f"{type(precision).__name__} {getattr(precision, 'precision', '')}"
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is not None:
        for name in _TRAINER_SETTINGS:
            items[f"trainer.{name}"] = _text(getattr(trainer, name, None))
        items["trainer.fn"] = _text(trainer.state.fn)
    if module is not None:
        items["model.class"] = f"{type(module).__module__}.{type(module).__qualname__}"
    if model is not None:
        items.update(spec_items(model.full_spec))
        for key, plan in (("tp_plan", model.tp_plan), ("tp_plan.outer", model.outer_plan)):
            for name, entry in (plan.entries if plan is not None else {}).items():
                style = entry.style if isinstance(entry.style, str) else type(entry.style).__name__
                items[f"{key}.{name}"] = style
    return items


def spec_items(full_spec: Mapping[str, TensorSpec]) -> dict[str, str]:
    """The model's tensors: ``model.NAME`` -> kind, shape and dtype."""
    items = {}
    for name, spec in full_spec.items():
        kind = "parameter" if spec.is_parameter else "buffer"
        items[f"model.{name}"] = f"{kind} {tuple(spec.shape)} {spec.dtype}"
    return items


def body_items(body: Any, stage_plan: Any) -> dict[str, str]:
    """The body's entries (name: type) and the stage split."""
    items = {f"body.{name}": type(layer).__qualname__ for name, layer in body.module.named_children()}
    items["stages"] = _text(stage_plan.layer_names)
    return items


def _digest(items: dict[str, str]) -> int:
    raw = hashlib.sha256(json.dumps(sorted(items.items())).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def compare_across_ranks(items: dict[str, str], device: torch.device, what: str, limit: int = 12) -> None:
    """Raise ``ConsistencyError`` on every rank if ``items`` differ between ranks.

    One all-gather of an 8-byte hash per rank; only on a mismatch (agreed by all, since all see the same
    hashes) a second round gathers the items themselves to name what differs.
    """
    world = dist.get_world_size()
    mine = torch.tensor([_digest(items)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if all(bool((g == gathered[0]).all()) for g in gathered):
        return
    everyone: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(everyone, items)
    lines = []
    for key in sorted(set().union(*(e or {} for e in everyone))):
        values = [(e or {}).get(key, "<missing>") for e in everyone]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(value, []).append(rank)
            lines.append(f"  {key}: " + "; ".join(f"{v} on {_ranks_text(r)}" for v, r in groups.items()))
    shown = lines[:limit] + ([f"  ... and {len(lines) - limit} more"] if len(lines) > limit else [])
    raise mark_agreed(
        ConsistencyError(
            f"ThreeDStrategy: the ranks of this job do not agree on {what}; every rank must run the same "
            "configuration. Differences:\n" + "\n".join(shown) + "\nCheck that every process gets the same "
            "arguments and config files, and that nothing rank-dependent (LOCAL_RANK, hostnames, timestamps, "
            "unseeded randomness) feeds into the model or the settings."
        )
    )


def batch_digest(batch: Any) -> int:
    """An 8-byte hash of a batch, in order: every tensor's dtype, shape and bytes, a number's or string's ``repr``, and
    for any other object its type alone."""
    h = hashlib.sha256()

    def visit(value: Any) -> None:
        if isinstance(value, Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            flat = local.detach().reshape(-1).contiguous().cpu()
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                h.update(repr(key).encode())
                visit(item)
        elif isinstance(value, (list, tuple)):
            h.update(f"{type(value).__name__}[{len(value)}]".encode())
            for item in value:
                visit(item)
        elif value is None or isinstance(value, (str, int, float, bool)):
            h.update(repr(value).encode())
        else:  # an object's repr may carry its address: only its type counts
            h.update(type(value).__qualname__.encode())

    visit(batch)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def check_replica_batch(batch: Any, hook: str, dp_rank: int, dp: int, device: torch.device) -> None:
    """Raise ``ConsistencyError`` on every rank if the ranks of one data-parallel replica hold different batches.

    The ranks of a replica (its pipeline stages and tensor-parallel shards) must read the same samples: each stage
    runs the step on its own copy of the batch, so a stage would otherwise compute on one batch the activations it
    sends and the next stage take the labels of another, with no error. One all-gather of (hash, dp rank).
    """
    mine = torch.tensor([batch_digest(batch), dp_rank], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    replicas: dict[int, dict[int, list[int]]] = {}
    for rank, row in enumerate(gathered):
        digest, replica = (int(v) for v in row.tolist())
        replicas.setdefault(replica, {}).setdefault(digest, []).append(rank)
    split = {r: groups for r, groups in sorted(replicas.items()) if len(groups) > 1}
    if not split:
        return
    replica, groups = next(iter(split.items()))
    apart = "; ".join(f"batch {i + 1} on {_ranks_text(ranks)}" for i, ranks in enumerate(groups.values()))
    raise mark_agreed(
        ConsistencyError(
            f"ThreeDStrategy: the ranks of data-parallel replica {replica} got different batches in their first "
            f"{hook} ({apart}; {len(split)} of {dp} replicas differ). Every rank of a replica (its pipeline stages "
            "and tensor-parallel shards) must read the same samples; only the replicas differ. A sampler or an "
            "IterableDataset split by trainer.world_size / trainer.global_rank (the DDP habit) gives each rank "
            "its own: split by the data-parallel size and rank instead, trainer.strategy.distributed_sampler_kwargs "
            f"(here num_replicas={dp}), as Lightning's own DistributedSampler does (use_distributed_sampler=True). "
            "Random draws in the data pipeline must not depend on the rank either (Lightning seeds dataloader "
            "workers by global rank)."
        )
    )


# ---------------------------------------------------------------------------------------------- timeouts
def all_process_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to (the default group and the mesh's sub-groups among them)."""
    return torch_compat.process_groups()


def set_timeouts(timeout: timedelta, groups: Iterable[dist.ProcessGroup] | None = None) -> None:
    """Set the timeout of collectives on every process group (``torch_compat.set_group_timeout``, as torchtitan
    does)."""
    for group in all_process_groups() if groups is None else groups:
        try:
            torch_compat.set_group_timeout(timeout, group)
        except (ValueError, AssertionError):  # a group this rank is not part of
            continue


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The current timeout of a process group's backend (for tests and diagnostics)."""
    return torch_compat.group_timeout(group)


class _P2PTimeout:
    """Make the pipeline's receives and sends wait at most ``timeout`` on gloo.

    Gloo's point-to-point operations ignore a changed group timeout (they use the timeout the group was
    created with); the pipeline schedules wait on them through one helper function, which is replaced (through
    ``torch_compat.wrap_wait_batch_p2p``) by one that passes the timeout to ``Work.wait``. NCCL needs none of
    this (its watchdog applies the group's current timeout to every operation).
    """

    timeout: timedelta | None = None
    _remove: Callable[[], None] | None = None

    @classmethod
    def install(cls, timeout: timedelta) -> None:
        cls.timeout = timeout
        if cls._remove is None:

            def with_timeout(_torch_wait: Callable[..., Any]) -> Callable[..., Any]:
                # The name _wait_p2p is what FailureWatch looks for to tell a rank waiting on a peer.
                def _wait_p2p(work: list[dist.Work]) -> None:
                    for w in work:
                        if cls.timeout is None:
                            w.wait()
                        else:
                            w.wait(cls.timeout)

                return _wait_p2p

            cls._remove = torch_compat.wrap_wait_batch_p2p(with_timeout)

    @classmethod
    def remove(cls) -> None:
        if cls._remove is not None:
            cls._remove()
            cls._remove, cls.timeout = None, None


def diagnose_barrier(timeout: timedelta | float = 60.0, group: dist.ProcessGroup | None = None) -> None:
    """A barrier that names the ranks that do not arrive (collective: call it on every rank).

    Uses ``torch.distributed.monitored_barrier`` (gloo only; under NCCL a temporary gloo group is created):
    rank 0 raises ``RuntimeError`` listing every rank that did not reach the barrier within ``timeout``.

    Args:
        timeout: how long to wait for the other ranks.
        group: the group to check (default: all ranks).
    """
    timeout = as_timedelta(timeout)
    assert timeout is not None
    if dist.get_backend(group) != "gloo":
        ranks = None if group is None else dist.get_process_group_ranks(group)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)


_JOINING: list[list[Any]] = []


def join_children_at_exit(children: Callable[[], list[Any]], timeout: float = 30.0) -> None:
    """Let the process that launched the other ranks exit only after them (once per process).

    Lightning's launcher does not wait for the ranks it started: rank 0 could return to the shell while the others
    are still shutting down (ports, GPUs, files still held), and nothing would notice one that never ends. At
    interpreter exit this waits up to ``timeout`` seconds for them. (A failing job does not get here: the
    fail-fast watch ends the ranks itself.)
    """
    procs = list(children())  # the list, not the callable: a bound method would keep its strategy (and the
    # model, the optimizer state, every device buffer) alive until the next run in this process replaced it
    if _JOINING:
        _JOINING[0] = procs
        return
    _JOINING.append(procs)

    def join() -> None:
        deadline = time.monotonic() + timeout
        for proc in _JOINING[0]:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    f"lightning_3d: rank process {proc.pid} is still running {timeout:.0f} s after rank 0 ended"
                )

    atexit.register(join)


# ---------------------------------------------------------------------------------------------- facade
class Reliability:
    """The strategy's reliability features (see the module docstring).

    It is given what each hook needs, when the strategy has it: the settings at construction; the topology,
    device, rank, a barrier and the launcher's child processes once the process group exists; the model's plan
    in the consistency check; the module and this rank's stages once they are built.

    Args:
        settings: the strategy's settings (``timeout``, ``train_timeout``, ``on_nonfinite``,
            ``check_consistency``, ``fail_fast`` and, for the consistency check, all of them).
        watch_interval: seconds between the watcher's polls.
    """

    def __init__(self, settings: ThreeDSettings, watch_interval: float = 0.5) -> None:
        self.settings = settings
        self.watch_interval = watch_interval
        self.watch: FailureWatch | None = None
        self.switched = False
        self.failed = False
        self._failure: BaseException | None = None  # the exception reported (on_exception)
        self.skipped_steps: list[int] = []  # global steps whose optimizer update was skipped
        self.step_skipped = False  # the current optimizer step's gradients were dropped
        self._poisoned = False  # a non-finite batch in the current accumulation window ("skip")
        self._nonfinite_note = ""
        # given by the hooks below
        self._topology: Topology | None = None
        self._root_device = torch.device("cpu")
        self._global_rank = 0
        self._barrier: Callable[[str], None] = lambda name: None
        self._module: LightningModule | None = None
        self._stages: list[StageSpec] | None = None
        self._num_stages = 0
        self._stage_of: dict[int, int] = {}  # id(parameter) -> the pipeline stage holding it
        self._grouper = GradGrouper(self._stage_of, 0)
        self._scan_plan_cache: _ScanPlan | None = None
        self._batches_checked: set[str] = set()  # hooks whose first batch was compared within the replicas
        # the per-gradient 2-norms of the last non-finite scan, for gradient clipping in the same step
        self.scan_norms = ScanNorms()

    @property
    def setup_timeout(self) -> timedelta | None:
        """Process-group timeout until the first training step has finished."""
        return self.settings.timeout  # type: ignore[return-value]  # a timedelta after validation

    @property
    def train_timeout(self) -> timedelta | None:
        """Process-group timeout from then on (``None``: keep ``setup_timeout``)."""
        return self.settings.train_timeout  # type: ignore[return-value]

    @property
    def on_nonfinite(self) -> str:
        return self.settings.on_nonfinite

    # ------------------------------------------------------------------ setup
    def _device(self) -> torch.device:
        return self._root_device if dist.get_backend() == "nccl" else torch.device("cpu")

    def on_process_group_ready(
        self,
        topology: Topology,
        device: torch.device,
        global_rank: int,
        barrier: Callable[[str], None],
        children: Callable[[], list[Any]],
    ) -> None:
        """In ``setup_environment`` after the process group exists, before the mesh is built.

        Args:
            topology: the job's (dp, pp, tp) degrees.
            device: this rank's device.
            global_rank: this rank.
            barrier: a barrier over all ranks (called with a name) for ``after_train_step`` and ``teardown``.
            children: the processes this rank's launcher started (the fail-fast watch reaps them).
        """
        self._topology, self._root_device, self._global_rank, self._barrier = topology, device, global_rank, barrier
        self.failed, self.switched = False, False
        join_children_at_exit(children)
        if self.setup_timeout is not None:
            set_timeouts(self.setup_timeout)
        if self.settings.check_consistency:
            compare_across_ranks(
                layout_items(self.settings, topology.world_size), self._device(), "the parallel layout"
            )
        if self.settings.fail_fast:

            def describe(rank: int) -> str:
                c = topology.coordinates(rank)
                return f"dp {c['dp']}, stage {c['pp']} of {topology.pp}, tp {c['tp']}"

            self.watch = FailureWatch(
                global_rank, topology.world_size, describe, children, interval=self.watch_interval
            )
            self.watch.start()

    def check_consistency(
        self,
        module: LightningModule,
        precision: Precision,
        model: ModelPlan | None,
        error: BaseException | None = None,
        settings_only: bool = False,
    ) -> None:
        """Settings and model structure are the same on every rank (``_parallelize``'s first collectives).

        Args:
            module: the LightningModule being set up.
            precision: Lightning's precision plugin.
            model: what ``plan_model`` decided; ``None`` when it raised ``error`` or with ``settings_only``.
            error: this rank's planning error, if any (a configuration the model does not fit): it joins the
                compared items, so a rank that fails planning while another does not is named in a
                ``ConsistencyError`` on every rank instead of leaving the others waiting; when every rank
                failed alike the caller raises it.
            settings_only: compare the settings and the unsplit module's tensors, before a planning step that is
                itself a collective (the compute partitioner's timing); the whole check follows the planning.
        """
        self._module = module
        if self.setup_timeout is not None:
            set_timeouts(self.setup_timeout)  # the mesh's sub-groups were created with the backend's default
        if self.settings.check_consistency:
            assert self._topology is not None, "on_process_group_ready comes first"
            items = config_items(self.settings, self._topology.world_size, precision, module, model)
            if settings_only:  # the unsplit module's tensors, as planning would list them
                items.update(spec_items(full_model_spec(module)))
            elif model is not None and error is None:
                items.update(body_items(model.body, model.stage_plan))
            else:
                items["setup_error"] = f"{type(error).__name__}: {error}"
            compare_across_ranks(items, self._device(), "the strategy / Trainer settings or the model")

    def on_model_ready(self, module: LightningModule, stages: Sequence[StageSpec], num_stages: int) -> None:
        """After ``_parallelize`` built this rank's stages: what ``after_backward`` inspects.

        Args:
            module: the split, sharded, wrapped LightningModule.
            stages: this rank's stages.
            num_stages: stages in the whole pipeline.
        """
        self._module, self._stages, self._num_stages = module, list(stages), num_stages
        self._stage_of = {id(p): spec.index for spec in stages for p in spec.module.parameters()}
        self._grouper = GradGrouper(self._stage_of, num_stages - 1)
        # The scan's kernel probe (also for 16-mixed's overflow flags under "off") reads the device once: here, not
        # in a step.
        devices = {p.device for spec in stages for p in spec.module.parameters()}
        devices |= {self._device()} if dist.is_initialized() else set()
        for device in devices - {torch.device("meta")}:
            torch_compat.max_abs_carries_nan(device)

    def check_replica_batch(self, hook: str, batch: Any, dp_rank: Callable[[], int], dp: int) -> None:
        """The first batch of ``hook`` (``training_step``, ``validation_step``, ...): the same on every rank of a
        data-parallel replica (:func:`check_replica_batch`); later batches of the hook cost a set lookup (``dp_rank``
        is called only when comparing: the mesh reads its coordinates from a tensor). Nothing to compare when a
        replica is one rank, or with ``check_consistency=False``."""
        if hook in self._batches_checked or not self.settings.check_consistency:
            return
        self._batches_checked.add(hook)
        topology = self._topology
        if topology is None or topology.tp * topology.pp == 1 or not dist.is_initialized():
            return
        check_replica_batch(batch, hook, dp_rank(), dp, self._device())

    # ------------------------------------------------------------------ steps
    def after_train_step(self) -> None:
        """After each training batch: switch to ``train_timeout`` once the first one has finished."""
        if self.switched or self.train_timeout is None:
            return
        self.switched = True
        self._barrier("lightning_3d.train_timeout")  # nobody switches while another rank still sets up
        set_timeouts(self.train_timeout)
        if dist.get_backend() == "gloo":
            _P2PTimeout.install(self.train_timeout)

    @property
    def n_flags(self) -> int:
        """How many numbers ``local_flags`` returns: one per pipeline stage, then the loss."""
        return self._num_stages + 1

    def flags_request(self) -> tuple[int, Callable[[Any, Any], Tensor]] | None:
        """What the training step adds to the batch's one exchange (``BatchRunner.run(flags=...)``), or ``None``."""
        if self.on_nonfinite == "off":
            return None
        return self.n_flags, self.local_flags

    def local_flags(self, held: Any, logs: Any) -> Tensor:
        """This rank's non-finite flags for one batch, on the device, without reading it.

        One fused pass over the gradients, grouped by pipeline stage, device and dtype, into one flag per stage:

        * when the Trainer clips gradients by norm (``gradient_clip_val``), the 2-norm of each gradient
          (``torch._foreach_norm``, the call clipping makes): a non-finite norm is a non-finite gradient, and the
          norms are kept in ``scan_norms`` for the clipping later in the same step to reuse (no second pass). A
          finite gradient whose 2-norm overflows its dtype (float32: beyond ~1.8e19) counts as non-finite here,
          as clipping by that norm would zero it (float16 gradients, whose norm overflows at 65504, take the
          per-element check);
        * otherwise the largest magnitude of each gradient (``torch_compat.foreach_non_finite``: one fused pass that
          reads every element and writes none): exactly the gradients holding a NaN or inf.

        The last flag is the last stage's loss.

        Args:
            held: the batch's ``HeldGrads`` (``None``: no gradients).
            logs: this rank's ``StepLogs`` (last stage) or ``None``.

        Returns:
            ``n_flags`` numbers: ``[non-finite gradients of stage 0, ..., of stage n-1, loss non-finite]`` (0: none).
        """
        num_stages = self._num_stages
        device = self._device()
        flags = torch.zeros(num_stages + 1, dtype=torch.float64, device=device)
        self.scan_norms.clear()
        if held is not None:
            groups = self._grouper.group(held.params, held.grads)  # local tensors: no autograd wrapper each
            if groups:
                plan = self._scan_plan(tuple(groups), device)
                if self._clips_by_norm() and all(dtype != torch.float16 for _, _, dtype in groups):
                    found = []
                    for grads, locals_ in groups.values():
                        norms = torch_compat.foreach_norm(locals_, 2.0)
                        self.scan_norms.record(grads, norms)
                        found.append((~torch.isfinite(torch.stack(norms))).any().to(device, torch.float64))
                    flags.index_add_(0, plan.stage_index, torch.stack(found))
                else:
                    plan.per_element_check(groups, flags)
        loss_total = getattr(logs, "loss_total", None) if logs is not None else None
        if isinstance(loss_total, Tensor):
            flags.select(0, num_stages).copy_(torch.isfinite(loss_total).logical_not_())
        elif isinstance(loss_total, float) and not math.isfinite(loss_total):
            flags[num_stages] = 1.0
        return flags

    def _clips_by_norm(self) -> bool:
        """Whether the Trainer clips gradients by their norm (then the scan computes the norms clipping reuses)."""
        trainer = getattr(self._module, "_trainer", None)
        if trainer is None or not getattr(trainer, "gradient_clip_val", None):
            return False
        return getattr(trainer, "gradient_clip_algorithm", None) in (None, "norm")

    def _scan_plan(self, keys: tuple[GroupKey, ...], device: torch.device) -> _ScanPlan:
        """The per-step buffers of the scan over these groups (made once per list of groups)."""
        plan = self._scan_plan_cache
        if plan is None or plan.keys != keys:
            plan = self._scan_plan_cache = _ScanPlan(keys, device)
        return plan

    def after_backward(self, loss: Tensor, flags: list[float] | None = None) -> None:
        """In ``backward``, after the schedule's gradients are back on the parameters.

        All ranks agree on non-finite numbers: ``flags`` are the batch's ``local_flags`` summed over every rank
        in the training step's one exchange (already read on the host: no further synchronisation here). Only when
        one says something is wrong are the offending parameters looked up (by reading each gradient).

        Args:
            loss: the batch's loss (the same on every rank).
            flags: the summed flags (``None``: computed and all-reduced here, from the gradients on the parameters).
        """
        self.step_skipped = False
        if self.on_nonfinite == "off":
            return
        module = self._module
        assert module is not None and self._stages is not None, "on_model_ready comes first"
        trainer = module.trainer
        num_stages = self._num_stages
        if flags is None:  # not through the training step's exchange: agree here
            params = [p for p in module.parameters() if p.grad is not None]
            held = _Held(params, [p.grad for p in params])
            local = self.local_flags(held, None)
            local[num_stages] = (~torch.isfinite(loss.detach())).to(local.device, torch.float64).reshape(())
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
            flags = local.tolist()
        accumulating = trainer.fit_loop.epoch_loop._should_accumulate()
        if any(flags):
            stages_bad = [i for i in range(num_stages) if flags[i]]
            parts = []
            if flags[num_stages]:
                parts.append(f"the loss is {float(loss.detach().float().cpu())}")
            if stages_bad:
                parts.append(f"gradients of pipeline stage(s) {stages_bad} (of {num_stages}) are not finite")
            where = f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {_batch_idx(trainer)})"
            summary = f"ThreeDStrategy: non-finite numbers {where}: " + "; ".join(parts) + "."
            named = [(n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
            bad_names = [n for n, g in named if not bool(_local(g).isfinite().all())]
            if bad_names:
                shown = ", ".join(bad_names[:8]) + (f" and {len(bad_names) - 8} more" if len(bad_names) > 8 else "")
                log.warning(f"[rank {self._global_rank}] non-finite gradients in: {shown}")
            if self.on_nonfinite == "raise":
                raise mark_agreed(
                    NonFiniteError(
                        summary + " No optimizer step was taken. Every rank raises this error at this step. "
                        "Use ThreeDStrategy(on_nonfinite='skip') to skip such steps instead, or lower the learning "
                        "rate / clip gradients."
                    )
                )
            self._poisoned = True
            self._nonfinite_note = summary
        if self._poisoned and not accumulating:
            for p in module.parameters():
                p.grad = None
            self._poisoned = False
            self.step_skipped = True
            self.skipped_steps.append(trainer.global_step)
            if self._global_rank == 0:
                log.warning(
                    f"{self._nonfinite_note} on_nonfinite='skip': the optimizer step is skipped on every rank (all "
                    "gradients dropped; the global step and LR schedulers still advance). "
                    f"Skipped so far: {len(self.skipped_steps)}."
                )

    # ------------------------------------------------------------------ failure and the end
    def on_exception(self, exception: BaseException) -> None:
        """``Strategy.on_exception``: report this rank's failure so every rank stops now (once per exception)."""
        if self.failed and exception is self._failure:
            return
        self.failed, self._failure = True, exception
        _P2PTimeout.remove()
        if self.watch is None:
            return
        trainer = getattr(self._module, "_trainer", None)
        ready = self._stages is not None
        where = f"at global step {trainer.global_step}" if trainer is not None and ready else "during setup"
        self.watch.report(exception, where)

    def refuse_save_after_failure(self, interrupted: bool, exception: BaseException | None, path: Any) -> bool:
        """Whether a checkpoint save must not start because this rank alone failed; if so, report it now.

        Lightning runs the callbacks' ``on_exception`` (``OnExceptionCheckpoint``, ``ModelCheckpoint``'s save on
        exception) before ``Strategy.on_exception``: a rank whose step raised went into the save's collectives
        while the others waited for it in the pipeline, and the job hung until the timeout with the root cause
        not yet reported. A checkpoint needs every rank at the same point, which an error of one rank never
        gives, so the failure is reported here (the other ranks stop) and the save is skipped with a line saying
        so. An error every rank raised together (``is_agreed``) saves as usual.

        Args:
            interrupted: the trainer's status is ``INTERRUPTED`` (the save runs in Lightning's exception handling).
            exception: the exception being handled (``sys.exc_info()``), if any.
            path: the checkpoint's path, for the message.
        """
        if not interrupted or exception is None or is_agreed(exception):
            return False
        self.on_exception(exception)
        print(
            f"[rank {self._global_rank}] lightning_3d: checkpoint {str(path)!r} not saved: this rank failed "
            f"({type(exception).__name__}) and the other ranks are stopping; a checkpoint needs every rank. "
            "Resume from the last checkpoint saved before the failure.",
            flush=True,
        )
        return True

    def teardown(self) -> None:
        """End of a trainer call: on success stop the watch and restore the setup timeout, then a barrier."""
        if self.failed:
            return
        watching = self.watch is not None and self.watch.running
        if self.watch is not None:
            self.watch.stop()
        _P2PTimeout.remove()
        if self.setup_timeout is not None and dist.is_initialized():
            set_timeouts(self.setup_timeout)
        if watching:
            self._barrier("lightning_3d.teardown")  # no rank exits while another's watch still runs


class _ScanPlan:
    """The non-finite scan's fixed parts for one list of gradient groups (``(stage, device, dtype)`` keys): each
    group's stage as a device tensor, and the per-element check's flag buffers, reused step after step.

    Args:
        keys: the groups, in the order the scan visits them.
        device: where the flags live.
    """

    def __init__(self, keys: tuple[GroupKey, ...], device: torch.device) -> None:
        self.keys = keys
        stages = [stage for stage, _, _ in keys]
        self.stage_index = torch.tensor(stages, dtype=torch.long, device=device)
        # One float32 flag per group (GradScaler's found-inf check writes float32), in one buffer per device.
        positions: dict[torch.device, list[int]] = {}  # per device, the groups (their positions in ``keys``) on it
        for i, (_, d, _) in enumerate(keys):
            positions.setdefault(d, []).append(i)
        self._found = {d: torch.zeros(len(at), dtype=torch.float32, device=d) for d, at in positions.items()}
        slot_of = {i: self._found[d][j : j + 1] for d, at in positions.items() for j, i in enumerate(at)}
        self._slots = [slot_of[i] for i in range(len(keys))]  # group i's one-element view of its device's buffer
        self._one = {d: torch.ones(1, dtype=torch.float32, device=d) for d in self._found}
        # The usual case: one device (the flags'), one group per stage in stage order: the flags are a slice copy.
        consecutive = stages == list(range(stages[0], stages[0] + len(stages)))
        self._slice = (stages[0], stages[0] + len(stages)) if consecutive and list(self._found) == [device] else None
        # Otherwise each device's flags are added to their stages' (index tensors made here, not per step).
        self._stage_of_found = {d: self.stage_index[at] for d, at in positions.items()}
        self._device = device

    def per_element_check(self, groups: Groups, flags: Tensor) -> None:
        """One fused NaN/inf check per group (``torch_compat.foreach_non_finite``); adds ``1.0`` to the flag of the
        stage of each group holding one."""
        for found in self._found.values():
            found.zero_()
        for slot, (key, (_, locals_)) in zip(self._slots, groups.items(), strict=True):
            torch_compat.foreach_non_finite(locals_, slot, self._one[key[1]])
        if self._slice is not None:
            flags[self._slice[0] : self._slice[1]].copy_(self._found[self._device])
            return
        for d, found in self._found.items():
            flags.index_add_(0, self._stage_of_found[d], found.to(self._device, torch.float64))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclasses.dataclass
class _Held:
    params: list[Any]
    grads: list[Any]


def _batch_idx(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_loop.batch_idx)


__all__ = [
    "ConsistencyError",
    "DPConsistencyCheck",
    "DPDivergenceError",
    "NonFiniteError",
    "Reliability",
    "diagnose_barrier",
    "is_agreed",
    "mark_agreed",
]
