"""Data parallelism over the dp dimension of the mesh.

Each pipeline stage module is wrapped with ``replicate`` (DDP semantics built on FSDP2's machinery), which,
unlike ``DistributedDataParallel``, takes tensor-parallel DTensor parameters as they are and keeps them
visible as parameters (so optimizers, clipping and state dicts see them).

Gradient buckets are chosen by the dp group's backend (``per_block_buckets``):

* NCCL (GPU): as DDP and torchtitan do, each block of the stage (a transformer block, or a layer of a
  ``Sequential`` body) is its own ``replicate`` parameter group, and the stage root takes what is left
  (embeddings, final norm, head, and any block that shares a parameter with a module outside it, such as a head
  tied to the embedding). A group's gradients are all-reduced in one call as soon as autograd has produced them,
  during the backward of the optimizer step's last micro-batch (``pipeline.py`` switches the sync on for that
  backward only), so the reduction of late blocks runs on NCCL's stream while the backward of earlier ones
  computes.
* gloo (CPU): one group for the whole stage, all-reduced once after the last micro-batch's backward. Gloo's
  all-reduce blocks the calling thread, so buckets cannot overlap the backward there; they only add calls, a
  flattening copy each and a smaller message each (B7 measured one group ahead: CPU-time ratio 0.855 against
  0.782 with a group per block).

Every micro-batch before the last accumulates locally, and across gradient-accumulation batches the pipeline
defers even the last one (see ``pipeline.py``), so each bucket is all-reduced once per optimizer step.

Over a dp group ``replicate``'s "reduce-scatter" spans one rank: torch copies the flattened gradients into a
second buffer before the all-reduce. :class:`_SameBufferReduce` hands torch the flattened input back as that
output, so the copy is a no-op (one flattening copy per bucket remains, as in DDP).

Gradient compression (``grad_reduce_dtype="bf16"`` / ``"fp16"``): ``replicate`` gets a ``MixedPrecisionPolicy``
with that ``reduce_dtype`` and no ``param_dtype`` (parameters and the forward unchanged). FSDP2's ``foreach_reduce``
then flattens each bucket's gradients into a buffer of the reduce dtype (the cast is the flattening copy), all-reduces
it there (half the bytes of fp32) and casts the result back to the parameters' dtype before it lands in ``.grad``,
so the optimizer, clipping and the non-finite check see fp32 gradients. The mean over dp: bf16 has fp32's exponent
range, so it is reduced with ``AVG`` like fp32; fp16 (largest 65504) is divided by a power of two near sqrt(dp)
before the ``SUM`` and by the rest of dp after it (torch's ``_get_gradient_divide_factors``), so the sum of dp
gradients overflows only where a single gradient, divided by sqrt(dp), already would. An overflow becomes inf in the
fp32 gradient, and the non-finite agreement (``on_nonfinite``) sees it like any other inf, unchanged. Only the wire is
narrowed: the micro-batches' (and accumulation batches') gradients are summed locally in their own dtype (fp32)
until the bucket syncs (torch would sum them in the reduce dtype: ``accumulate_unreduced_grads_as_computed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from . import torch_compat

REDUCE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``grad_reduce_dtype``'s names and the dtypes they stand for."""


def torch_reduce_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a ``grad_reduce_dtype`` name (``None``: the gradients' own dtype)."""
    if name is None:
        return None
    if name not in REDUCE_DTYPES:
        raise ValueError(
            f"lightning_3d: grad_reduce_dtype must be one of {tuple(REDUCE_DTYPES)} or None, got {name!r}."
        )
    return REDUCE_DTYPES[name]


class _SameBufferReduce:
    """FSDP2's reduce-scatter communication for a one-rank shard group: the output buffer is the input buffer.

    ``foreach_reduce`` allocates the flattened input, then an output of the same size, and (over one rank)
    copies one into the other before the data-parallel all-reduce. Handing back the input tensor itself turns
    that copy into a no-op (``Tensor.copy_`` from itself returns at once). ``__call__`` is the ordinary
    reduce-scatter (never reached over one rank).
    """

    def __init__(self) -> None:
        self._pending: torch.Tensor | None = None

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None and tuple(pending.shape) == tuple(size) and pending.dtype == dtype:
            return pending  # the output of the reduction that just allocated its input
        self._pending = torch.empty(size, dtype=dtype, device=device)
        return self._pending

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def bucket_units(module: nn.Module, candidates: Sequence[nn.Module]) -> list[nn.Module]:
    """The candidate blocks that can be their own gradient bucket: those sharing no parameter with the rest.

    A parameter shared between a block and a module outside it (a tied weight) must stay in one ``replicate``
    group, so such a block is left to the stage root, and so is a block listed twice (it runs twice per
    forward). Blocks without parameters are left out too.

    Args:
        module: the stage module.
        candidates: its blocks, in forward order.

    Returns:
        The blocks to wrap on their own, in the order given.
    """
    owners: dict[int, set[int]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(sub))
    units = []
    for unit in candidates:
        if sum(c is unit for c in candidates) > 1:
            continue  # called more than once per forward: its parameters stay with the root
        inside = {id(m) for m in unit.modules()}
        params = list(unit.parameters())
        if params and all(owners.get(id(p), set()) <= inside for p in params):
            units.append(unit)
    return units


def per_block_buckets(backend: str) -> bool:
    """Whether the gradients are reduced in one bucket per block (True) or in one per stage (False), for the dp
    group's process-group backend: per block where the all-reduce runs beside the backward (NCCL, or any backend
    but gloo), one per stage on gloo, whose all-reduce blocks the thread that runs the backward."""
    return backend.lower() != "gloo"


def apply_data_parallel(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    blocks: Sequence[nn.Module] = (),
    reduce_dtype: str | None = None,
    per_block: bool | None = None,
) -> nn.Module:
    """Wrap a stage module for data parallelism over ``dp_mesh`` with ``replicate`` (no-op when the dp size is 1).

    With per-block buckets each of ``blocks`` that shares no parameter with the rest of the stage becomes its own
    gradient bucket (``replicate`` on the block); the stage root is wrapped last and takes the remaining
    parameters (all of them with one bucket per stage).

    Args:
        module: the stage's module, already tensor-parallel.
        dp_mesh: the 1-D data-parallel sub-mesh.
        blocks: the stage's blocks, in forward order; each must run its own ``forward`` once per forward of
            the stage (true of a ``Sequential``'s layers and of a model's transformer blocks).
        reduce_dtype: ``grad_reduce_dtype``: ``"bf16"`` / ``"fp16"`` all-reduce the gradients in that dtype (see the
            module text); ``None`` in the gradients' own dtype.
        per_block: a bucket per block; ``None``: chosen by the dp group's backend (``per_block_buckets``).

    Returns:
        The wrapped module (the same object: ``replicate`` works in place), or ``module`` when dp is 1.

    Raises:
        ValueError: ``reduce_dtype`` is set at dp 1 (nothing is reduced; ``ThreeDSettings`` refuses it earlier).
    """
    dtype = torch_reduce_dtype(reduce_dtype)
    if dp_mesh.size() == 1:
        if dtype is not None:
            raise ValueError(
                f"lightning_3d: grad_reduce_dtype={reduce_dtype!r} at dp=1: no gradient is reduced over data-parallel "
                "ranks, nothing to compress."
            )
        return module
    policy = None if dtype is None else MixedPrecisionPolicy(reduce_dtype=dtype)
    if per_block is None:
        per_block = per_block_buckets(dist.get_backend(dp_mesh.get_group()))
    for unit in bucket_units(module, blocks) if per_block else []:
        torch_compat.replicate(unit, mesh=dp_mesh, mp_policy=policy)
    torch_compat.replicate(module, mesh=dp_mesh, mp_policy=policy)
    if dtype is not None:
        torch_compat.accumulate_unreduced_grads_as_computed(module)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_reduce_scatter(_SameBufferReduce())  # type: ignore[arg-type]  # duck-typed comm
    return module


def gradient_buckets(module: nn.Module) -> int:
    """How many gradient all-reduces one optimizer step issues for this stage module (0 without dp).

    One per ``replicate`` group that holds parameters: each wrapped block, and the root when parameters are
    left to it.
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            inner = {id(p) for m in sub.modules() if m is not sub and isinstance(m, FSDPModule) for p in m.parameters()}
            if any(id(p) not in inner for p in sub.parameters()):
                count += 1
    return count
