"""The global gradient norm over all pipeline stages and tensor-parallel shards, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` sees only the parameters of one rank: one stage, one shard. The norm
that single-device training clips by is over the whole model, so it is assembled here from local pieces
with two small all-reduces: the squares of tensor-parallel SHARDS are summed over the tp group (replicated
parameters, identical on every tp rank, are counted once), then the per-stage totals are summed over the
pp group. Data-parallel replicas hold identical (already all-reduced) gradients and need no communication;
under FSDP (``data_parallel="fsdp"``) each dp rank holds a disjoint shard of every gradient, so the per-rank
totals are also summed over the dp group (``dp_group``); under HSDP (``data_parallel="hsdp"``) the gradients are
sharded over dp_shard and equal over dp_replicate, so ``dp_group`` is the dp_shard group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm of all gradients of the whole (unsplit, unsharded) model, the same on every rank.

    Args:
        parameters: this rank's parameters (their ``.grad`` is read; ``None`` grads are skipped).
        norm_type: 2.0 (or any p > 0) or ``inf``.
        tp_group: the tensor-parallel group (``None`` when tp == 1).
        pp_group: the pipeline group (``None`` when pp == 1).
        dp_group: the data-parallel group when the gradients are sharded over it (FSDP; HSDP: its dp_shard
            group); ``None`` when every dp rank holds the whole (all-reduced) gradients.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    sharded = [_local(g).detach() for g in grads if _is_tp_sharded(g)]
    replicated = [_local(g).detach() for g in grads if not _is_tp_sharded(g)]
    inf = math.isinf(norm_type)

    def partial(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = torch_compat.foreach_norm(tensors, norm_type)
        stacked = torch.stack([n.to(torch.float64) for n in norms])
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
