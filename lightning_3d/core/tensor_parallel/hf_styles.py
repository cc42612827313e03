"""torch ``ParallelStyle`` objects for the layouts Hugging Face tensor-parallel plans name.

Three things torch's own ``ColwiseParallel`` / ``RowwiseParallel`` do not cover:

* ``transformers.pytorch_utils.Conv1D`` (GPT-2, OpenAI GPT): a Linear whose weight is stored transposed,
  ``[in_features, out_features]``, so column-parallel shards weight dim 1 and row-parallel dim 0.
* Tied parameters (GPT-2 / Gemma / Qwen3-0.6B tie ``lm_head.weight`` to the input embedding): torch's styles
  wrap each module's parameter in a new ``nn.Parameter``, which silently unties the pair (two parameters,
  two gradients, two optimizer states). The styles of one plan share a :class:`TiedParams` registry: the
  second module that holds an already distributed parameter gets the very same DTensor ``Parameter``, in
  whichever order (and in however many ``parallelize_module`` calls) the modules are sharded.
* Hugging Face's ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``): parameters
  stay plain replicated tensors, but each rank's gradient covers only its local heads, so it is summed over
  the tensor-parallel group. :class:`ReplicatedGradAllReduce` does that inside autograd, per backward pass
  and before the gradient is accumulated (Megatron's "copy to tensor-parallel region"). transformers' own
  version all-reduces ``param.grad`` in a post-accumulate hook, which would count earlier micro-batches'
  gradients again under gradient accumulation or a pipeline schedule.
"""

from __future__ import annotations

import sys
import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from lightning_3d.core.tensor_parallel.styles import SharedInputColwiseParallel
from lightning_3d.core.torch_compat import own_parameters


def conv1d_class() -> type[nn.Module] | None:
    """``transformers.pytorch_utils.Conv1D``, or None when it has not been imported.

    A model holding a Conv1D has imported it; looking in ``sys.modules`` instead of importing spares every
    other model the seconds transformers takes to import (and works without transformers installed).
    """
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def module_kind(module: nn.Module) -> str | None:
    """``"linear"``, ``"conv1d"`` (HF's transposed Linear), ``"embedding"``, or None for anything else."""
    conv1d = conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


# Placement of each parameter, by style direction and module kind. Column-parallel splits the output features,
# row-parallel the input features (its bias is added once, after the reduction, so it stays whole). For an
# Embedding "row" means the vocabulary (dim 0) and "column" the embedding dim (dim 1).
PLACEMENTS: dict[str, dict[str, dict[str, Placement]]] = {
    "col": {
        "linear": {"weight": Shard(0), "bias": Shard(0)},
        "conv1d": {"weight": Shard(1), "bias": Shard(0)},
        "embedding": {"weight": Shard(1)},
    },
    "row": {
        "linear": {"weight": Shard(1), "bias": Replicate()},
        "conv1d": {"weight": Shard(0), "bias": Replicate()},
        "embedding": {"weight": Shard(0)},
    },
}


def _checked(made: nn.Parameter, mesh: DeviceMesh, placements: list[Placement]) -> nn.Parameter:
    """``made`` (a distributed tied parameter reached again), refused when asked for with another layout."""
    if made.device_mesh != mesh or tuple(made.placements) != tuple(placements):  # type: ignore[attr-defined]
        raise ValueError(
            f"tied parameter sharded twice with different layouts ({made.placements} and "  # type: ignore[attr-defined]
            f"{tuple(placements)}): both uses must shard it the same way"
        )
    return made


class TiedParams:
    """Distributes each parameter once: a tied parameter reached again gets the same DTensor ``Parameter``.

    Entries are keyed by the original parameter object, held weakly: once every module that held it has been
    given the DTensor parameter, the original is freed and its entry removes itself. The DTensor parameter is
    held strongly until then and never weakly referenced: ``torch.utils.swap_tensors`` (which ``to_empty`` and
    ``_apply`` use for DTensor parameters) refuses tensors that have weak references.
    """

    def __init__(self) -> None:
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter]] = {}

    def distribute(
        self, param: nn.Parameter, mesh: DeviceMesh, placements: list[Placement], src_data_rank: int | None
    ) -> nn.Parameter:
        """The DTensor ``Parameter`` for ``param`` with ``placements``; made on first use, then shared.

        Raises:
            ValueError: a tied parameter asked for with two different placements (plans are resolved so
                this does not happen; sharding the pair differently would silently untie it).
        """
        key = id(param)
        hit = self._made.get(key)
        if hit is not None and hit[0]() is param:
            return _checked(hit[1], mesh, placements)
        if isinstance(param, DTensor):
            # already given to a module tied to this one (a head re-tied to its embedding after the embedding
            # was sharded, as a meta-built model is materialised module by module): the same Parameter
            return _checked(param, mesh, placements)
        made = nn.Parameter(
            distribute_tensor(param, mesh, placements, src_data_rank=src_data_rank), requires_grad=param.requires_grad
        )
        made_ref = self._made

        def forget(_: weakref.ref[torch.Tensor], key: int = key) -> None:
            made_ref.pop(key, None)

        self._made[key] = (weakref.ref(param, forget), made)
        return made

    def __len__(self) -> int:
        return len(self._made)


def _partition(
    style: ParallelStyle, ties: TiedParams, direction: str, kind: str, name: str, module: nn.Module, mesh: DeviceMesh
) -> None:
    if name:  # distribute_module visits every submodule; only the styled module's own parameters are sharded
        return
    table = PLACEMENTS[direction][kind]
    for pname, param in list(module.named_parameters(recurse=False)):
        if pname not in table:
            raise ValueError(f"{type(module).__name__} has an unexpected parameter {pname!r} for a {direction} style")
        module.register_parameter(pname, ties.distribute(param, mesh, [table[pname]], style.src_data_rank))


def _kind_or_raise(module: nn.Module, style: str, kinds: tuple[str, ...]) -> str:
    kind = module_kind(module)
    if kind not in kinds:
        raise NotImplementedError(f"{style} applies to {', '.join(kinds)} modules, not {type(module).__name__}")
    return kind  # type: ignore[return-value]


class HFColwiseParallel(SharedInputColwiseParallel):
    """Column-wise parallel for ``nn.Linear``, HF ``Conv1D`` and ``nn.Embedding`` (embedding dim), tie-aware.

    Input replicated (converted once for the Linears that read the same tensor, see
    ``SharedInputColwiseParallel``); output sharded on the last dim, or replicated with
    ``output_layouts=Replicate()`` (HF's ``colwise_gather_output`` / ``embedding_colwise``).

    Args:
        output_layouts: ``Shard(-1)`` (default) or ``Replicate()``.
        ties: the registry shared by all styles of one plan.
    """

    def __init__(self, *, output_layouts: Placement | None = None, ties: TiedParams | None = None) -> None:
        super().__init__(output_layouts=output_layouts)
        self.ties = ties if ties is not None else TiedParams()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = _kind_or_raise(module, type(self).__name__, ("linear", "conv1d", "embedding"))
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, self, self.ties, "col", kind),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class HFRowwiseParallel(RowwiseParallel):
    """Row-wise parallel for ``nn.Linear``, HF ``Conv1D`` and ``nn.Embedding`` (vocabulary-parallel), tie-aware.

    Linear / Conv1D: input sharded on the last dim (default) or replicated and split locally
    (``input_layouts=Replicate()``: HF's ``rowwise_split_input``); output all-reduced. Embedding: token ids
    replicated, the weight sharded on the vocabulary, partial lookups all-reduced (HF's ``embedding_rowwise``).

    Args:
        input_layouts: ``Shard(-1)`` (default) or ``Replicate()``; an Embedding always takes replicated ids.
        ties: the registry shared by all styles of one plan.
    """

    def __init__(self, *, input_layouts: Placement | None = None, ties: TiedParams | None = None) -> None:
        super().__init__(input_layouts=input_layouts)
        self.ties = ties if ties is not None else TiedParams()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = _kind_or_raise(module, type(self).__name__, ("linear", "conv1d", "embedding"))
        input_layouts = (Replicate(),) if kind == "embedding" else self.input_layouts
        desired: tuple[Placement, ...] = (Replicate(),) if kind == "embedding" else (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, self, self.ties, "row", kind),
            partial(self._prepare_input_fn, input_layouts, desired),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedGradAllReduce(ParallelStyle):
    """Parameters stay plain and replicated; each forward's parameter gradient is summed over the tp group.

    For modules between a column- and a row-parallel layer that act on the local part of a sharded
    activation with a parameter shared by all of it, e.g. Qwen3's ``q_norm`` / ``k_norm`` (an RMSNorm over
    ``head_dim`` applied to this rank's heads). The forward needs no collective; the backward sums the
    ranks' partial parameter gradients, once per backward pass, before accumulation, so the parameters and
    their gradients stay identical on every tensor-parallel rank (as for any replicated module).
    """

    kind = "grad_allreduce"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"ReplicatedGradAllReduce needs a 1-D tensor-parallel mesh, got {device_mesh.ndim}-D")
        group = device_mesh.get_group()
        saved: list[dict[str, nn.Parameter]] = []

        def swap_in(mod: nn.Module, args: Any) -> None:
            originals: dict[str, nn.Parameter] = {}
            if torch.is_grad_enabled():
                for pname, param in list(own_parameters(mod).items()):
                    if param is not None and param.requires_grad and not isinstance(param, DTensor):
                        originals[pname] = param
                        # A non-leaf stand-in for the forward only: autograd routes its gradient through
                        # _AllReduceGrad to the real parameter. (transformers swaps parameters the same way
                        # for its local-tensor kernels.)
                        own_parameters(mod)[pname] = _AllReduceGrad.apply(param, group)  # type: ignore[assignment]
            saved.append(originals)

        def swap_out(mod: nn.Module, args: Any, output: Any) -> None:
            if saved:
                own_parameters(mod).update(saved.pop())

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out, always_call=True)
        return module

    def __repr__(self) -> str:
        return "ReplicatedGradAllReduce()"


__all__ = [
    "PLACEMENTS",
    "HFColwiseParallel",
    "HFRowwiseParallel",
    "ReplicatedGradAllReduce",
    "TiedParams",
    "conv1d_class",
    "module_kind",
]
