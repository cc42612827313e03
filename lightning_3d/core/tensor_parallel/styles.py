"""Style names of a tensor-parallel plan and the torch ``ParallelStyle`` each one stands for.

Every style keeps the module's output a plain local tensor (``use_local_output=True``), because
pipeline stages exchange plain tensors; ``sequence`` is the exception (torch's default, explicit
plans only, for users who compose sequence parallelism themselves).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..torch_compat import ColwiseParallelWithInputHook, tensor_version

STYLE_NAMES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gather", "vocab", "sequence", "replicate")
"""Names a plan may use: column-wise Linear (output sharded on the last dim), row-wise Linear
(input sharded on the last dim, output all-reduced), column-wise with the output all-gathered (a
lone final projection), vocabulary-sharded Embedding (output all-reduced), torch's
``SequenceParallel``, and ``replicate`` (leave the module unsharded)."""


def check_style(style: object, where: str) -> str | ParallelStyle:
    """Return ``style`` if it is a name from :data:`STYLE_NAMES` or a ``ParallelStyle``, else raise.

    Args:
        style: the value given in a plan.
        where: what to name in the error (e.g. the plan key).

    Raises:
        ValueError: an unknown style name or another kind of object.
    """
    if isinstance(style, ParallelStyle) or (isinstance(style, str) and style in STYLE_NAMES):
        return style
    raise ValueError(
        f"Tensor-parallel plan entry {where}: unknown style {style!r}. Use one of {', '.join(STYLE_NAMES)} "
        "or a torch.distributed.tensor.parallel.ParallelStyle object."
    )


class _SharedInput:
    """The DTensor most recently made from a plain input by a column-parallel Linear.

    q, k and v projections (or SwiGLU's w1 and w3) read the same activation. Converted separately, each
    conversion all-reduces its own share of the input gradient in backward; converted once, autograd sums the
    three partial gradients first and the conversion all-reduces once (Megatron's count: one all-reduce per
    column-parallel group). A hit needs the very same tensor object, unmodified, on the same mesh and layouts,
    so sharing is always exact; only weak references are kept, so no activation is held alive.
    """

    def __init__(self) -> None:
        self._source: weakref.ref[torch.Tensor] | None = None
        self._result: weakref.ref[torch.Tensor] | None = None
        self._key: tuple[Any, ...] = ()

    def get(self, x: torch.Tensor, key: tuple[Any, ...]) -> torch.Tensor | None:
        if self._source is None or self._source() is not x or self._key != (tensor_version(x), *key):
            return None
        return self._result() if self._result is not None else None

    def put(self, x: torch.Tensor, key: tuple[Any, ...], result: torch.Tensor) -> None:
        self._source, self._result, self._key = weakref.ref(x), weakref.ref(result), (tensor_version(x), *key)


_SHARED_INPUT = _SharedInput()


class SharedInputColwiseParallel(ColwiseParallelWithInputHook):
    """``ColwiseParallel`` whose input conversion is shared by the Linears that read the same tensor."""

    @staticmethod
    def convert_input(input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any, device_mesh: Any) -> Any:
        convert = ColwiseParallelWithInputHook.convert_input
        x = inputs[0]
        # Under torch.compile each Linear converts its own input: the compiler merges what is shared, and a DTensor
        # kept in this cache across a graph break would become an output of the graph before it (its backward
        # then gets a plain gradient for a DTensor output, which AOT autograd refuses).
        if isinstance(x, DTensor) or torch.compiler.is_compiling():
            return convert(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        key = (id(device_mesh), tuple(input_layouts), tuple(desired_input_layouts))
        shared = _SHARED_INPUT.get(x, key)
        if shared is None:
            shared = convert(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
            _SHARED_INPUT.put(x, key, shared)
        return shared


class LocalHeadCounts(ParallelStyle):
    """Sets a module's head counts to the heads one tensor-parallel rank holds (``num_heads`` 8 -> 4 at tp=2).

    An attention module that reshapes by its own head count (``q.view(bsz, -1, self.num_heads, self.head_dim)``,
    OPT; ``view(bsz, q_len, self.num_heads, ...)``, StableLM) would, with its q/k/v projections column-parallel,
    fail or silently mix tokens into heads. On each rank the module then holds ``count / tp`` heads, so the
    attribute says so. Only the module's Python attributes change; its parameters and state dict do not. Applying
    it again to the same module (a second ``parallelize_module``) leaves the counts as they are.

    Args:
        counts: attribute name -> the full (model-wide) count, e.g. ``{"num_heads": 8, "num_key_value_heads": 2}``.

    Example:
        >>> parallelize_module(block, tp_mesh, {"self_attn": LocalHeadCounts({"num_heads": 8}), ...})  # doctest: +SKIP
    """

    kind = "heads"

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = dict(counts)

    def local_counts(self, tp: int) -> dict[str, int]:
        """The counts one of ``tp`` ranks holds; raises ValueError when ``tp`` does not divide one."""
        bad = {name: n for name, n in self.counts.items() if n % tp}
        if bad:
            raise ValueError(f"head counts {bad} are not divisible by tp={tp}")
        return {name: n // tp for name, n in self.counts.items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        done = getattr(module, _LOCAL_COUNTS, None)
        local = self.local_counts(device_mesh.size())
        if done == local:
            return module
        for name, full in self.counts.items():
            if getattr(module, name) != full:
                raise ValueError(f"{type(module).__name__}.{name} is {getattr(module, name)}, expected {full}")
        for name, n in local.items():
            setattr(module, name, n)
        setattr(module, _LOCAL_COUNTS, local)
        return module

    def __repr__(self) -> str:
        return f"LocalHeadCounts({self.counts})"


_LOCAL_COUNTS = "_lightning_3d_local_counts"


class CopiedOutput(ParallelStyle):
    """``style``, with the module's output copied into a tensor of its own.

    A tensor-parallel module returns its local output through DTensor's ``to_local`` (an autograd view), and autograd
    refuses an in-place operation on such a view (Falcon's ``mlp_output += attention_output``: *"Output 0 of
    _ToTorchTensor is a view and is being modified inplace"*). The plan wraps the styles of modules whose output the
    forward modifies in place (found by the analysis) in this one; the copy costs one activation's memory traffic.

    Args:
        style: the style that shards the module.
    """

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style
        self.src_data_rank = style.src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = parallelize_module(module, device_mesh, self.style)
        module.register_forward_hook(_copy_output)
        return module

    def __repr__(self) -> str:
        return f"CopiedOutput({self.style!r})"


def _copy_output(module: nn.Module, args: Any, output: Any) -> Any:
    return output.clone() if isinstance(output, torch.Tensor) and not isinstance(output, DTensor) else output


def inner_style(style: Any) -> Any:
    """The style a :class:`CopiedOutput` wraps (any other style as it is)."""
    return style.style if isinstance(style, CopiedOutput) else style


def make_style(style: str | ParallelStyle) -> ParallelStyle | None:
    """A fresh torch ``ParallelStyle`` for a style name (None for ``replicate``); objects pass through."""
    if isinstance(style, ParallelStyle):
        return style
    if style == "colwise":
        return SharedInputColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather":
        return SharedInputColwiseParallel(output_layouts=Replicate())
    if style == "vocab":
        return RowwiseParallel(input_layouts=Replicate())
    if style == "sequence":
        return SequenceParallel()
    if style == "replicate":
        return None
    raise ValueError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(STYLE_NAMES)}")


def style_kind(style: str | ParallelStyle) -> str:
    """Canonical name of a style; ParallelStyle objects map to the name that shards the same way.

    ``ColwiseParallel`` -> "colwise" (or "colwise_gather" with a replicated output),
    ``RowwiseParallel`` -> "rowwise" (or "vocab" with a replicated input), ``SequenceParallel`` ->
    "sequence", lightning_3d's styles that shard no parameter -> their ``kind`` (:class:`LocalHeadCounts`: "heads",
    ``ReplicatedGradAllReduce``: "grad_allreduce"), any other object -> "custom".
    """
    if isinstance(style, str):
        return style
    if isinstance(getattr(style, "kind", None), str):  # lightning_3d's own styles that shard no parameter
        return style.kind  # type: ignore[attr-defined]
    if isinstance(style, ColwiseParallel):
        return "colwise_gather" if style.output_layouts == (Replicate(),) else "colwise"
    if isinstance(style, RowwiseParallel):
        return "vocab" if style.input_layouts == (Replicate(),) else "rowwise"
    if isinstance(style, SequenceParallel):
        return "sequence"
    return "custom"


def style_label(style: str | ParallelStyle) -> str:
    """Short text for tables: the name, the ``kind`` of lightning_3d's own style objects, or a custom object's class
    name."""
    if isinstance(getattr(style, "kind", None), str):
        return style.kind  # type: ignore[attr-defined]
    return style if isinstance(style, str) else type(style).__name__


def sharded_dim(kind: str, param_name: str, is_embedding: bool) -> int | None:
    """Dimension of parameter ``param_name`` that a style of ``kind`` shards (None: kept whole)."""
    if kind in ("colwise", "colwise_gather"):
        if param_name == "weight":
            return 1 if is_embedding else 0
        return 0 if param_name == "bias" and not is_embedding else None
    if kind in ("rowwise", "vocab") and param_name == "weight":
        return 0 if is_embedding else 1
    return None


def local_shape(shape: tuple[int, ...], kind: str, param_name: str, is_embedding: bool, tp: int) -> tuple[int, ...]:
    """Shape of one rank's shard of a parameter (plans are validated to divide evenly)."""
    dim = sharded_dim(kind, param_name, is_embedding)
    if dim is None or dim >= len(shape):
        return tuple(shape)
    out = list(shape)
    out[dim] = shape[dim] // tp
    return tuple(out)


def local_numel_of(shape: tuple[int, ...], kind: str, param_name: str, tp: int) -> int:
    """Number of elements of one rank's shard (the same whichever dim is sharded)."""
    if kind in ("colwise", "colwise_gather") and param_name in ("weight", "bias"):
        return math.prod(shape) // tp
    if kind in ("rowwise", "vocab") and param_name == "weight":
        return math.prod(shape) // tp
    return math.prod(shape)


def relative_name(fqn: str, prefix: str) -> str | None:
    """``fqn`` relative to the submodule at ``prefix`` (``""`` for the submodule itself; any ``fqn`` when
    ``prefix`` is the root ``""``), or ``None`` when ``fqn`` is not inside it."""
    if not prefix:
        return fqn
    if fqn == prefix:
        return ""
    if fqn.startswith(prefix + "."):
        return fqn[len(prefix) + 1 :]
    return None
