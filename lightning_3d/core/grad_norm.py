"""The global gradient norm over all pipeline stages and tensor-parallel shards, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` sees only the parameters of one rank: one stage, one shard. The norm
that single-device training clips by is over the whole model, so it is assembled here from local pieces
with two small all-reduces: the squares of tensor-parallel SHARDS are summed over the tp group (replicated
parameters, identical on every tp rank, are counted once), then the per-stage totals are summed over the
pp group. Data-parallel replicas hold identical (already all-reduced) gradients and need no communication;
under FSDP (``data_parallel="fsdp"``) each dp rank holds a disjoint shard of every gradient, so the per-rank
totals are also summed over the dp group (``dp_group``); under HSDP (``data_parallel="hsdp"``) the gradients are
sharded over dp_shard and equal over dp_replicate, so ``dp_group`` is the dp_shard group.

``ScanNorms`` lets the clipping reuse the per-gradient 2-norms that the non-finite scan (``reliability.py``) already
computed earlier in the same step: one pass over the gradients per step, not two. A norm is reused only for the very
gradient tensor it was computed from, unchanged since (same object, same in-place version counter); anything else
(accumulated or tied gradients, an unscaled or user-modified gradient) is computed again here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import torch_compat


def _is_tp_sharded(grad: torch.Tensor) -> bool:
    if not isinstance(grad, DTensor):
        return False
    names = grad.device_mesh.mesh_dim_names or ()
    return any(isinstance(pl, Shard) and names[i] == "tp" for i, pl in enumerate(grad.placements) if i < len(names))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


class ScanNorms:
    """The 2-norm of each gradient as the non-finite scan computed it, for the clipping later in the same step."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def record(self, grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor]) -> None:
        """Remember ``norms[i]``, the 2-norm of ``grads[i]`` (a parameter's ``.grad``, DTensor or not), besides what
        is remembered since the last ``clear`` (weak references: the gradients' memory is not held)."""
        version = torch_compat.tensor_version
        for g, n in zip(grads, norms, strict=True):
            self._entries[id(g)] = (weakref.ref(g), version(_local(g)), n)

    def lookup(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The remembered 2-norm of ``grad`` if it is the same tensor, not modified since; else ``None``."""
        entry = self._entries.get(id(grad))
        if entry is None:
            return None
        ref, version, norm = entry
        if ref() is not grad or torch_compat.tensor_version(_local(grad)) != version:
            return None
        return norm

    def clear(self) -> None:
        self._entries = {}


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None = None,
    known: ScanNorms | None = None,
) -> torch.Tensor:
    """The norm of all gradients of the whole (unsplit, unsharded) model, the same on every rank.

    Args:
        parameters: this rank's parameters (their ``.grad`` is read; ``None`` grads are skipped).
        norm_type: 2.0 (or any p > 0) or ``inf``.
        tp_group: the tensor-parallel group (``None`` when tp == 1).
        pp_group: the pipeline group (``None`` when pp == 1).
        dp_group: the data-parallel group when the gradients are sharded over it (FSDP; HSDP: its dp_shard
            group); ``None`` when every dp rank holds the whole (all-reduced) gradients.
        known: the 2-norms the non-finite scan already computed this step (used for ``norm_type`` 2 only, for
            the gradients they were computed from; the others are computed here).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    sharded = [g for g in grads if _is_tp_sharded(g)]
    replicated = [g for g in grads if not _is_tp_sharded(g)]
    inf = math.isinf(norm_type)
    reuse = known if norm_type == 2.0 else None

    def partial(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = [reuse.lookup(g) if reuse is not None else None for g in tensors]
        missing = [i for i, n in enumerate(norms) if n is None]
        if missing:
            computed = torch_compat.foreach_norm([_local(tensors[i]).detach() for i in missing], norm_type)
            for i, n in zip(missing, computed, strict=True):
                norms[i] = n
        stacked = torch.stack([n.to(torch.float64) for n in norms])  # type: ignore[union-attr]
        return stacked.max() if inf else stacked.pow(norm_type).sum()

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    shard_part = partial(sharded)
    if tp_group is not None:
        dist.all_reduce(shard_part, op=op, group=tp_group)
    total = torch.maximum(shard_part, partial(replicated)) if inf else shard_part + partial(replicated)
    if dp_group is not None:  # FSDP: each dp rank's shards are disjoint pieces of every gradient
        dist.all_reduce(total, op=op, group=dp_group)
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    return total if inf else total.pow(1.0 / norm_type)


def clip_grads_(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place the way ``torch.nn.utils.clip_grad_norm_`` does, given the global norm."""
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    clip_coef = max_norm / (total_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for g in grads:
        g.mul_(clip_coef_clamped.to(g.device, g.dtype))


def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm and their overall norm: Lightning's ``lightning.pytorch.utilities.grad_norm``
    (same keys, same values on one device) for gradients that are DTensors too.

    Under ``ThreeDStrategy`` with dp or tp > 1 the gradients are DTensors (``replicate``, FSDP2, tensor
    parallelism), and Lightning's version fails on them (``torch.tensor`` of DTensor norms). Here a DTensor
    gradient's norm is the whole gradient's (a collective over the ranks holding its shards: call it on every rank
    of the stage, as a gradient hook runs), returned as a plain tensor. Under a pipeline it covers this stage's
    parameters; logged from a gradient hook (``self.log_dict(grad_norm(self, 2))`` in
    ``on_before_optimizer_step``) the strategy merges the stages (``core/hook_logs.py``): each parameter's key
    from its stage, the total as the norm over every stage.

    Args:
        module: the module whose ``named_parameters()`` are read (``None`` gradients skipped).
        norm_type: the p of the p-norm (``"inf"`` for the largest absolute value).
        group_separator: between ``grad_{p}_norm`` and the parameter's name (a logger's folder separator).
    """
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        norm = param.grad.detach().norm(p)
        norms[f"grad_{p}_norm{group_separator}{name}"] = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.stack(list(norms.values())).norm(p)
    return norms


def clip_grads_by_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` for plain and DTensor gradients in one list (torch's multi-tensor clamp
    refuses the mix, as tensor parallelism leaves it): each gradient's local tensor is clamped to
    ``[-clip_value, clip_value]``. The clamp is elementwise, so clamping every shard is clamping the whole."""
    for p in parameters:
        if p.grad is not None:
            _local(p.grad).clamp_(-clip_value, clip_value)
