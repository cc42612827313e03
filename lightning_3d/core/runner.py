"""One batch of a user hook (training, validation, test or predict step) through the pipeline.

``BatchRunner.run`` is what the strategy's ``*_step`` methods call. It chooses the micro-batch count,
captures the body's input on the first stage, runs the schedule (the user's step runs per micro-batch on
the last stage, see ``step.py``), keeps Lightning's view of the gradients consistent (``GradStash``),
keeps torchmetrics objects exact (``metric_sync.py``) and relays what was logged to every rank
(``log_relay.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

from . import metric_sync
from .agreed import mark_agreed
from .log_relay import PackedRelay, StepLogs, common_schema, relay, replay
from .loss_weights import LabelCount, MicroBatchWeights, micro_batch_weights
from .partition import BodyRef
from .pipeline import PipelineRuntime, StageSpec, micro_batch_problem, min_micro_batches, stage_ranks
from .rng import BodyRandomness
from .stage_exec import StageExecutor
from .step import (
    HeldGrads,
    StepAdapter,
    batch_size_of,
    capture_body_input,
    drop_grads,
    merge_outputs,
    put_grads,
    shape_key,
    take_grads,
)

_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


@dataclass(frozen=True)
class BatchResult:
    """What one batch through the pipeline produced.

    Attributes:
        logs: the batch's ``self.log`` values combined over micro-batches and replicas (identical on every rank).
        outputs: the step's outputs joined over micro-batches: on the last stage for validation / test, on every
            stage for predict, ``None`` otherwise.
        grads: the batch's gradients, held away from the parameters until Lightning's backward (training only).
        flags: the ``flags`` the caller asked for, summed over every rank (``None`` when none were asked for).
    """

    logs: StepLogs
    outputs: Any
    grads: HeldGrads | None
    flags: list[float] | None = None


# What a caller adds to the batch's one exchange: ``(n_flags, fn)``; ``fn(grads, logs)`` gets the batch's gradients
# (training) and this rank's logs (last stage, else ``None``) and returns ``n_flags`` non-negative numbers, summed
# over every rank (e.g. non-finite gradients per stage).
FlagsFn = Callable[[HeldGrads | None, StepLogs | None], torch.Tensor]


def micro_batch_mismatch(total: int, micro_batches: int, minimum: int) -> str:
    """The message for a per-replica batch of ``total`` samples that ``micro_batches`` does not divide."""
    below = total - total % micro_batches
    sizes = [s for s in (below, below + micro_batches) if s > 0]
    workable = [d for d in range(minimum, total + 1) if total % d == 0]
    return (
        f"ThreeDStrategy: the training batch has {total} samples per data-parallel replica, which "
        f"micro_batches={micro_batches} does not divide. Use a per-replica batch size that is a multiple of "
        f"{micro_batches} (e.g. {' or '.join(map(str, sizes))})"
        + (f", or micro_batches in {workable}." if workable else ".")
    )


class BatchRunner:
    """Runs batches of the user's hooks through this rank's pipeline stages.

    Args:
        module: the LightningModule (already split, sharded and wrapped).
        body: where its ``nn.Sequential`` body lives.
        stages: this rank's stages.
        num_stages: stages in the whole pipeline.
        mesh: the (dp, pp, tp) device mesh.
        device: this rank's device.
        schedule: training schedule name.
        micro_batches: micro-batches per (full) batch.
        randomness: the stages' random streams (see ``rng.py``).
        executor: the user's step on every stage (a model split at its blocks), else ``body`` is used.
        label_count: weight micro-batches by their label tokens, counted so (``loss_weights.py``); ``None``: by
            samples.
    """

    def __init__(
        self,
        module: LightningModule,
        body: BodyRef | None,
        stages: Sequence[StageSpec],
        num_stages: int,
        mesh: DeviceMesh,
        device: torch.device,
        schedule: str,
        micro_batches: int,
        randomness: BodyRandomness | None = None,
        executor: StageExecutor | None = None,
        label_count: LabelCount | None = None,
    ) -> None:
        self.module, self.body, self.mesh = module, body, mesh
        self.device = device
        self.randomness = randomness
        self.schedule, self.micro_batches = schedule, micro_batches
        self.pp = mesh["pp"].size()
        # the pp rank of the last stage (pp - 1, or 0 under a V schedule): it broadcasts the logs
        self._last_pp_rank = stage_ranks(schedule, self.pp, max(1, len(stages)))[-1]
        self.executor = executor
        if executor is not None:
            self.stepper: StageExecutor | StepAdapter = executor
            loss_fn = executor.loss_fn
        else:
            assert body is not None
            report = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0  # one last-stage rank
            adapter = StepAdapter(
                module, body, lambda: self.runtime.current_initialised(), report_random=report, device=device
            )
            self.stepper, loss_fn = adapter, adapter
        self.runtime = PipelineRuntime(
            stages,
            num_stages,
            mesh["pp"].get_group(),
            device,
            schedule,
            loss_fn,
            randomness=randomness,
            on_chunk=executor.on_chunk if executor is not None else None,
        )
        self._label_count = label_count
        self.metrics = {n: m for n, m in module.named_modules() if isinstance(m, Metric)}
        metric_sync.use_group(self.metrics, mesh["dp"].get_group())
        self._batch_metrics = metric_sync.BatchMetrics(self.metrics)
        self._checked_first_train_batch = False
        self._packed = PackedRelay()  # the logs' layout, cached per hook (the same on every rank)
        # The mesh's coordinates and groups, read once (DeviceMesh slicing reads its rank tensor on the host).
        dp_mesh, pp_mesh = mesh["dp"], mesh["pp"]
        self.dp, self.dp_rank, self.tp_rank = dp_mesh.size(), dp_mesh.get_local_rank(), mesh["tp"].get_local_rank()
        self._dp_group = dp_mesh.get_group() if self.dp > 1 else None
        self._pp_group = pp_mesh.get_group() if self.pp > 1 else None
        self._last_stage_rank = int(pp_mesh.mesh[self._last_pp_rank])
        # This rank's parameters, listed once: walking the module tree every batch costs more than the rest of the
        # batch's bookkeeping. Their identity is fixed once the stages are built (sharding, tying and compiling
        # happen before; checkpoints load in place; FSDP swaps in its unsharded parameters only inside the
        # schedule and puts the same sharded ones back).
        self._params: list[torch.nn.Parameter] = list(module.parameters())
        # the exchange's group size and device (the backend's: gloo exchanges on the host)
        self._world = (dist.get_world_size(), device if dist.get_backend() == "nccl" else torch.device("cpu"))

    # ------------------------------------------------------------------ micro-batching
    def micro_batches_for(self, total: int, train: bool) -> tuple[int, str]:
        """Micro-batch count and schedule for a batch of ``total`` samples on one replica.

        The configured count must divide the first training batch (a configuration error otherwise). Other
        batches it does not divide (the short last batch of an epoch, evaluation batches) get the divisor of
        their size closest to it, so micro-batches are always of equal size, never uneven; when no divisor
        satisfies 1F1B's minimum, that batch runs GPipe (same numbers, larger bubble).
        """
        m = self.micro_batches
        minimum = min_micro_batches(self.schedule, self.pp)
        if train and not self._checked_first_train_batch:
            self._checked_first_train_batch = True
            if total % m != 0:
                # Every replica's batch has the same size, so every rank raises this alike (no fail-fast record).
                raise mark_agreed(ValueError(micro_batch_mismatch(total, m, minimum)))
        if total % m == 0:
            return m, self.schedule
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        usable = [d for d in divisors if not train or micro_batch_problem(self.schedule, self.pp, d) is None]
        if usable:
            return min(usable, key=lambda d: (abs(d - m), d)), self.schedule
        return min(divisors, key=lambda d: (abs(d - m), d)), "gpipe"

    # ------------------------------------------------------------------ one batch
    def run(
        self,
        hook: str,
        args: tuple[Any, ...],
        precision: Precision,
        *,
        train: bool,
        scale: float | torch.Tensor = 1.0,
        defer_grad_sync: bool = False,
        flags: tuple[int, FlagsFn] | None = None,
        discard_prior_grads: bool = False,
    ) -> BatchResult:
        """Run ``hook`` over one batch through the pipeline.

        Gradients present before the batch are moved aside while the schedule runs (a new schedule's shape
        inference clears them) and put back afterwards; in training the batch's own gradients are returned in
        ``BatchResult.grads`` for Lightning's backward to add (``HeldGrads.restore``).

        Args:
            hook: the LightningModule method (``"training_step"``, ...).
            args: its arguments (batch first).
            precision: Lightning's precision plugin (its step contexts: autocast etc.).
            train: forward and backward, or forward only.
            scale: loss multiplier in training (1 / accumulate_grad_batches; under 16-mixed also the loss scale,
                a device tensor).
            defer_grad_sync: keep data-parallel gradients local (not the last batch of an accumulation window).
            flags: ``(n_flags, fn)``: numbers to sum over every rank in the batch's one exchange (``FlagsFn``).
            discard_prior_grads: drop the gradients present before the batch instead of putting them back (Lightning
                zeroes them right after this step: ``step.previous_grads_discarded``), so they are not held while the
                schedule computes the new ones.

        Returns:
            The logs as every rank replayed them, the step's outputs and, in training, the batch's gradients.
        """
        module, runtime = self.module, self.runtime
        step_fn: Callable[..., Any] = getattr(module, hook)
        batch, rest = args[0], args[1:]
        total = batch_size_of(batch)
        n_micro, schedule = self.micro_batches_for(total, train)
        key = shape_key(batch)
        if self.executor is not None:  # a hook's first batch, before any rank communicates for it
            self.executor.check_first_step(hook, batch, rest, total, n_micro)
            # a schedule's stages send the flowing tensor and what the boundaries carry: one set of stages per plan
            key = (key, self.executor.carry_key)
        runtime.schedule(n_micro, key, train, schedule)  # build first: it may all-reduce held-back gradients
        # The schedule splits its input and its target on dim 0 into the micro-batches. The target given to the
        # last stage is `sample_index`, the batch's sample numbers: the loss function (or the stage executor) gets
        # micro-batch k's slice of it and reads which samples of the batch (the user's own, unsplit) are its own.
        sample_index = torch.arange(total, device=self.device)
        params = self._params
        # The gradients already there: zeroed by Lightning right after this step and read by nothing before (freed
        # now, as its zero_grad would have freed them), or put back after the schedule.
        prior: list[torch.Tensor | None] | None = None
        if discard_prior_grads:
            drop_grads(params)
        else:
            prior = take_grads(params)
        held: HeldGrads | None = None
        try:
            with getattr(precision, _CONTEXTS[hook])():
                if self.executor is not None:
                    stage_input = sample_index  # the first stage runs the user's step on its micro-batch itself
                elif runtime.has_first:
                    assert self.body is not None
                    stage_input = capture_body_input(module, self.body, step_fn, args, hook)
                else:
                    stage_input = None
                if isinstance(self.stepper, StepAdapter):
                    self.stepper.index = sample_index
                weights = self._weights(hook, batch, total, n_micro) if runtime.has_last else None
                self.stepper.begin(hook, step_fn, batch, rest, total, n_micro, scale, train, weights)
                if runtime.has_last:
                    self._batch_metrics.begin()
                trainer = module._trainer
                stop_before = trainer is not None and trainer.should_stop
                runtime.run(
                    stage_input,
                    sample_index,
                    n_micro,
                    key,
                    train=train,
                    schedule=schedule,
                    defer_grad_sync=defer_grad_sync,
                )
                step_logs, step_outputs = self.stepper.finish()
                metric_batch = self._batch_metrics.end() if runtime.has_last else {}
            if train:
                held = HeldGrads(params, take_grads(params))
        finally:
            if prior is None:  # discarded: a failed batch leaves no partial gradients behind either
                if held is None:
                    drop_grads(params)
            elif held is None or any(g is not None for g in prior):  # else every .grad is None already (taken above)
                put_grads(params, prior)
        last = runtime.has_last
        sizes = [total // n_micro] * n_micro
        local_outputs = merge_outputs(step_outputs, sizes) if last and not train else None
        # `trainer.should_stop = True` from code after the model call ran on the last stage only: it reaches every
        # rank with the logs (else the other stages would start the next batch and wait for ever)
        stop = last and trainer is not None and trainer.should_stop and not stop_before
        local_logs = replace(step_logs, metric_batch=metric_batch, stop=stop) if last else None
        logs, flag_values = self._exchange(hook, local_logs, held, flags)
        values: dict[str, Any] | None = None
        if logs is None and not self._needs_relay() and not self.metrics:
            assert local_logs is not None  # every rank holds the last stage of the only replica
            logs, broadcast_outputs = local_logs, None
        elif logs is None:  # the object relay: metrics, predictions, a new set of logged keys
            logs, extra = self._relay(local_logs, hook, local_outputs)
            exported, values, broadcast_outputs, schema = extra
            if self._needs_relay():
                self._packed.remember(hook, schema)
            if not last:
                metric_sync.import_states(self.metrics, exported)
            metric_sync.set_step_values(self.metrics, values)
        else:
            broadcast_outputs = None
        replay(module, logs, self.metrics, values)
        if logs.stop and trainer is not None:
            trainer.should_stop = True
        return BatchResult(logs, local_outputs if last else broadcast_outputs, held, flag_values)

    def _weights(self, hook: str, batch: Any, total: int, n_micro: int) -> MicroBatchWeights | None:
        """The last stage's label-token weights of the batch's micro-batches (``None``: weighted by samples).
        Collective over the last stage's data-parallel group (whose ranks all see batches with labels or all
        without)."""
        if self._label_count is None or hook == "predict_step":
            return None
        counts = self._label_count.per_micro_batch(batch, n_micro)
        return None if counts is None else micro_batch_weights(counts, total, self.dp, self._dp_group)

    def _needs_relay(self) -> bool:
        """Whether the logs must cross ranks: the last stage is elsewhere, or other replicas logged too."""
        return self.pp > 1 or self.dp > 1

    def _exchange(
        self, hook: str, logs: StepLogs | None, held: HeldGrads | None, flags: tuple[int, FlagsFn] | None
    ) -> tuple[StepLogs | None, list[float] | None]:
        """The batch's one tensor exchange (``PackedRelay``): the logs' values and the caller's flags.

        Returns the combined logs (``None``: the object relay is needed) and the flags summed over every rank.
        """
        by_value = self._needs_relay() and not self.metrics and hook != "predict_step"
        if not by_value and flags is None:
            return None, None
        n_flags, flags_fn = flags if flags is not None else (0, None)
        local_flags = flags_fn(held, logs) if flags_fn is not None else None
        world, device = self._world
        combined, flag_values = self._packed.exchange(
            hook if by_value else "",
            logs if by_value else None,
            local_flags,
            contributor=by_value and logs is not None and self.tp_rank == 0,
            replica=self.dp_rank,
            replicas=self.dp,
            group=dist.group.WORLD if world > 1 else None,
            device=device,
            n_flags=n_flags,
        )
        return (combined if by_value else None), (flag_values if flags is not None else None)

    def _relay(self, logs: StepLogs | None, hook: str, outputs: Any) -> tuple[StepLogs, Any]:
        def finish(parts: list[StepLogs]) -> tuple[Any, Any, Any]:
            batch_states = [p.metric_batch for p in parts]
            values = metric_sync.step_values(self.metrics, batch_states)
            exported = metric_sync.export_states(self.metrics, sorted(logs.metric_batch)) if logs else {}
            # Predictions go to every stage (rank 0 returns them, as under DDP); other outputs stay put.
            schema = common_schema(parts) if self._needs_relay() else None
            return exported, values, outputs if hook == "predict_step" else None, schema

        return relay(
            logs.to_host() if logs is not None and self._needs_relay() else logs,
            dp_group=self._dp_group,
            pp_group=self._pp_group,
            last_stage_rank=self._last_stage_rank,
            finish=finish,
        )
