"""``ThreeDStrategy``: a Lightning strategy for tensor x pipeline x data parallel training.

This file is the orchestrator only: Lightning's hooks, each delegating to one module per concept:

==========================  ====================================================================
settings.py                 ``ThreeDSettings``: every setting, validated (``strategy.settings``)
core/topology.py            (dp, pp, tp) degrees, their validation, the named device mesh
core/partition.py           finding the ``nn.Sequential`` body, splitting it into stages, pruning
core/tensor_parallel/       the automatic / explicit tensor-parallel plan (DTensor styles)
core/materialize.py         meta-device layers materialised one at a time; full <-> sharded weights
core/data_parallel.py       ``replicate`` over the dp mesh
core/fsdp.py                ``data_parallel="fsdp"``: FSDP2 ``fully_shard`` over the dp mesh (per block, or per
                            submodule of a block, then stage); ``"hsdp"``: the same over the (dp_replicate, dp_shard)
                            view of dp
core/parallelize.py         the three applied in one fixed order: stages, tensor parallel, data parallel
core/pipeline.py            ``PipelineStage`` + schedules, cached per micro-batch shape
core/weight_grad_store.py   zero-bubble ``W``: the linear layers' weight gradients ``I`` kept (``split_backward``)
core/rng.py                 the body's random streams: per stage, per tp rank in sharded regions
core/runner.py, step.py     one batch of the user's hook through the pipeline; gradients handed over
core/log_relay.py           ``self.log`` from the last stage to every rank (metric_sync.py: torchmetrics)
core/grad_norm.py           the global gradient norm for clipping
core/optim.py               the multi-tensor optimizer step for DTensor parameters (bitwise the same numbers)
checkpoint/                 sharded, atomic, layout-independent checkpoints (``python -m`` CLI)
reliability.py              consistency check, timeouts, non-finite agreement, fail-fast wiring
tools/                      opt-in: pipeline timeline, fail-fast watch, data-parallel check
==========================  ====================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from . import checkpoint as ckpt
from .checkpoint import hf as ckpt_hf
from .checkpoint.lightning_file import load_lightning_file
from .core import partition
from .core.agreed import mark_agreed, on_rank0_told
from .core.boundary_check import make_skeleton
from .core.compile import CompiledBlocks, compile_kwargs, for_split_backward
from .core.finetuning import filter_by_identity_while_running
from .core.grad_norm import clip_grads_, clip_grads_by_value_, global_grad_norm
from .core.hook_logs import HookLogs, relay_epoch_end
from .core.loss_scale import LossScaler, scaler_of
from .core.loss_weights import label_count_for
from .core.manual import manual_problem, reshard_roots
from .core.materialize import LoadReport, gather_full_state_dict, load_full_state_dict
from .core.model_summary import whole_model_summary
from .core.optim import optimizer_for_dtensors
from .core.parallelize import (
    DataParallelPlan,
    add_body_randomness,
    broadcast_seed,
    build_stages,
    describe_layout,
    plan_model,
)
from .core.patches import Patches
from .core.prediction_writer import write_once_per_replica
from .core.pruning import prune_this_stage, refuse_pruning
from .core.rng import BodyRandomness
from .core.runner import BatchRunner
from .core.step import HeldGrads, ZeroGradHooks, previous_grads_discarded
from .core.throughput import count_by_replica
from .core.tied import TiedWeights, with_alias_keys
from .core.topology import HSDP_DIMS, Topology, resolve_dp_shard
from .core.weight_averaging import defer_copies_to_setup_end, rebuild_averaged_copies
from .core.weight_grad_store import defer_linear_weight_grads
from .reliability import Reliability, diagnose_barrier  # ---- reliability
from .settings import ThreeDSettings, grad_reduce_dp1_message

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class ThreeDStrategy(ParallelStrategy):
    """Tensor x pipeline x data parallel training of an ordinary LightningModule.

    The LightningModule keeps its single-device code: its model body is one ``nn.Sequential`` that
    ``forward`` applies, ``training_step`` calls ``self(x)`` and returns the loss (see the README's contract).

    The settings are keyword arguments (``tp``, ``pp``, ``dp``, ``micro_batches``, ``schedule``, ``timeout``,
    ``on_nonfinite``, ...), documented and validated by :class:`lightning_3d.settings.ThreeDSettings`; or pass
    a ready ``settings=ThreeDSettings(...)``. They are kept, read-only, as ``strategy.settings``.

    Args:
        settings: all settings at once (then no setting keyword arguments).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning strategy (the Trainer fills them in).
        **kwargs: the settings, as ``ThreeDSettings``'s fields.

    Raises:
        ValueError: a setting has a value that cannot work (the message says which and what would).
        TypeError: an unknown setting.

    Example:
        >>> Trainer(accelerator="cpu", devices=8, strategy=ThreeDStrategy(tp=2, pp=2))  # doctest: +SKIP
    """

    strategy_name = "3d"

    def __init__(
        self,
        *,
        settings: ThreeDSettings | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if settings is not None and kwargs:
            raise TypeError(
                f"ThreeDStrategy: pass either settings=ThreeDSettings(...) or the settings as keyword arguments, "
                f"not both (got settings= and {sorted(kwargs)})."
            )
        self._settings = settings if settings is not None else _settings_from(kwargs)
        self._process_group_backend = self._settings.process_group_backend  # resolved by device at setup
        self.num_nodes = 1
        self.topology: Topology | None = None
        self._mesh: DeviceMesh | None = None
        self._hsdp_mesh: DeviceMesh | None = None  # data_parallel="hsdp": (dp_replicate, dp_shard, pp, tp) view
        # set at setup
        self.body: partition.BodyRef | None = None
        self.stage_plan: partition.StagePlan | None = None
        self.plan: Any = None
        self.full_spec: dict[str, partition.TensorSpec] = {}
        self.runner: BatchRunner | None = None
        self._unsplit: nn.Module | str | None = None  # the unsplit model's structure (``_parallelize``)
        self.body_randomness: BodyRandomness | None = None
        self._example_input: Any = None
        self._layout = ""
        self.last_grad_norm: Tensor | None = None
        self._held_grads: HeldGrads | None = None  # the last training batch's gradients, until backward()
        self._zero_grad_hooks = ZeroGradHooks()  # whether zero_grad is Lightning's own, checked once per fit
        self._hook_logs: HookLogs | None = None  # pp > 1: the gradient hooks' self.log, merged over the stages
        self._step_flags: list[float] | None = None  # the last training batch's non-finite flags, until backward()
        self._tied: TiedWeights | None = None
        self._tied_checked_epoch = -1  # the epoch whose first step compared the tied copies' requires_grad
        self._compiled: CompiledBlocks | None = None  # blocks under torch.compile (the compile setting)
        # What this fit changed on callbacks, the module and torch, each with its undo (core/patches.py):
        # "split_backward": compiled code under a two-pass backward (core/compile.py); "finetuning": BaseFinetuning's
        # parameter filter by identity (core/finetuning.py); "deferred_copies": EMA's / SWA's setup copies deferred
        # (core/weight_averaging.py); "pruning": ModelPruning per stage (core/pruning.py); "epoch_end": epoch-end
        # hooks' logs from the last stage (core/hook_logs.py); "save_guard": save_pretrained of a split model
        # refused (checkpoint/hf.py)
        self._patches = Patches()
        self.loss_scaler: LossScaler | None = None  # precision="16-mixed": the plugin's GradScaler, agreed overflow
        # ---- reliability: consistency check, timeouts, non-finite agreement, fail-fast (reliability.py)
        self._reliability = Reliability(self.settings)

    # ------------------------------------------------------------------ settings (read-only views)
    @property
    def settings(self) -> ThreeDSettings:
        """Every setting of this strategy (frozen; the one place they are kept)."""
        return self._settings

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.settings.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree."""
        return self.settings.pp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per batch (resolved: the schedule's minimum when not given)."""
        assert self.settings.micro_batches is not None  # resolved by ThreeDSettings
        return self.settings.micro_batches

    @property
    def schedule(self) -> str:
        """The training schedule's name."""
        return self.settings.schedule

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages per rank."""
        return self.settings.stages_per_rank

    @property
    def tp_plan(self) -> dict[str, Any] | None:
        """The explicit tensor-parallel plan given (``None``: the automatic plan only)."""
        return self.settings.tp_plan  # type: ignore[return-value]  # a dict after validation

    @property
    def tp_autoplan(self) -> bool:
        """Whether the tensor-parallel plan is found automatically."""
        return self.settings.tp_autoplan

    @property
    def partitioner(self) -> partition.Partitioner:
        """The partitioner object (``settings.partitioner`` is its name or the callable given)."""
        return partition.get_partitioner(self.settings.partitioner)

    @property
    def body_name(self) -> str | None:
        """The dotted name of the body given (``None``: found automatically)."""
        return self.settings.body

    @property
    def seed(self) -> int | None:
        """The initialisation seed given (``None``: rank 0's ``torch.initial_seed()``)."""
        return self.settings.seed

    @property
    def print_layout(self) -> bool:
        """Whether rank 0 prints the layout once."""
        return self.settings.print_layout

    # ------------------------------------------------------------------ topology and processes
    @property
    def device_mesh(self) -> DeviceMesh:
        """The (dp, pp, tp) mesh; sub-meshes by name: ``strategy.device_mesh["tp"]``."""
        if self._mesh is None:
            raise RuntimeError("ThreeDStrategy: the device mesh exists only after the processes have started.")
        return self._mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to add a distributed sampler (with the data-parallel rank and size)."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Called by the Trainer before any process starts: the layout is validated here, once, early."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes:
            world = self.num_nodes * self.num_processes
            self.topology = Topology(world, tp=self.settings.tp, pp=self.settings.pp, dp=self.settings.dp)
            if self.settings.data_parallel == "hsdp":  # dp_shard checked against the world's dp (one message each)
                dp = self.topology.shape[0]
                dp_shard = resolve_dp_shard(dp, self.settings.dp_shard, self.num_nodes) if dp > 1 else 1
                self.topology = dataclasses.replace(self.topology, dp_shard=dp_shard)
            if self.settings.data_parallel == "fsdp" and self.topology.shape[0] == 1:
                raise ValueError(
                    f"ThreeDStrategy(data_parallel='fsdp') shards over the data-parallel ranks, but dp = world // "
                    f"(tp * pp) = {world} // ({self.settings.tp} * {self.settings.pp}) = 1: there is nothing to shard "
                    "over. Use data_parallel='replicate' at dp=1, or more processes."
                )
            if self.settings.grad_reduce_dtype is not None and self.topology.shape[0] == 1:
                raise ValueError(
                    grad_reduce_dp1_message(
                        self.settings.grad_reduce_dtype,
                        f"dp = world // (tp * pp) = {world} // ({self.settings.tp} * {self.settings.pp}) = 1",
                    )
                )

    def _launched_processes(self) -> list[Any]:
        """The processes this rank's launcher started (rank 0 under Lightning's launcher; none elsewhere)."""
        launcher = self.launcher
        return list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.topology is not None and self.cluster_environment is not None
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        kwargs: dict[str, Any] = {"timeout": self.settings.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        # Lightning calls the callbacks' setup next: EMA's and SWA's copies are deferred (core/weight_averaging.py)
        trainer = getattr(self.lightning_module, "_trainer", None)
        self._patches.install("deferred_copies", defer_copies_to_setup_end, trainer.callbacks if trainer else [])
        # ---- reliability: layout check (before the mesh), fail-fast watch
        self._reliability.on_process_group_ready(
            self.topology, self.root_device, self.global_rank, self.barrier, self._launched_processes
        )
        if self._mesh is None:  # later trainer.validate / test / predict calls reuse the mesh
            self._mesh = self.topology.build_mesh(self.root_device.type)
            if self.topology.dp_shard is not None:  # new process groups: once, on every rank alike
                self._hsdp_mesh = self.topology.build_hsdp_mesh(self._mesh)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh

    # ------------------------------------------------------------------ model construction
    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; each rank later materialises only its shard."""
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        # compiled code under a two-pass backward, for this fit (a later fit of the same Trainer sets it again)
        self._patches.install("split_backward", for_split_backward, self.settings.splits_backward())
        self._patches.install("finetuning", filter_by_identity_while_running, trainer.callbacks)
        self._tied_checked_epoch = -1
        if self.runner is None:
            self._parallelize()
        # a split backward's W computes the linear layers' weight gradients that I kept (core/weight_grad_store.py)
        assert self.runner is not None
        modules = [stage.module for stage in self.runner.runtime.stages]
        defer = self.settings.defers_linear_weight_grads()
        self._patches.install("weight_grads", defer_linear_weight_grads, modules, defer)
        _quiet_known_warnings()
        self.model = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]
        scaler = scaler_of(self.precision_plugin)
        self.loss_scaler = LossScaler(scaler, self.root_device) if scaler is not None else None
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        rebuild_averaged_copies(trainer.callbacks, self.lightning_module)
        assert self.topology is not None
        self._patches.lift("epoch_end")
        plan = self.stage_plan
        if plan is not None and self.topology.pp > 1:  # epoch-end hooks log the last stage's values everywhere
            ranks = plan.stage_to_rank or list(range(plan.num_stages))
            holds_last = ranks[-1] == self.device_mesh["pp"].get_local_rank()
            pp_group = self.device_mesh["pp"].get_group()
            module, callbacks = self.lightning_module, trainer.callbacks
            self._patches.install("epoch_end", relay_epoch_end, module, holds_last, pp_group, callbacks)
        self._patches.lift("save_guard")
        if self.topology.world_size > 1:  # a Hugging Face model's save_pretrained would write this rank's part
            self._patches.install("save_guard", ckpt_hf.guard_save_pretrained, self.lightning_module, self._rank_part())
        group = self.device_mesh["pp"].get_group() if self.topology.pp > 1 else None
        spec = list(self.full_spec)
        self._patches.install("pruning", prune_this_stage, trainer.callbacks, self.lightning_module, spec, group)
        count_by_replica(trainer.callbacks, self.topology.world_size, self.topology.dp)
        coords = self.topology.coordinates(self.global_rank)  # one rank per replica writes its predictions
        writes = coords["pp"] == 0 and coords["tp"] == 0
        self._patches.install("prediction_writers", write_once_per_replica, trainer.callbacks, writes)
        # rank 0's model summary table: the unsplit model's layers and counts (it holds one stage)
        module, unsplit, example = self.lightning_module, self._unsplit, self._example_input
        self._patches.install("model_summary", whole_model_summary, trainer.callbacks, module, unsplit, example)

    def _rank_part(self) -> str:
        """This rank's part of the model, in words (for messages)."""
        assert self.topology is not None
        coords = self.topology.coordinates(self.global_rank)
        plan = self.stage_plan
        ranks = [] if plan is None else (plan.stage_to_rank or list(range(plan.num_stages)))
        held = [stage for stage, rank in enumerate(ranks) if rank == coords["pp"]]
        stages = f"pipeline stage(s) {held} of {len(ranks)}" if len(ranks) > 1 else "the whole pipeline"
        return f"its part of the model ({stages}, tensor-parallel shard {coords['tp']} of {self.topology.tp})"

    @override
    def model_to_device(self) -> None:
        # Layers are placed on the device one by one while being materialised in ``setup``.
        pass

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _validate_module(self, module: pl.LightningModule) -> None:
        assert self.topology is not None
        scaler = scaler_of(self.precision_plugin)  # a loss scaler other than torch.amp.GradScaler is refused
        if not module.automatic_optimization:  # pp = 1 only (``core/manual.py``)
            problem = manual_problem(self.topology.pp, scaler is not None)
            if problem is not None:
                raise mark_agreed(ValueError(problem))
        trainer = getattr(module, "_trainer", None)
        refuse_pruning(trainer.callbacks if trainer is not None else [], self.topology.dp, self.topology.tp)

    def _parallelize(self) -> None:
        """Split, shard and wrap the LightningModule (once per module); see ``parallelize.py``."""
        module = self.lightning_module
        assert module is not None and self.topology is not None
        self._validate_module(module)
        # a structure-only copy of the unsplit model (meta tensors, ~40 ms for a 32-layer Llama): a checkpoint file of
        # one device numbers its optimizer state in the order of the groups configure_optimizers makes for it
        self._unsplit = make_skeleton(module)
        s = self.settings
        # ---- reliability: planning may communicate (the compute partitioner times a share of the layers on each
        # rank and all-gathers the table), so the settings are agreed on first: ranks configured apart name the
        # difference instead of meeting in different collectives
        self._reliability.check_consistency(module, self.precision_plugin, None, settings_only=True)
        try:
            # every check that needs no communication (the compute partitioner's timing aside), on every rank alike
            model = plan_model(
                module,
                tp=s.tp,
                pp=s.pp,
                stages_per_rank=s.stages_per_rank,
                partitioner=s.partitioner,
                body=s.body,
                blocks=s.blocks,
                tp_plan=s.tp_plan,
                tp_autoplan=s.tp_autoplan,
                stages=s.stages,
                schedule=s.schedule,
                micro_batches=self.micro_batches,
                activation_checkpointing=s.activation_checkpointing,
            )
        except ValueError as err:
            # Every rank raises it alike (the consistency check below proves it): not a one-rank failure.
            self._reliability.check_consistency(module, self.precision_plugin, None, error=err)
            raise mark_agreed(err) from None
        self.body, self.stage_plan, self.plan, self.full_spec = (
            model.body,
            model.stage_plan,
            model.tp_plan,
            model.full_spec,
        )
        self._example_input = model.example_input
        layout = describe_layout(self.topology, self.device_mesh, module, model, self.schedule, self.micro_batches)
        # --- from here on ranks communicate
        # ---- reliability: the plan (tensor-parallel plan, stage split) agreed on before anything is built
        self._reliability.check_consistency(module, self.precision_plugin, model)
        seed = broadcast_seed(s.seed)
        built = build_stages(
            module,
            model,
            self.device_mesh,
            self.root_device,
            self.precision_plugin,
            seed,
            compile_kwargs(s.compile),
            s.activation_checkpointing,
            DataParallelPlan(
                s.data_parallel,
                self._sharding_mesh(),
                s.grad_reduce_dtype,
                s.fsdp_reshard_after_forward,
                bool(s.fsdp_reshard_after_backward),
                s.fsdp_unit,
                module_roots=not module.automatic_optimization,
            ),
        )
        self._compiled = built.compiled
        if built.compiled is not None:
            layout += "\n" + built.compiled.describe()
        self._tied = built.tied
        self.body_randomness = add_body_randomness(model, built.stages, self.device_mesh, self.root_device, seed)
        if built.checkpointed is not None:  # recomputations replay the region streams (core/checkpointing.py)
            built.checkpointed.randomness = self.body_randomness
            layout += "\n" + built.checkpointed.describe()
        self.runner = BatchRunner(
            module,
            model.body if built.executor is None else None,
            built.stages,
            model.stage_plan.num_stages,
            self.device_mesh,
            self.root_device,
            self.schedule,
            self.micro_batches,
            randomness=self.body_randomness,
            executor=built.executor,
            label_count=label_count_for(module, s.loss_weighting),
        )
        self._reliability.on_model_ready(module, built.stages, model.stage_plan.num_stages)  # ---- reliability
        self._layout = layout
        if s.print_layout and self.global_rank == 0:
            print(layout, flush=True)

    def describe_layout(self) -> str:
        """The mesh, the stages and the tensor-parallel plan, as printed once by rank 0."""
        return self._layout

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.runner is not None
        if not self.lightning_module.automatic_optimization:
            return self._manual_training_step(args, kwargs)
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        if self._compiled is not None:
            self._compiled.step_began()
        self._check_replica_batch("training_step", args)  # ---- reliability: one batch per replica
        if self._tied is not None and trainer.current_epoch != self._tied_checked_epoch:
            self._tied_checked_epoch = trainer.current_epoch  # once per epoch: where BaseFinetuning acts
            self._tied.check_trainable()
        flags = self._reliability.flags_request()  # ---- reliability: non-finite flags in the step's exchange
        if flags is None and self.loss_scaler is not None:  # fp16 overflow needs them under on_nonfinite="off" too
            flags = (self._reliability.n_flags, self._reliability.local_flags)
        result = self.runner.run(
            "training_step",
            args,
            self.precision_plugin,
            train=True,
            # 16-mixed: the last stage's loss times the loss scale (a device tensor), besides 1 / accumulate
            scale=1.0 / accumulate if self.loss_scaler is None else self.loss_scaler.loss_weight(1.0 / accumulate),
            defer_grad_sync=accumulate > 1 and trainer.fit_loop.epoch_loop._should_accumulate(),
            flags=flags,
            discard_prior_grads=previous_grads_discarded(trainer, self._zero_grad_hooks),
        )
        self._held_grads = result.grads  # Lightning's zero_grad runs next; backward() puts them back
        self._step_flags = result.flags
        self._reliability.after_train_step()  # ---- reliability: train_timeout after the first step
        report = self._compiled.first_step_report() if self._compiled is not None else None
        if report is not None and self.global_rank == 0:
            print(report, flush=True)
        return result.logs.loss(self.root_device)  # a device tensor: no host synchronisation

    def _manual_training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Manual optimization (pp = 1, ``core/manual.py``): the user's step as Lightning's strategies run it; its
        ``manual_backward`` and optimizer steps come back through :meth:`backward` and :meth:`optimizer_step`."""
        module = self.lightning_module
        assert module is not None
        if self._compiled is not None:
            self._compiled.step_began()
        self._check_replica_batch("training_step", args)  # ---- reliability: one batch per replica
        with self.precision_plugin.train_step_context():
            out = module.training_step(*args, **kwargs)
        self._reliability.after_train_step()  # ---- reliability: train_timeout after the first step
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward hook: the schedule already ran backward; hand its gradients over.

        ``on_before_backward`` / ``on_after_backward`` still run around it, after Lightning's ``zero_grad``,
        exactly where single-device training runs them.
        """
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:  # manual_backward: autograd here, as Lightning's own
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with self._gradient_hook_logs("backward"):
            return self._backward(closure_loss)

    def _backward(self, closure_loss: Tensor) -> Tensor:
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        held, self._held_grads = self._held_grads, None
        if held is not None:
            if self._tied is not None:  # this batch's gradients of weights tied across stages: summed once
                self._tied.sum_grads(held.params, held.grads)
                self._reliability.scan_norms.clear()  # summed in place by a collective: the scan's norms are stale
            held.restore()
        flags, self._step_flags = self._step_flags, None
        if self.loss_scaler is not None and flags is not None:  # 16-mixed: a non-finite gradient is an overflow
            flags = self.loss_scaler.observe(flags)
        self._reliability.after_backward(closure_loss, flags)  # ---- reliability: non-finite loss / gradients
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; under ``precision="16-mixed"`` the plugin's ``GradScaler`` is driven from the
        overflow every rank agreed on (``core/loss_scale.py``) instead of a local inf check. DTensor parameters are
        stepped over their local tensors where the user left the implementation to torch (``core/optim.py``).
        The ``self.log`` calls of ``on_before_optimizer_step`` (which runs after the closure) are merged over the
        pipeline stages (``core/hook_logs.py``)."""
        with contextlib.ExitStack() as after_closure, optimizer_for_dtensors(optimizer):

            def closure_then_hooks() -> Any:
                out = closure()
                if not after_closure_entered:
                    after_closure_entered.append(True)
                    after_closure.enter_context(self._gradient_hook_logs("optimizer_step"))
                return out

            after_closure_entered: list[bool] = []
            if self.loss_scaler is None:
                out = super().optimizer_step(optimizer, closure_then_hooks, model, **kwargs)
                module = self.lightning_module
                if module is not None and not module.automatic_optimization:
                    reshard_roots(module)  # the next forward gathers the stepped weights (``core/manual.py``)
                return out
            model = model or self.lightning_module
            assert model is not None
            return self.loss_scaler.optimizer_step(
                optimizer,
                closure_then_hooks,
                lambda: self.precision_plugin._after_closure(model, optimizer),
                model.trainer.global_step,
                **kwargs,
            )

    def _gradient_hook_logs(self, window: str) -> contextlib.AbstractContextManager[None]:
        """Around a window of gradient hooks (``core/hook_logs.WINDOWS``): under pp > 1 their ``self.log`` calls are
        exchanged over the pipeline group and every rank logs what one device would."""
        module = self.lightning_module
        if self.pp == 1 or module is None:
            return contextlib.nullcontext()
        if self._hook_logs is None:
            self._hook_logs = HookLogs(self.device_mesh["pp"].get_group())
        return self._hook_logs.window(window, module, module.trainer.callbacks)

    def _no_step_to_clip_for(self) -> bool:
        if self._reliability.step_skipped:  # ---- reliability: on_nonfinite="skip" dropped every gradient
            return True
        return self.loss_scaler is not None and self.loss_scaler.step_skipped  # 16-mixed overflow

    def _clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        if not self._no_step_to_clip_for():
            clip_grads_by_value_([p for group in optimizer.param_groups for p in group["params"]], float(clip_val))

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self._no_step_to_clip_for():
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        counted = self._tied.for_norm(params) if self._tied is not None else params
        self.last_grad_norm = self.grad_norm(counted)
        clip_grads_(params, float(clip_val), self.last_grad_norm)

    def grad_norm(self, parameters: list[Tensor] | None = None, norm_type: float = 2.0) -> Tensor:
        """The 2-norm of the whole model's gradients (all stages and shards), equal on every rank."""
        assert self.lightning_module is not None
        params = list(self.lightning_module.parameters()) if parameters is None else parameters
        if parameters is None and self._tied is not None:
            params = self._tied.for_norm(params)  # a weight tied across stages counts once
        mesh = self.device_mesh
        return global_grad_norm(
            params,
            norm_type,
            tp_group=mesh["tp"].get_group() if self.tp > 1 else None,
            pp_group=mesh["pp"].get_group() if self.pp > 1 else None,
            dp_group=self._grad_shard_group(),
            known=self._reliability.scan_norms,  # the non-finite scan's norms: no second pass over the gradients
        )

    def _sharding_mesh(self) -> DeviceMesh:
        """The mesh the stages are data-parallel over: dp, or HSDP's 2-D (dp_replicate, dp_shard) view of it."""
        if self._hsdp_mesh is not None:
            return self._hsdp_mesh[HSDP_DIMS]
        return self.device_mesh["dp"]

    def _grad_shard_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks hold disjoint shards of each gradient (``None``: whole gradients on every dp
        rank). HSDP's gradients are sharded over dp_shard and identical over dp_replicate: summed over dp_shard."""
        if self._hsdp_mesh is not None:
            return self._hsdp_mesh["dp_shard"].get_group()
        return self.device_mesh["dp"].get_group() if self.settings.data_parallel == "fsdp" else None

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, args: tuple[Any, ...]) -> Any:
        """Forward-only through the pipeline. Returns the step's output (joined over micro-batches) on the
        last stage; ``predict_step`` outputs are returned on every stage (rank 0 included), others are
        ``None`` outside the last stage."""
        assert self.runner is not None
        self._check_replica_batch(hook, args)  # ---- reliability: one batch per replica
        return self.runner.run(hook, args, self.precision_plugin, train=False).outputs

    def _check_replica_batch(self, hook: str, args: tuple[Any, ...]) -> None:
        assert self.topology is not None
        self._reliability.check_replica_batch(
            hook,
            args[0] if args else None,
            lambda: self.device_mesh["dp"].get_local_rank(),  # only when compared: slicing the mesh reads a tensor
            self.topology.dp,
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", args)

    # ------------------------------------------------------------------ weights
    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> LoadReport:
        """Load a single-device state dict (e.g. pretrained weights) into this rank's shard of the model."""
        assert self.lightning_module is not None  # (a tied weight may come under either or both of its names)
        return load_full_state_dict(self.lightning_module, state_dict, full_keys=self.full_spec.keys(), strict=strict)

    def save_hf(self, path: str | os.PathLike, module_attr: str | None = None) -> Path | None:
        """Write the Hugging Face model the LightningModule holds as a ``from_pretrained`` folder, as its own
        ``save_pretrained`` writes it on one device (collective: call it on every rank; rank 0 writes). A PEFT
        model (``get_peft_model``) is written as its ``save_pretrained`` does: its adapters.

        Args:
            path: the folder to write.
            module_attr: the model's attribute path in the LightningModule, when it holds several.

        Returns:
            ``path`` on rank 0, ``None`` elsewhere.
        """
        assert self.lightning_module is not None
        saved = ckpt_hf.model_to_save(self.lightning_module, module_attr)  # every rank: the same error
        state = self.full_state_dict()  # the whole model on rank 0 (collective)

        def write() -> Path:
            assert state is not None
            return saved.write(state, path)

        return on_rank0_told(self.global_rank == 0, self.broadcast, write, f"write the Hugging Face folder {path!s}")

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The single-device state dict of the whole model, on global rank 0 (``None`` elsewhere), tied weights
        under each of their names as in one process. Collective."""
        assert self.lightning_module is not None
        mesh = self.device_mesh
        writer = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        state = gather_full_state_dict(self.lightning_module, writer=writer)
        return None if state is None else with_alias_keys(state, self.lightning_module)

    # ---- checkpoints: sharded DCP folders, written atomically, loadable at any layout (see checkpoint/)
    def _checkpoint_context(self) -> ckpt.CheckpointContext:
        assert self.lightning_module is not None and self.topology is not None
        return ckpt.CheckpointContext(
            module=self.lightning_module,
            topology=self.topology,
            global_rank=self.global_rank,
            device=self.root_device,
            stages=self.stage_plan.layer_names if self.stage_plan is not None else None,
            full_spec=self.full_spec,
            optimizers=tuple(self.optimizers),
            randomness=self.body_randomness,
            broadcast=self.broadcast,
            barrier=self.barrier,
        )

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards are loaded into the split, sharded model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer states itself

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done by load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done by load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        if self._reliability.refuse_save_after_failure(interrupted, sys.exc_info()[1], filepath):  # ---- reliability
            return
        ckpt.save_checkpoint(self._checkpoint_context(), checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        if path.is_file():  # a checkpoint file of one device or DDP: scaling a run up
            return load_lightning_file(self._checkpoint_context(), path, weights_only, self._unsplit)
        return ckpt.load_checkpoint(self._checkpoint_context(), path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        ckpt.remove_checkpoint(filepath, self.global_rank)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """``self.log(..., sync_dist=True)`` outside the relayed steps: over the data-parallel replicas, as DDP's
        ranks are. Not over the world: tensor-parallel ranks hold the same value (a ``"sum"`` would count it tp
        times) and pipeline stages log their own keys (a world collective would pair different keys, or wait)."""
        if isinstance(tensor, Tensor):
            if group is None and _distributed_is_initialized() and self._mesh is not None:
                group = self.device_mesh["dp"].get_group()
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``self.all_gather``: over the data-parallel replicas unless a group other than the world is named (the
        LightningModule passes the world when the user names none), as DDP's ranks are: tensor-parallel ranks hold
        the same values, and in a pipelined step the code after the model call runs on the last stage only, where
        a world collective would wait for the other stages forever. The result is ``(dp, *tensor.shape)``."""
        if (group is None or group is dist.group.WORLD) and _distributed_is_initialized() and self._mesh is not None:
            group = self.device_mesh["dp"].get_group()
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's decision (a checkpoint's, early stopping's), over the whole world."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    # ---- reliability: fail fast, and a barrier that names missing ranks
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._reliability.on_exception(exception)

    def diagnose_barrier(self, timeout: timedelta | float = 60.0) -> None:
        """A barrier over all ranks that names the ranks not arriving within ``timeout`` (collective; gloo's
        ``monitored_barrier``, with a temporary gloo group under NCCL)."""
        diagnose_barrier(timeout)

    @override
    def teardown(self) -> None:
        self._reliability.teardown()  # ---- reliability
        # the model stays split and sharded after teardown: its save_pretrained stays refused (until a next setup)
        self._patches.lift_all(keep=("save_guard",))
        if self.lightning_module is not None and self._example_input is not None:
            self.lightning_module._example_input_array = self._example_input
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("3d", cls, description="Tensor x pipeline x data parallel (lightning_3d)")


def _settings_from(kwargs: dict[str, Any]) -> ThreeDSettings:
    """``ThreeDSettings(**kwargs)``, with an unknown name reported with the list of settings."""
    unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(ThreeDSettings)})
    if unknown:
        names = ", ".join(f.name for f in dataclasses.fields(ThreeDSettings))
        raise TypeError(f"ThreeDStrategy: unknown setting(s) {unknown}; the settings are: {names}.")
    return ThreeDSettings(**kwargs)


def _quiet_known_warnings() -> None:
    """Silence warnings that do not apply under this strategy (each rank would print them).

    * Lightning recommends ``sync_dist=True`` for epoch-level values; the values the strategy replays from the
      last stage are already combined over micro-batches and replicas and identical on every rank.
    * FSDP2 (``replicate``, ``fully_shard``) warns when a stage returns a view (tensor-parallel outputs are views of
      DTensor locals); stage outputs are only sent to the next stage, and the last stage hands the user a copy.
    * Lightning 2.6's pytree helper uses an API torch deprecated (``LeafSpec``); nothing a user can act on.
    """
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((Replicate|FSDP)\w+\) returned a view tensor")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
