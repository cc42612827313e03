"""Applying the three parallelisms to a LightningModule, in one fixed order.

``plan_model`` inspects the module and decides everything (the body, the stages, the tensor-parallel plan)
without communicating, so every rank reaches the same verdict and a bad configuration fails on every rank
before any of them waits on another. ``build_stages`` then applies the plan: prune the body to this rank's
stages, materialise and tensor-shard each kept layer in turn (a layer is whole only while it is being
sharded), and wrap each stage for data parallelism.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torchmetrics import Metric

from . import blocks, hf_outputs, partition, pieces, torch_compat
from . import tensor_parallel as tpmod
from .balance import ComputePartitioner, MemoryPartitioner, rank_balanced
from .block_calls import BlocksWithArguments, block_calls, first_calls, trace_input
from .blocks import sequential_blocks
from .boundary_check import check_stage_boundaries, make_skeleton
from .carry import CarryPlan
from .checkpointing import CheckpointedBlocks, checkpoint_blocks, chosen_blocks
from .compile import CompiledBlocks, compile_blocks
from .data_parallel import apply_data_parallel
from .fsdp import SHARDED_MODES, apply_fsdp
from .manual import data_parallel_roots
from .materialize import ShardedInit, check_materializable, has_meta_tensors, library_initializers, materialize
from .pipeline import StageSpec, activations_in_flight, stage_ranks
from .rng import BodyRandomness
from .stage_exec import StageExecutor, StageModule
from .tensor_parallel.hf_plan import HFPlan, hf_tp_plan
from .tensor_parallel.plan import HF_STYLE_OF
from .tied import TiedWeights, install_alias_hooks, retie, untie
from .topology import Topology, mesh_ranks_table


@dataclass
class ModelPlan:
    """What ``plan_model`` decided for a module.

    Two ways to run a model exist. A module whose model is ONE ``nn.Sequential`` with every parameter inside it
    (``split is None``) is split into stage ``Sequential``s that pass one tensor (``step.py`` runs the user's step
    around the pipeline). Any other module (``split`` set) is split at its block container, and every stage runs
    the user's step with the model arranged for that stage (``stage_exec.py``); at pp = 1 the one stage holds
    everything and needs no container.
    """

    body: partition.BodyRef
    stage_plan: partition.StagePlan
    tp_plan: tpmod.TPPlan
    full_spec: dict[str, partition.TensorSpec]
    example_input: Any
    is_meta: bool
    split: blocks.ModelSplit | None = None
    hf_plan: HFPlan | None = None  # a Hugging Face model's own tensor-parallel plan (root-relative names)
    # a meta-device copy of the unsplit model for the first-step boundary check (no example_input_array), or why
    # none could be made (``boundary_check.make_skeleton``)
    skeleton: nn.Module | str | None = None
    # the module the tensor-parallel plan is for when it is not the body: at pp = 1 without a block container, the
    # whole LightningModule (its names are the module's own)
    tp_root: nn.Module | None = None
    # a model split at its blocks under the automatic plan: the modules outside the blocks (embeddings, LM head),
    # by module-relative name (``tensor_parallel.resolve_outer_plan``); ``tp_plan`` is then the blocks' plan
    outer_plan: tpmod.TPPlan | None = None
    # what the stage boundaries carry besides the flowing tensor, found by the setup check (``carry.py``); ``None``:
    # found by the first step's check instead
    carry: CarryPlan | None = None


def _numel(module: nn.Module, names: Sequence[str]) -> int:
    """The parameters of the modules ``names`` (each counted once)."""
    unique = {id(p): p for name in names for p in module.get_submodule(name).parameters()}
    return sum(p.numel() for p in unique.values())


def plan_model(
    module: LightningModule,
    *,
    tp: int,
    pp: int,
    stages_per_rank: int = 1,
    partitioner: str | partition.Partitioner = "uniform",
    body: str | None = None,
    blocks: str | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    tp_autoplan: bool = True,
    stages: Sequence[Sequence[str]] | None = None,
    schedule: str = "1f1b",
    micro_batches: int | None = None,
    activation_checkpointing: int | str | None = None,
) -> ModelPlan:
    """Find the body, split it into stages and find the tensor-parallel plan; no communication.

    Args:
        module: the LightningModule (its layers may still be on the meta device).
        tp, pp, stages_per_rank, partitioner, body, blocks, tp_plan, tp_autoplan, stages, schedule: the settings of
            the same names (see ``lightning_3d.settings.ThreeDSettings``); the schedule decides which rank runs which
            stage.
        micro_batches: micro-batches per batch; given, ``partitioner="memory"`` counts the activations each stage
            holds under ``schedule`` (its action list), else 1F1B's ``p - s``.
        activation_checkpointing: the normalised setting (``checkpointing.checkpoint_every``); the memory
            partitioner counts what checkpointed blocks keep and recompute.

    Returns:
        The body, the stage split, the tensor-parallel plan, the whole model's tensor specs and the example input.

    Raises:
        ValueError: the module breaks the contract or the layout does not fit it (each message says why and
            what would work).
    """
    partitioner = partition.get_partitioner(partitioner)
    placement = stage_ranks(schedule, pp, stages_per_rank)
    if isinstance(partitioner, MemoryPartitioner) and micro_batches is not None:  # the schedule's own in-flight
        held = activations_in_flight(schedule, pp, stages_per_rank, micro_batches)
        partitioner = partitioner.for_schedule(held, schedule, activation_checkpointing)
    _check_no_meta_metrics(module)
    if stages is not None or not uses_sequential_body(module, body, blocks):
        plan = _plan_split_model(
            module, tp, pp, stages_per_rank, partitioner, blocks, tp_plan, tp_autoplan, stages, placement
        )
        if plan.split is not None and plan.split.container is not None:  # the schedule's placement (a V, or looping)
            plan.split.stage_to_rank = placement
            plan.stage_plan.stage_to_rank = list(placement)
        return plan
    found = partition.find_body(module, body)
    partition.check_no_outside_parameters(module, found)
    full_spec = partition.full_model_spec(module)
    example_input = module.example_input_array
    if isinstance(partitioner, (ComputePartitioner, MemoryPartitioner)):
        partitioner = partitioner.for_input(example_input)  # profiled on the module's example (meta, no compute)
    explicit = tp_plan if tp_plan is not None else getattr(module, "tp_plan", None)
    if tp == 1:
        resolved = tpmod.resolve_plan(found.module, 1, explicit=explicit, body_prefix=found.fqn)
    else:
        example = example_input if example_input is not None else tpmod.example_input_for(found.module)
        resolved = tpmod.resolve_plan(
            found.module,
            tp,
            explicit=explicit,
            body_prefix=found.fqn,
            example_input=example,
            auto=tp_autoplan,
        )
    # a layer with a tensor-parallel style on itself (not only on its children) is never cut between stages
    keep_whole = [n for n, _ in found.module.named_children() if "" in resolved.styles_for(n)] if tp > 1 else []
    stage_plan = partition.plan_stages(
        found, pp, partitioner, stages_per_rank, placement, example=example_input, keep_whole=keep_whole
    )
    if example_input is not None:
        # Lightning's model summary would run a forward on rank 0 alone; the strategy hides the example from it.
        module._example_input_array = None
    is_meta = has_meta_tensors(found.module)
    if is_meta:
        check_materializable(found.module, found.fqn)
    return ModelPlan(found, stage_plan, resolved, full_spec, example_input, is_meta)


def _check_no_meta_metrics(module: nn.Module) -> None:
    """torchmetrics states created in ``configure_model`` are on the meta device, and nothing can recreate their
    initial values (zeros, -inf, ...): refuse them with the fix instead of failing later in ``module.to``."""
    meta = [
        name
        for name, sub in module.named_modules()
        if isinstance(sub, Metric) and any(isinstance(v, torch.Tensor) and v.is_meta for v in sub.metric_state.values())
    ]
    if meta:
        raise ValueError(
            f"torchmetrics metrics created on the meta device (in configure_model): {', '.join(meta)}. Create "
            "metrics in the LightningModule's __init__; configure_model is for the layers."
        )


def uses_sequential_body(module: nn.Module, body: str | None, blocks: str | None) -> bool:
    """Whether the module follows the ``nn.Sequential`` body contract (one Sequential holding every parameter,
    or the one named with ``body=``); any other module is split at its blocks."""
    if body is not None:
        return True
    if blocks is not None:
        return False
    try:
        body = partition.find_body(module, None)
        partition.check_no_outside_parameters(module, body)
    except ValueError:
        return False
    return True


def _plan_split_model(
    module: LightningModule,
    tp: int,
    pp: int,
    stages_per_rank: int,
    partitioner: partition.Partitioner,
    blocks_name: str | None,
    explicit_plan: Mapping[str, Any] | None,
    tp_autoplan: bool,
    stages: Sequence[Sequence[str]] | None = None,
    schedule_placement: Sequence[int] | None = None,
) -> ModelPlan:
    """Plan a model split at its block container (or, at pp = 1, not split at all): by the partitioner, or by the
    user's per-stage module lists (``stages``); the stage boundaries are checked on fake tensors when the module
    has an ``example_input_array``, else before the first training step on a meta copy (``boundary_check.py``)."""
    full_spec = partition.full_model_spec(module)
    num_stages = pp * stages_per_rank
    costs: list[float] = []  # each stage's cost under the compute / memory partitioner, and as text
    estimates: list[str] = []
    try:
        container = blocks.find_blocks(module, blocks_name)
    except ValueError:
        if num_stages > 1 or blocks_name is not None or stages is not None:
            raise
        container = None
    if container is None:
        split = blocks.ModelSplit(None, [[]], [], [], [0], aliases=blocks.tied_parameters(module))
        body = partition.BodyRef(parent=module, attr="", fqn="", module=nn.Sequential())
    else:
        layers = [(name, torch_compat.child_modules(container.module)[name]) for name in container.names]
        if len(layers) < num_stages:
            raise ValueError(
                f"The block container {container.fqn!r} has {len(layers)} blocks but {num_stages} pipeline stages "
                "were asked for: every stage needs at least one block. "
                f"Use pp <= {len(layers) // stages_per_rank}."
            )
        placement: dict[str, int] = {}
        called_after: set[str] = set()
        called_before: set[str] = set()
        if num_stages > 1:  # a module registered before the blocks but run after them goes with the last stage
            # and one registered after the blocks but run before them with the first
            before, after = blocks.outside_modules(module, container)
            calls = first_calls(module, container.fqn, [*before, *after], module.example_input_array)
            called_before, called_after = calls[0] & set(after), calls[1] & set(before)
        if stages is not None:
            ranges, placement = blocks.stage_ranges_from_names(module, container, stages, num_stages)
        else:
            if type(partitioner) is partition.ParameterPartitioner and num_stages > 1:
                # the end stages' modules outside the blocks (embeddings, head, an encoder-decoder's encoder) count
                first, last = blocks.outside_modules(module, container, called_after, called_before)
                partitioner = partition.ParameterPartitioner(_numel(module, first), _numel(module, last))
            if isinstance(partitioner, (ComputePartitioner, MemoryPartitioner)):  # blocks profiled in the whole model
                partitioner = partitioner.for_blocks(module, [m for _, m in layers], module.example_input_array)
            ranges = partition.checked_ranges(partitioner, layers, num_stages, what="blocks")
            if isinstance(partitioner, (ComputePartitioner, MemoryPartitioner)):
                ranks = list(schedule_placement or [s % pp for s in range(num_stages)])
                ranges = rank_balanced(partitioner, layers, ranges, ranks)  # a rank's stages together
                costs = partitioner.stage_costs(layers, ranges)
                estimates = [partitioner.describe(c, stage) for stage, c in enumerate(costs)]
        split = blocks.split_model(
            module, container, pp, ranges, stages_per_rank, placement, called_after, called_before
        )
        parent_name, _, attr = container.fqn.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        body = partition.BodyRef(parent=parent, attr=attr, fqn=container.fqn, module=container.module)  # type: ignore[arg-type]
    stage_plan = partition.StagePlan(
        [list(b) for b in split.stage_blocks], body.fqn, list(split.stage_to_rank), estimates, costs
    )
    for sub in module.modules():  # Hugging Face models: no KV cache while training (it would only hold memory)
        hf_config = getattr(sub, "config", None)
        if getattr(hf_config, "use_cache", None):
            hf_config.use_cache = False
    explicit = explicit_plan if explicit_plan is not None else getattr(module, "tp_plan", None)
    tp_plan = tpmod.TPPlan()
    # A Hugging Face model's own plan when the user gives none (it checks heads / kv heads against tp)
    hf_plan = hf_tp_plan(module, tp) if tp > 1 and explicit is None else None
    declared_outer: dict[str, str] | None = None
    if hf_plan is not None and container is not None and tp_autoplan:
        # a plan that names only the embeddings and the head (HunYuan, LFM2, GPT-OSS): its entries kept as the outer
        # plan's, the blocks analysed as those of a model without a plan
        declared_outer = _outer_only(hf_plan, container.fqn)
        if declared_outer is not None:
            hf_plan = None
    tp_root = None
    if hf_plan is None and container is None and (tp > 1 or explicit):
        # pp = 1 and no block container: the whole module, run on its example_input_array (else on an input made
        # for its first layer)
        tp_root = module
        tp_plan = tpmod.resolve_plan(
            module,
            tp,
            explicit=explicit,
            body_prefix="",
            example_input=module.example_input_array,
            auto=tp_autoplan,
            hint="set the LightningModule's example_input_array (one micro-batch's input) for the analysis to run "
            "its forward",
        )
    outer_explicit: Mapping[str, Any] | None = None
    if hf_plan is None and container is not None and (tp > 1 or explicit):
        # the user's patterns name modules in the blocks, outside them (embeddings, head), or both
        explicit, outer_explicit = tpmod.split_explicit(module, container.fqn, explicit) if explicit else (None, None)
        view, view_example, hint = _analysis_view(module, container, tp > 1 and tp_autoplan)
        tp_plan = tpmod.resolve_plan(
            view,
            tp,
            explicit=explicit,
            body_prefix=container.fqn,
            example_input=view_example,
            auto=tp_autoplan,
            hint=hint,
        )
    outer_plan = None
    outer_explicit = outer_explicit or declared_outer
    if hf_plan is None and container is not None and tp > 1 and (tp_autoplan or outer_explicit):
        root, example = trace_input(module, container.fqn, module.example_input_array) or ("", None)
        outer_plan = tpmod.resolve_outer_plan(
            module, tp, container.fqn, example, explicit=outer_explicit, auto=tp_autoplan, root=root
        )
    is_meta = has_meta_tensors(module)
    if is_meta:
        check_materializable(module, "", library_initializers(module))
    example_input = module.example_input_array
    carry = None
    if example_input is not None:
        # Lightning's model summary would run a forward on rank 0 alone; the strategy hides the example from it.
        module._example_input_array = None
        if split.num_stages > 1:
            checked = check_stage_boundaries(module, split, example_input)
            if checked.not_checked:
                rank_zero_warn(
                    f"lightning_3d: forward(example_input_array) could not run on fake tensors "
                    f"({checked.not_checked}); what crosses the pipeline stage boundaries is checked at the first "
                    "training step instead."
                )
            else:
                carry = checked.carry
    skeleton = None
    if carry is None and split.num_stages > 1 and container is not None:
        skeleton = make_skeleton(module)  # before pruning: the first step checks the unsplit model's training_step
    return ModelPlan(
        body,
        stage_plan,
        tp_plan,
        full_spec,
        example_input,
        is_meta,
        split,
        hf_plan,
        skeleton,
        tp_root,
        outer_plan,
        carry,
    )


def _analysis_view(module: nn.Module, container: blocks.BlockContainer, auto: bool) -> tuple[nn.Module, Any, str]:
    """The blocks as the tensor-parallel analysis runs them, their input, and what to add if the analysis fails.

    Blocks the model's forward calls with more than the hidden states (rotary tables, masks) run with those
    arguments (``block_calls.py``), found from one forward on fake tensors of the module's ``example_input_array``,
    or without one, of the Hugging Face model holding the blocks on its own ``dummy_inputs``; otherwise (no input,
    or nothing more to pass) the blocks run one after the other on a ``(1, 2, hidden)`` input."""
    children = OrderedDict(container.module.named_children())
    plain = nn.Sequential(children)
    if not auto:
        return plain, _block_example(plain), ""
    traced = trace_input(module, container.fqn, getattr(module, "example_input_array", None))
    if traced is None:
        hint = (
            "blocks called with more than the hidden states (rotary tables, masks) are analysed as the model's "
            "forward calls them when you set the LightningModule's example_input_array (one micro-batch's input)"
        )
        return plain, _block_example(plain), hint
    root_name, example = traced
    found = block_calls(module.get_submodule(root_name), list(children.values()), example)
    if isinstance(found, str):
        return plain, _block_example(plain), f"the blocks were run alone because {found}"
    if not any(call.takes_more() for call in found):
        return plain, _block_example(plain), ""
    param = next(plain.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return BlocksWithArguments(children, found, device), found[0].hidden.zeros(device), ""


def _block_example(view: nn.Module) -> torch.Tensor | None:
    """A (1, 2, hidden) input for the blocks, hidden taken from the first block's first LayerNorm / Linear."""
    first = next(view.children(), None)
    if first is None:
        return None
    param = next(first.parameters(), None)
    for sub in first.modules():
        if isinstance(sub, nn.LayerNorm) and len(sub.normalized_shape) == 1:
            size = sub.normalized_shape[0]
        elif isinstance(sub, nn.Linear):
            size = sub.in_features
        else:
            continue
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None else torch.get_default_dtype()
        return torch.zeros(1, 2, size, device=device, dtype=dtype)
    return None


@dataclass
class BuiltStages:
    """What ``build_stages`` made on this rank.

    Attributes:
        stages: this rank's stages (tensor- and data-parallel already).
        executor: runs the user's step on each stage (split models only; ``None`` for a Sequential body).
        tied: this rank's copies of weights tied across the first and last stage (``None`` when there are none).
        compiled: the blocks compiled with ``torch.compile`` (``None`` when the ``compile`` setting is off).
        checkpointed: the blocks under activation checkpointing (``None`` when the setting is off).
    """

    stages: list[StageSpec]
    executor: StageExecutor | None = None
    tied: TiedWeights | None = None
    compiled: CompiledBlocks | None = None
    checkpointed: CheckpointedBlocks | None = None


def broadcast_seed(seed: int | None) -> int:
    """The run's initialisation seed, taken from rank 0 (``torch.initial_seed()`` when ``seed`` is None)."""
    holder = [seed if seed is not None else torch.initial_seed() % (2**62)]
    dist.broadcast_object_list(holder, src=0)
    return int(holder[0])


@dataclass(frozen=True)
class DataParallelPlan:
    """How :func:`build_stages` makes each stage data-parallel: the settings of the same names, in one place.

    Attributes:
        mode: ``"replicate"`` (gradient buckets over ``mesh["dp"]``), ``"fsdp"`` or ``"hsdp"`` (FSDP2 units over
            ``mesh``, see ``fsdp.py``).
        mesh: what FSDP shards over: ``mesh["dp"]``, or HSDP's (dp_replicate, dp_shard) view of dp; ``None``:
            the build's ``mesh["dp"]``.
        reduce_dtype: ``"bf16"``/``"fp16"``: the dtype of the gradient reduction (``None``: the parameters').
        reshard_after_forward / reshard_after_backward / unit: the ``fsdp_*`` settings of those names.
        module_roots: manual optimization: each module a stage holds is a root of its own, the stage module none
            (``manual.data_parallel_roots``).
    """

    mode: str = "replicate"
    mesh: DeviceMesh | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = False
    unit: str = "block"
    module_roots: bool = False

    @property
    def sharded(self) -> bool:
        """Whether parameters are sharded over dp (FSDP or HSDP), not replicated."""
        return self.mode in SHARDED_MODES

    def wrap(self, module: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh, precision: Precision) -> nn.Module:
        """``module`` (a stage) made data-parallel, each of ``blocks`` its own FSDP unit (or, with
        ``unit="submodule"``, its parameter-owning submodules) or its own gradient bucket where it can be."""
        if self.sharded:
            return apply_fsdp(
                module,
                blocks,
                mesh["dp"] if self.mesh is None else self.mesh,
                pp=mesh["pp"].size(),
                precision=precision,
                reduce_dtype=self.reduce_dtype,
                reshard_after_forward=self.reshard_after_forward,
                reshard_after_backward=self.reshard_after_backward,
                unit=self.unit,
            )
        return apply_data_parallel(module, mesh["dp"], blocks=blocks, reduce_dtype=self.reduce_dtype)

    def wrap_stage(
        self,
        stage: nn.Module,
        blocks: Sequence[nn.Module],
        held: Sequence[nn.Module],
        mesh: DeviceMesh,
        precision: Precision,
        owner: nn.Module | None = None,
    ) -> nn.Module:
        """``stage`` made data-parallel (:meth:`wrap`), or, with ``module_roots``, each of its modules (``held``, or
        ``owner``'s children) wrapped as a root of its own and ``stage`` returned as it is."""
        if not self.module_roots:
            return self.wrap(stage, blocks, mesh, precision)
        if mesh["dp"].size() > 1 or self.sharded:
            for root in data_parallel_roots(held, owner):
                self.wrap(root, [], mesh, precision)
        return stage


def build_stages(
    module: LightningModule,
    model: ModelPlan,
    mesh: DeviceMesh,
    device: torch.device,
    precision: Precision,
    seed: int,
    compile_kwargs: Mapping[str, Any] | None = None,
    checkpointing: int | str | None = None,
    dp_plan: DataParallelPlan | None = None,
) -> BuiltStages:
    """Prune, materialise, tensor-shard, checkpoint activations (``checkpointing`` not ``None``: see
    ``checkpointing.py``), compile (``compile_kwargs`` not ``None``: each block, see ``compile.py``) and
    data-parallel-wrap this rank's stages (in that order) as ``dp_plan`` says (``None``: ``replicate`` over
    ``mesh["dp"]``, gradients reduced in the parameters' dtype; see :class:`DataParallelPlan`). A meta-device
    model under ``"fsdp"`` or ``"hsdp"`` is materialised directly as this rank's shards
    (``materialize.ShardedInit``)."""
    dp_plan = DataParallelPlan() if dp_plan is None else dp_plan
    if mesh["tp"].size() > 1:  # Trainer(detect_anomaly=True) checks tensor-parallel gradients too
        torch_compat.shard_nan_check()
    if model.split is not None:
        return _build_split_stages(
            module,
            model,
            mesh,
            device,
            precision,
            seed,
            compile_kwargs,
            checkpointing,
            dp_plan,
        )
    body, stage_plan = model.body, model.stage_plan
    pp_rank = mesh["pp"].get_local_rank()
    my_stages = [s for s in range(stage_plan.num_stages) if stage_plan.stage_to_rank[s] == pp_rank]
    held_names = [name for s in my_stages for name in stage_plan.layer_names[s]]  # layers, or parts ("5#0-1")
    keep = list(dict.fromkeys(pieces.layer_of(n) for n in held_names))
    # which layers are blocks is decided over the whole body, before pruning (a rank may hold one block only)
    layers_now = [(n, m) for n, m in torch_compat.child_modules(body.module).items() if m is not None]
    block_names = [n for n, _ in sequential_blocks(layers_now)]
    parts = pieces.build_parts(body.module, held_names)  # traced while the layers are whole
    partition.prune_body(body, keep)
    for layer, held in pieces.held_parts(held_names).items():  # another rank trains the rest of these layers
        pieces.prune_layer(body.module.get_submodule(layer), [parts[str(p)] for p in held])
    precision.convert_module(module)
    tp = mesh["tp"].size()
    # FSDP / HSDP on a meta model: shard while on meta, then allocate and fill only this rank's shards (materialize.py)
    deferred = None
    if model.is_meta and dp_plan.sharded:
        named = torch_compat.child_modules(body.module)
        deferred = ShardedInit([(f"{body.fqn}.{n}", named[n]) for n in keep])  # type: ignore[misc]
    for name in keep:
        layer = torch_compat.child_modules(body.module)[name]
        assert layer is not None
        if deferred is None and model.is_meta:
            with precision.tensor_init_context():  # values computed as Lightning would make them (64-true: float64)
                materialize(layer, device, seed, prefix=f"{body.fqn}.{name}")
        elif deferred is None:
            layer.to(device)
        styles = _held_styles(layer, model.tp_plan.styles_for(name)) if tp > 1 else {}
        if styles:
            parallelize_module(layer, mesh["tp"], styles)
    if not model.is_meta:
        sync_replicas(body.module, mesh)
    if deferred is None:
        module.to(device)  # anything outside the body (metric states, buffers)
    containers = {s: partition.stage_container(body, stage_plan.layer_names[s], parts) for s in my_stages}
    held_modules = {
        f"{body.fqn}.{name}": torch_compat.child_modules(containers[s])[pieces.layer_of(name)]
        for s in my_stages
        for name in stage_plan.layer_names[s]
        if pieces.layer_of(name) in block_names
    }
    checkpointed, compiled = _checkpoint_and_compile(
        [f"{body.fqn}.{n}" for n in block_names],
        held_modules,  # type: ignore[arg-type]
        checkpointing,
        compile_kwargs,
    )
    stages = []
    for s in my_stages:
        container = containers[s]
        # every layer of a Sequential runs once per forward: each is a gradient bucket of its own
        held = [m for m in torch_compat.child_modules(container).values() if m is not None]
        # a Sequential body has no ties: every layer of the stage its own FSDP unit or gradient bucket
        wrapped = dp_plan.wrap_stage(container, held, held, mesh, precision)
        stages.append(StageSpec(s, wrapped))
    if deferred is not None:
        deferred.allocate([s.module for s in stages], device)
        with precision.tensor_init_context():
            deferred.fill(device, seed)
        module.to(device)
    return BuiltStages(stages, compiled=compiled, checkpointed=checkpointed)


# Hugging Face styles of embeddings and heads, as the automatic plan's names for the same layouts
_OUTER_STYLES = {HF_STYLE_OF[auto]: auto for auto in ("vocab", "colwise_gather")}


def _outer_only(hf_plan: HFPlan, container: str) -> dict[str, str] | None:
    """A Hugging Face plan that names no module in the blocks, only embeddings and heads, as ``{exact name: style
    name}`` for :func:`~lightning_3d.core.tensor_parallel.resolve_outer_plan`; None for any other plan."""
    names = list(hf_plan.entries)
    if any(n == container or n.startswith(container + ".") for n in names):
        return None
    if not names or any(hf_plan.entries[n].style not in _OUTER_STYLES for n in names):
        return None
    return {n: _OUTER_STYLES[hf_plan.entries[n].style] for n in names}  # module names hold no glob characters


def _held_styles(layer: nn.Module, styles: dict[str, Any]) -> dict[str, Any]:
    """The styles of ``styles`` whose submodule ``layer`` still holds (all of them, unless part of the layer was
    pruned because another stage holds it: ``pieces.py``)."""
    held = {n for n, _ in layer.named_children()}
    return {path: style for path, style in styles.items() if not path or path.split(".")[0] in held}


def _checkpoint_and_compile(
    all_blocks: list[str],
    held: dict[str, nn.Module],
    checkpointing: int | str | None,
    compile_kwargs: Mapping[str, Any] | None,
) -> tuple[CheckpointedBlocks | None, CompiledBlocks | None]:
    """After tensor parallelism, before data parallelism: compile each held block, then checkpoint the chosen
    blocks' activations around their (compiled) forward. ``all_blocks``: the whole model's blocks in order;
    ``held``: this rank's.

    The checkpoint goes outside the compiled code, not inside it as torchtitan puts it: its recompute context
    replays the tensor-parallel regions' random streams (``checkpointing.py``), and inside compiled code dynamo
    takes no such context for a checkpoint (only a pair of ``TorchDispatchMode`` contexts; the first call fails).
    Outside, torch's non-reentrant checkpoint runs the compiled forward again in the backward, under that replay,
    and drops what the compiled forward saved in between."""
    checkpointed = compiled = None
    if compile_kwargs is not None:
        compiled = compile_blocks(list(held.items()), compile_kwargs)
    if checkpointing is not None:
        chosen_names = set(chosen_blocks(all_blocks, checkpointing))  # a part of a block goes with its block
        chosen = [(n, m) for n, m in held.items() if pieces.layer_of(n) in chosen_names]
        checkpointed = checkpoint_blocks(chosen, checkpointing)
    return checkpointed, compiled


def _build_split_stages(
    module: LightningModule,
    model: ModelPlan,
    mesh: DeviceMesh,
    device: torch.device,
    precision: Precision,
    seed: int,
    compile_kwargs: Mapping[str, Any] | None = None,
    checkpointing: int | str | None = None,
    dp_plan: DataParallelPlan | None = None,
) -> BuiltStages:
    split = model.split
    assert split is not None
    pp_rank = mesh["pp"].get_local_rank()
    my_stages = [s for s in range(split.num_stages) if split.stage_to_rank[s] == pp_rank]
    if split.container is None:  # pp = 1 and no container: the one stage holds the whole module
        executor = StageExecutor(module, split, my_stages, whole=True)
        held_names: list[str] = []
    else:
        executor = StageExecutor(module, split, my_stages, skeleton=model.skeleton, device=device, carry=model.carry)
        executor.prune()
        held_names = [n for s in my_stages for n in split.modules_of(s)]
    precision.convert_module(module)
    executor.convert_stand_ins(precision.convert_module)  # their parameters' dtypes read as the model's
    tp = mesh["tp"].size()
    # a V schedule puts the first and the last stage on one rank: with tensor or data parallelism each stage is
    # wrapped on its own, so a weight tied across them gets a copy per stage there, summed as across ranks
    ends = (split.stage_to_rank[0], split.stage_to_rank[-1])
    untied: list[tuple[str, ...]] = []
    if split.tied and ends[0] == ends[1] and pp_rank == ends[0] and (tp > 1 or mesh["dp"].size() > 1):
        untied = untie(module, split.tied)
    kept_ties = [group for group in split.aliases if tuple(group) not in untied]
    container = split.container
    blocks_of = {container.block_fqn(b): b for b in container.names} if container is not None else {}
    initializers = library_initializers(module) if model.is_meta else {}
    # FSDP / HSDP on a meta model split at its blocks: shard while on meta, then allocate and fill only this rank's
    # shards (materialize.py); without a block container the one module is materialised whole, as under replicate
    deferred = None
    if model.is_meta and dp_plan.sharded and held_names:
        deferred = ShardedInit([(n, module.get_submodule(n)) for n in held_names], initializers)
    for name in held_names or [""]:  # one module at a time: whole only while it is being sharded
        sub = module.get_submodule(name)
        if deferred is None and model.is_meta:  # (with deferred: on meta until its shards are allocated)
            retie(module, kept_ties, name)  # a head tied to an embedding materialised before it
            with precision.tensor_init_context():  # values computed as Lightning would make them (64-true: float64)
                materialize(sub, device, seed, prefix=name, initializers=initializers)
        elif deferred is None:
            sub.to(device)
        styles: dict[str, Any] = {}
        if tp > 1 and model.hf_plan is not None:
            styles = model.hf_plan.styles_for(name)
        elif tp > 1 and name in blocks_of:
            styles = model.tp_plan.styles_for(blocks_of[name])
        elif tp > 1 and model.tp_root is not None:
            styles = model.tp_plan.styles_for(name)
        elif tp > 1 and model.outer_plan is not None:
            styles = model.outer_plan.styles_for(name)
        if styles:
            parallelize_module(sub, mesh["tp"], styles)
    if model.is_meta and has_meta_tensors(module):  # modules on every stage: rotary tables, parameter-free
        exclude = deferred.modules if deferred is not None else ()
        with precision.tensor_init_context():
            materialize(module, device, seed, prefix="", initializers=initializers, exclude=exclude)
    if deferred is None:
        module.to(device)
    if not model.is_meta:
        sync_replicas(module, mesh)
    if tp > 1:  # attention weights Hugging Face records hold this rank's heads: all of them, as on one device
        hf_outputs.gather_recorded_heads(module, mesh["tp"], executor.recorders)
    install_alias_hooks(module, split.aliases)
    checkpointed, compiled = _checkpoint_and_compile(
        list(blocks_of),
        {n: module.get_submodule(n) for n in held_names if n in blocks_of},
        checkpointing,
        compile_kwargs,
    )
    stages = []
    for s in my_stages:
        held = {"": module} if container is None else {n: module.get_submodule(n) for n in split.modules_of(s)}
        stage_module = StageModule(s, held, executor)
        blocks = []  # the stage's transformer blocks: each a gradient bucket (or an FSDP unit) of its own
        if container is not None:
            blocks = [module.get_submodule(container.block_fqn(b)) for b in split.stage_blocks[s]]
        # embeddings, norm and head in the stage's root unit (or bucket)
        owner = module if container is None else None
        wrapped = dp_plan.wrap_stage(stage_module, blocks, list(held.values()), mesh, precision, owner)
        stages.append(StageSpec(s, wrapped))
    if deferred is not None:
        deferred.allocate([s.module for s in stages], device)
        with precision.tensor_init_context():
            deferred.fill(device, seed)
        module.to(device)
    # after tensor and data parallelism have put their parameter objects in place
    # (under a V schedule at dp = tp = 1 the first and the last stage share a rank and a tied weight is one tensor:
    # nothing to sum; with tp or dp > 1 that rank holds a copy per stage, summed there)
    # (the pp ranks of the first and the last stage follow the schedule's placement: a CSV list may put them anywhere)
    tied = None
    if split.tied and mesh["pp"].size() > 1 and ends[0] != ends[1]:
        tied = TiedWeights(module, split.tied, mesh, ends)
    elif untied:
        tied = TiedWeights.local(module, untied)
    if tied is not None:
        tied.broadcast_from_first()
    return BuiltStages(stages, executor, tied, compiled, checkpointed)


def add_body_randomness(
    model: ModelPlan, stages: list[StageSpec], mesh: DeviceMesh, device: torch.device, seed: int
) -> BodyRandomness:
    """Give this rank's stages their random streams (see ``rng.py``): one per stage, and one per tp rank inside
    each tensor-parallel region of the stage's layers."""
    randomness = BodyRandomness(seed, [s.index for s in stages], mesh["tp"].get_local_rank(), device)
    tp = mesh["tp"].size()
    for spec in stages:
        randomness.install_stage(spec.module, spec.index)
        if tp == 1:
            continue
        if model.tp_root is not None:  # the whole module is the one stage's one layer
            styles = model.tp_plan.styles_for("")
            if styles:
                randomness.install_regions(model.tp_root, styles, spec.index)
            continue
        if model.outer_plan is not None:  # embeddings, head: a stage module holds them by their names in the model
            for name, held in zip(spec.module.names, spec.module.held):
                styles = model.outer_plan.styles_for(name)
                if styles:
                    randomness.install_regions(held, styles, spec.index)
        for name in model.stage_plan.layer_names[spec.index]:
            whole = pieces.layer_of(name)  # a part of a layer is in the stage's container, under the layer's name
            layer = torch_compat.child_modules(model.body.module if whole == name else spec.module)[whole]
            assert layer is not None
            styles = _held_styles(layer, model.tp_plan.styles_for(whole))
            if styles:
                randomness.install_regions(layer, styles, spec.index)
    return randomness


def sync_replicas(body: nn.Module, mesh: DeviceMesh) -> None:
    """Make replicated state identical: plain tensors from tp rank 0, and every local tensor from dp rank 0.

    Needed for models built in ``__init__`` without a common seed: ``replicate`` (like FSDP2) does not
    broadcast at wrap time, unlike ``DistributedDataParallel``.
    """
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    with torch.no_grad():
        for tensor in [*body.parameters(), *body.buffers()]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if tp_mesh.size() > 1 and not isinstance(tensor, DTensor):
                dist.broadcast(local, src=int(tp_mesh.mesh[0]), group=tp_mesh.get_group())
            if dp_mesh.size() > 1:
                dist.broadcast(local, src=int(dp_mesh.mesh[0]), group=dp_mesh.get_group())


def describe_layout(
    topology: Topology, mesh: DeviceMesh, module: nn.Module, model: ModelPlan, schedule: str, micro_batches: int
) -> str:
    """The mesh, the stages and the tensor-parallel plan of ``module`` (still unsharded), as rank 0 prints them
    once."""
    params = list(module.parameters())  # each once, a tied weight too (meta tensors count alike)
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    size = f"whole model: {total:,} parameters ({trainable:,} trainable)"
    if topology.pp > 1:
        size += "; Lightning's model summary counts rank 0's stage only"
    lines = [
        f"lightning_3d layout: {topology.describe()}, schedule {schedule}, {micro_batches} micro-batches per batch",
        size,
        mesh_ranks_table(mesh),
        "pipeline stages:",
        model.stage_plan.describe() if model.split is None else model.split.describe(model.stage_plan.estimates),
    ]
    tp = mesh["tp"].size()
    if tp > 1 and model.hf_plan is not None:
        lines.append(f"tensor-parallel plan (the model's own, tp={tp}):\n{model.hf_plan.describe()}")
    elif tp > 1 and model.tp_root is not None:
        lines.append(tpmod.describe_plan(model.tp_root, model.tp_plan, tp, body_prefix=""))
    elif tp > 1:
        lines.append(tpmod.describe_plan(model.body.module, model.tp_plan, tp, body_prefix=model.body.fqn))
    if tp > 1 and model.outer_plan is not None and (model.outer_plan.entries or model.outer_plan.notes):
        outside = tpmod.describe_plan(module, model.outer_plan, tp, body_prefix="")
        lines.append(outside.replace("Tensor-parallel plan", "Outside the blocks", 1))
    return "\n".join(lines)
