"""``ThreeDStrategy``: a Lightning strategy for tensor x pipeline x data parallel training.

This file is the orchestrator only: Lightning's hooks, each delegating to one module per concept:

==========================  ====================================================================
core/topology.py            (dp, pp, tp) degrees, their validation, the named device mesh
core/partition.py           finding the ``nn.Sequential`` body, splitting it into stages, pruning
core/tensor_parallel/       the automatic / explicit tensor-parallel plan (DTensor styles)
core/materialize.py         meta-device layers materialised one at a time; full <-> sharded weights
core/data_parallel.py       ``replicate`` over the dp mesh
core/parallelize.py         the three applied in one fixed order: stages, tensor parallel, data parallel
core/pipeline.py            ``PipelineStage`` + schedules, cached per micro-batch shape
core/rng.py                 the body's random streams: per stage, per tp rank in sharded regions
core/runner.py, step.py     one batch of the user's hook through the pipeline; gradients handed over
core/log_relay.py           ``self.log`` from the last stage to every rank (metric_sync.py: torchmetrics)
core/grad_norm.py           the global gradient norm for clipping
checkpoint/                 sharded, atomic, layout-independent checkpoints (``python -m`` CLI)
reliability.py              consistency check, timeouts, non-finite agreement, fail-fast wiring
tools/                      opt-in: pipeline timeline, fail-fast watch, data-parallel check
==========================  ====================================================================
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
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
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from .core import partition
from .core.agreed import mark_agreed
from .core.grad_norm import clip_grads_, global_grad_norm
from .core.materialize import LoadReport, gather_full_state_dict, load_full_state_dict
from .core.parallelize import (
    ParallelConfig,
    add_body_randomness,
    broadcast_seed,
    build_stages,
    describe_layout,
    plan_model,
)
from .core.pipeline import is_multi_stage, min_micro_batches, schedule_class
from .core.rng import BodyRandomness
from .core.runner import BatchRunner
from .core.step import HeldGrads
from .core.tied import TiedWeights, canonical_names
from .core.topology import Topology
from .reliability import Reliability, as_timedelta, diagnose_barrier  # ---- reliability

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class ThreeDStrategy(ParallelStrategy):
    """Tensor x pipeline x data parallel training of an ordinary LightningModule.

    The LightningModule keeps its single-device code: its model body is one ``nn.Sequential`` that
    ``forward`` applies, ``training_step`` calls ``self(x)`` and returns the loss (see the README's contract).

    Args:
        tp: tensor-parallel degree: each layer's matrices are split over ``tp`` ranks (Megatron layout).
        pp: pipeline-parallel degree: the body's layers are split into ``pp`` stages.
        dp: data-parallel degree; ``None`` infers ``world_size // (tp * pp)``.
        micro_batches: micro-batches per batch (per data-parallel replica); ``None`` means ``pp`` (the fewest
            1F1B accepts). More micro-batches shrink the pipeline bubble ``(pp - 1) / (m + pp - 1)``.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``; with ``stages_per_rank > 1`` a multi-stage schedule such
            as ``"interleaved1f1b"``.
        stages_per_rank: pipeline stages per rank (virtual stages for interleaved schedules).
        tp_plan: explicit tensor-parallel plan ``{"glob pattern of module name": "colwise" | "rowwise" |
            "colwise_gather" | "vocab" | "sequence" | "replicate" | ParallelStyle}``; it overrides the automatic
            plan for the modules it matches. A ``tp_plan`` attribute on the LightningModule works the same.
        tp_autoplan: find the plan for standard blocks automatically from the data flow.
        partitioner: ``"uniform"`` (layers per stage), ``"parameters"`` or a callable.
        body: dotted name of the ``nn.Sequential`` body when the module has several (the Sequential contract).
        blocks: dotted name of the block container (``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``) to
            split into pipeline stages; default: a Hugging Face model's declared one, else the container of
            same-type blocks holding most parameters.
        seed: seed for initialising layers built in ``configure_model``; ``None`` takes rank 0's
            ``torch.initial_seed()`` (set by ``seed_everything``).
        timeout: timeout of the process groups during setup (the first collectives wait for every rank to import,
            build and materialise its part of the model) and the first training step.
        train_timeout: timeout of every process group (and of pipeline sends and receives) once the first training
            step has finished: a rank that stops answering fails the others this soon. ``None`` keeps ``timeout``.
        on_nonfinite: a NaN or inf in the loss or in any gradient: ``"raise"`` (every rank raises
            ``NonFiniteError`` at the same step, before the optimizer steps), ``"skip"`` (every rank drops that
            optimizer step's gradients; the global step and LR schedulers still advance) or ``"off"``.
        check_consistency: compare a hash of the settings and the model structure across ranks at setup.
        fail_fast: when one rank fails, stop every rank within about a second (see ``failure_watch.py``).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device.
        print_layout: rank 0 prints the mesh, the stages and the tensor-parallel plan once.
    """

    strategy_name = "3d"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        micro_batches: int | None = None,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        tp_plan: Mapping[str, Any] | None = None,
        tp_autoplan: bool = True,
        partitioner: str | partition.Partitioner = "uniform",
        body: str | None = None,
        blocks: str | None = None,
        seed: int | None = None,
        timeout: timedelta | float | None = timedelta(minutes=30),
        train_timeout: timedelta | float | None = timedelta(minutes=10),  # ---- reliability
        on_nonfinite: str = "raise",  # ---- reliability
        check_consistency: bool = True,  # ---- reliability
        fail_fast: bool = True,  # ---- reliability
        process_group_backend: str | None = None,
        print_layout: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        schedule_class(schedule)  # unknown names fail here, with torch's list of names
        if stages_per_rank < 1:
            raise ValueError(f"ThreeDStrategy: stages_per_rank must be >= 1, got {stages_per_rank}.")
        if stages_per_rank > 1 and not is_multi_stage(schedule):
            raise ValueError(
                f"ThreeDStrategy(schedule={schedule!r}) runs one stage per rank; with "
                f"stages_per_rank={stages_per_rank} use a multi-stage schedule such as 'interleaved1f1b'."
            )
        if stages_per_rank == 1 and is_multi_stage(schedule):
            raise ValueError(f"ThreeDStrategy(schedule={schedule!r}) needs stages_per_rank >= 2.")
        minimum = min_micro_batches(schedule, pp)
        if micro_batches is not None and micro_batches < minimum:
            raise ValueError(
                f"ThreeDStrategy: micro_batches={micro_batches} < pp={pp} under schedule={schedule!r}: 1F1B keeps "
                f"one micro-batch in flight per stage, so it needs micro_batches >= {minimum}. Use micro_batches >= "
                f"{minimum} (more shrinks the bubble), or schedule='gpipe'."
            )
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"ThreeDStrategy: micro_batches must be >= 1, got {micro_batches}.")
        self.tp, self.pp, self._dp_arg = tp, pp, dp
        self.micro_batches = micro_batches if micro_batches is not None else max(1, minimum)
        self.schedule = schedule
        self.stages_per_rank = stages_per_rank
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self.tp_autoplan = tp_autoplan
        self.partitioner = partition.get_partitioner(partitioner)
        self.body_name = body
        self.blocks_name = blocks
        self.seed = seed
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._process_group_backend = process_group_backend
        self.print_layout = print_layout
        self.num_nodes = 1
        self.topology: Topology | None = None
        self._mesh: DeviceMesh | None = None
        # set at setup
        self.body: partition.BodyRef | None = None
        self.stage_plan: partition.StagePlan | None = None
        self.plan: Any = None
        self.full_spec: dict[str, partition.TensorSpec] = {}
        self.runner: BatchRunner | None = None
        self.body_randomness: BodyRandomness | None = None
        self._example_input: Any = None
        self._layout = ""
        self.last_grad_norm: Tensor | None = None
        self._held_grads: HeldGrads | None = None  # the last training batch's gradients, until backward()
        self._tied: TiedWeights | None = None
        # ---- reliability: consistency check, timeouts, non-finite agreement, fail-fast (reliability.py)
        self._reliability = Reliability(
            self, self._timeout, as_timedelta(train_timeout), on_nonfinite, check_consistency, fail_fast
        )

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
            self.topology = Topology(self.num_nodes * self.num_processes, tp=self.tp, pp=self.pp, dp=self._dp_arg)

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
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._reliability.on_process_group_ready()  # ---- reliability: layout check (before the mesh), watch
        if self._mesh is None:  # later trainer.validate / test / predict calls reuse the mesh
            self._mesh = self.topology.build_mesh(self.root_device.type)
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
        if self.runner is None:
            self._parallelize()
        _quiet_known_warnings()
        self.model = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        # Layers are placed on the device one by one while being materialised in ``setup``.
        pass

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _validate_module(self, module: pl.LightningModule) -> None:
        if not module.automatic_optimization:
            raise ValueError(
                "ThreeDStrategy runs forward and backward inside the pipeline schedule, so it needs automatic "
                "optimization; manual optimization (automatic_optimization=False) is not supported."
            )
        name = type(self.precision_plugin).__name__
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"ThreeDStrategy does not support loss scaling ({name} with a GradScaler, i.e. precision='16-mixed'): "
                "the pipeline runs backward itself. Use precision='bf16-mixed', '32-true' or '64-true'."
            )

    def _parallelize(self) -> None:
        """Split, shard and wrap the LightningModule (once per module); see ``parallelize.py``."""
        module = self.lightning_module
        assert module is not None and self.topology is not None
        self._validate_module(module)
        config = ParallelConfig(
            self.tp,
            self.pp,
            self.stages_per_rank,
            self.partitioner,
            self.body_name,
            self.tp_plan,
            self.tp_autoplan,
            blocks=self.blocks_name,
        )
        try:
            model = plan_model(module, config)  # every check that needs no communication, on every rank alike
        except ValueError as err:
            # Every rank raises it alike (the consistency check below proves it): not a one-rank failure.
            self._reliability.check_consistency(None, None, error=err)
            raise mark_agreed(err) from None
        self.body, self.stage_plan, self.plan, self.full_spec = (
            model.body,
            model.stage_plan,
            model.tp_plan,
            model.full_spec,
        )
        self._example_input = model.example_input
        layout = describe_layout(self.topology, self.device_mesh, model, self.schedule, self.micro_batches)
        # --- from here on ranks communicate
        self._reliability.check_consistency(model.body, model.stage_plan)  # ---- reliability: FIRST collective
        seed = broadcast_seed(self.seed)
        built = build_stages(module, model, self.device_mesh, self.root_device, self.precision_plugin, seed)
        self._tied = built.tied
        self.body_randomness = add_body_randomness(model, built.stages, self.device_mesh, self.root_device, seed)
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
        )
        self._layout = layout
        if self.print_layout and self.global_rank == 0:
            print(layout, flush=True)

    def describe_layout(self) -> str:
        """The mesh, the stages and the tensor-parallel plan, as printed once by rank 0."""
        return self._layout

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None and self.runner is not None
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        result = self.runner.run(
            "training_step",
            args,
            self.precision_plugin,
            train=True,
            scale=1.0 / accumulate,
            defer_grad_sync=accumulate > 1 and trainer.fit_loop.epoch_loop._should_accumulate(),
        )
        self._held_grads = result.grads  # Lightning's zero_grad runs next; backward() puts them back
        self._reliability.after_train_step()  # ---- reliability: train_timeout after the first step
        logs = result.logs
        dtype = logs.loss_dtype or torch.get_default_dtype()
        return torch.tensor(logs.loss_total / max(logs.loss_weight, 1.0), dtype=dtype, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward hook: the schedule already ran backward; hand its gradients over.

        ``on_before_backward`` / ``on_after_backward`` still run around it, after Lightning's ``zero_grad``,
        exactly where single-device training runs them.
        """
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        held, self._held_grads = self._held_grads, None
        if held is not None:
            if self._tied is not None:  # this batch's gradients of weights tied across stages: summed once
                self._tied.sum_grads(held.params, held.grads)
            held.restore()
        self._reliability.after_backward(closure_loss)  # ---- reliability: non-finite loss / gradients
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self._reliability.step_skipped:  # ---- reliability: on_nonfinite="skip" dropped every gradient
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
        )

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, args: tuple[Any, ...]) -> Any:
        """Forward-only through the pipeline. Returns the step's output (joined over micro-batches) on the
        last stage; ``predict_step`` outputs are returned on every stage (rank 0 included), others are
        ``None`` outside the last stage."""
        assert self.runner is not None
        return self.runner.run(hook, args, self.precision_plugin, train=False).outputs

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
        assert self.lightning_module is not None
        aliases = canonical_names(self.lightning_module)  # a tied weight's second name (saved by some libraries)
        state_dict = {k: v for k, v in state_dict.items() if not (k in aliases and aliases[k] in state_dict)}
        return load_full_state_dict(self.lightning_module, state_dict, full_keys=self.full_spec.keys(), strict=strict)

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The single-device state dict of the whole model, on global rank 0 (``None`` elsewhere). Collective."""
        assert self.lightning_module is not None
        mesh = self.device_mesh
        writer = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        return gather_full_state_dict(self.lightning_module, writer=writer)

    # ---- checkpoints: sharded DCP folders, written atomically, loadable at any layout (see checkpoint.py;
    # imported where used so that `python -m lightning_3d.checkpoint` runs a module not yet imported)
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
        from . import checkpoint as ckpt

        assert self.lightning_module is not None
        return ckpt.model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from . import checkpoint as ckpt

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
        from . import checkpoint as ckpt

        ckpt.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from . import checkpoint as ckpt

        return ckpt.load_checkpoint(self, checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        from . import checkpoint as ckpt

        ckpt.remove_checkpoint(self, filepath)

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
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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


def _quiet_known_warnings() -> None:
    """Silence warnings that do not apply under this strategy (each rank would print them).

    * Lightning recommends ``sync_dist=True`` for epoch-level values; the values the strategy replays from the
      last stage are already combined over micro-batches and replicas and identical on every rank.
    * FSDP2 (``replicate``) warns when a stage returns a view (tensor-parallel outputs are views of DTensor
      locals); stage outputs are only sent to the next stage, and the last stage hands the user a copy.
    * Lightning 2.6's pytree helper uses an API torch deprecated (``LeafSpec``); nothing a user can act on.
    """
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)`")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(ReplicateSequential\) returned a view tensor")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
