"""Applying the three parallelisms to a LightningModule, in one fixed order.

``plan_model`` inspects the module and decides everything (the body, the stages, the tensor-parallel plan)
without communicating, so every rank reaches the same verdict and a bad configuration fails on every rank
before any of them waits on another. ``build_stages`` then applies the plan: prune the body to this rank's
stages, materialise and tensor-shard each kept layer in turn (a layer is whole only while it is being
sharded), and wrap each stage for data parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import partition
from . import tensor_parallel as tpmod
from .data_parallel import apply_data_parallel
from .materialize import check_materializable, has_meta_tensors, materialize
from .pipeline import StageSpec
from .rng import BodyRandomness
from .topology import Topology, mesh_ranks_table


@dataclass
class ModelPlan:
    """What ``plan_model`` decided for a module."""

    body: partition.BodyRef
    stage_plan: partition.StagePlan
    tp_plan: tpmod.TPPlan
    full_spec: dict[str, partition.TensorSpec]
    example_input: Any
    is_meta: bool


def plan_model(
    module: LightningModule,
    *,
    tp: int,
    pp: int,
    stages_per_rank: int = 1,
    partitioner: str | partition.Partitioner = "uniform",
    body: str | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    tp_autoplan: bool = True,
) -> ModelPlan:
    """Find the body, split it into stages and find the tensor-parallel plan; no communication.

    Args:
        module: the LightningModule (its layers may still be on the meta device).
        tp, pp, stages_per_rank, partitioner, body, tp_plan, tp_autoplan: the settings of the same names
            (see ``lightning_3d.settings.ThreeDSettings``).

    Returns:
        The body, the stage split, the tensor-parallel plan, the whole model's tensor specs and the example input.

    Raises:
        ValueError: the module breaks the contract or the layout does not fit it (each message says why and
            what would work).
    """
    found = partition.find_body(module, body)
    partition.check_no_outside_parameters(module, found)
    full_spec = partition.full_model_spec(module)
    stage_plan = partition.plan_stages(found, pp, partition.get_partitioner(partitioner), stages_per_rank)
    example_input = module.example_input_array
    if example_input is not None:
        # Lightning's model summary would run a forward on rank 0 alone; the strategy hides the example from it.
        module._example_input_array = None
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
    is_meta = has_meta_tensors(found.module)
    if is_meta:
        check_materializable(found.module, found.fqn)
    return ModelPlan(found, stage_plan, resolved, full_spec, example_input, is_meta)


def broadcast_seed(seed: int | None) -> int:
    """The run's initialisation seed, taken from rank 0 (``torch.initial_seed()`` when ``seed`` is None)."""
    holder = [seed if seed is not None else torch.initial_seed() % (2**62)]
    dist.broadcast_object_list(holder, src=0)
    return int(holder[0])


def build_stages(
    module: LightningModule,
    model: ModelPlan,
    mesh: DeviceMesh,
    device: torch.device,
    precision: Precision,
    seed: int,
) -> list[StageSpec]:
    """Prune, materialise, tensor-shard and data-parallel-wrap this rank's stages (in that order)."""
    body, stage_plan = model.body, model.stage_plan
    pp_rank = mesh["pp"].get_local_rank()
    my_stages = [s for s in range(stage_plan.num_stages) if stage_plan.stage_to_rank[s] == pp_rank]
    keep = [name for s in my_stages for name in stage_plan.layer_names[s]]
    partition.prune_body(body, keep)
    precision.convert_module(module)
    tp = mesh["tp"].size()
    for name in keep:
        layer = body.module._modules[name]
        assert layer is not None
        if model.is_meta:
            materialize(layer, device, seed, prefix=f"{body.fqn}.{name}")
        else:
            layer.to(device)
        styles = model.tp_plan.styles_for(name) if tp > 1 else {}
        if styles:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(layer, mesh["tp"], styles)
    if not model.is_meta:
        sync_replicas(body.module, mesh)
    module.to(device)  # anything outside the body (metric states, buffers)
    return [
        StageSpec(s, apply_data_parallel(partition.stage_container(body, stage_plan.layer_names[s]), mesh["dp"]))
        for s in my_stages
    ]


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
        for name in model.stage_plan.layer_names[spec.index]:
            styles = model.tp_plan.styles_for(name)
            if styles:
                randomness.install_regions(model.body.module._modules[name], styles, spec.index)
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


def describe_layout(topology: Topology, mesh: DeviceMesh, model: ModelPlan, schedule: str, micro_batches: int) -> str:
    """The mesh, the stages and the tensor-parallel plan, as rank 0 prints them once."""
    lines = [
        f"lightning_3d layout: {topology.describe()}, schedule {schedule}, {micro_batches} micro-batches per batch",
        mesh_ranks_table(mesh),
        "pipeline stages:",
        model.stage_plan.describe(),
    ]
    tp = mesh["tp"].size()
    if tp > 1:
        lines.append(tpmod.describe_plan(model.body.module, model.tp_plan, tp, body_prefix=model.body.fqn))
    return "\n".join(lines)
