"""``DPConsistencyCheck``: data-parallel replicas must hold bitwise-identical parameters.

Replicas drift apart silently when something rank-dependent slips into an update (a non-deterministic
kernel, a gradient that was not all-reduced, a bit flip, a rank that skipped a step): every replica keeps
training, on different weights, and nothing fails. Every ``every_n_steps`` optimizer steps this callback
takes an exact checksum of every parameter's local shard (its bits, not its value), gathers the checksums
over the data-parallel group (ranks with the same pipeline stage and tensor-parallel shard), and, if any
differ, raises ``DPDivergenceError`` on every rank, naming the parameters, their stage and tp rank, and
which data-parallel ranks disagree.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from ..core.agreed import mark_agreed

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_CHUNK = 1 << 22


class DPDivergenceError(RuntimeError):
    """Data-parallel replicas hold different parameters (raised by every rank at the same step)."""


def bit_checksum(tensor: Tensor) -> Tensor:
    """Two int64 checksums of a tensor's bits (a sum and a position-weighted sum), computed on its device.

    Any change of any bit changes the first; a permutation of elements changes the second. Integer
    arithmetic wraps around, identically on every rank.
    """
    flat = tensor.detach().contiguous().view(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).view(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), _CHUNK):
        part = ints[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=flat.device)
        total[0] += part.sum()
        total[1] += (part * weights).sum()
    return total


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class DPConsistencyCheck(Callback):
    """Every ``every_n_steps`` optimizer steps, check that data-parallel replicas hold identical parameters.

    Works with ``ThreeDStrategy`` (the data-parallel group of its mesh) and with any strategy whose
    ``distributed_sampler_kwargs`` describe plain data parallelism over all ranks (DDP).

    Args:
        every_n_steps: check after every ``every_n_steps``-th optimizer step.
        check_at_start: also check once when training starts (catches replicas initialised differently).
        buffers: also compare buffers (off by default: e.g. BatchNorm statistics differ across replicas
            unless synchronised).
        action: ``"raise"`` (``DPDivergenceError`` on every rank) or ``"warn"`` (rank 0 logs it).

    Example:
        >>> check = DPConsistencyCheck(every_n_steps=100)
        >>> trainer = Trainer(strategy=ThreeDStrategy(pp=2), callbacks=[check])  # doctest: +SKIP
    """

    def __init__(
        self, every_n_steps: int = 100, check_at_start: bool = True, buffers: bool = False, action: str = "raise"
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"DPConsistencyCheck: every_n_steps must be >= 1, got {every_n_steps}.")
        if action not in ("raise", "warn"):
            raise ValueError(f"DPConsistencyCheck: action must be 'raise' or 'warn', got {action!r}.")
        self.every_n_steps, self.check_at_start = every_n_steps, check_at_start
        self.buffers, self.action = buffers, action
        self._last_step = -1
        self.checks = 0  # checks run so far (for tests and logs)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_at_start:
            self.check(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._last_step and step > 0 and step % self.every_n_steps == 0:
            self._last_step = step
            self.check(trainer, pl_module)

    def _dp_group(self, trainer: pl.Trainer) -> tuple[dist.ProcessGroup | None, int, str]:
        strategy = trainer.strategy
        mesh = getattr(strategy, "device_mesh", None)
        if mesh is not None and mesh.mesh_dim_names and "dp" in mesh.mesh_dim_names:
            names = mesh.mesh_dim_names
            labels = {"pp": "stage"}
            coords = ", ".join(f"{labels.get(n, n)} {mesh[n].get_local_rank()}" for n in names if n != "dp")
            return mesh["dp"].get_group(), mesh["dp"].size(), coords
        return None, dist.get_world_size(), ""

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
        """Compare now (collective: every rank must call it). Returns the divergent names found on any rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return []
        self.checks += 1
        group, size, coords = self._dp_group(trainer)
        tensors = list(pl_module.named_parameters())
        if self.buffers:
            tensors += list(pl_module.named_buffers())
        device = trainer.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        names = [n for n, _ in tensors]
        local = (
            torch.stack([bit_checksum(_local(t)).to(device) for _, t in tensors])
            if tensors
            else torch.zeros(0, 2, dtype=torch.int64, device=device)
        )
        divergent: list[str] = []
        if size > 1:
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
            stacked = torch.stack(gathered)  # [dp, params, 2]
            differs = (stacked != stacked[:1]).any(dim=2).any(dim=0).tolist()
            for i, name in enumerate(names):
                if differs[i]:
                    values = [tuple(g[i].tolist()) for g in gathered]
                    groups: dict[tuple, list[int]] = {}
                    for rank, value in enumerate(values):
                        groups.setdefault(value, []).append(rank)
                    split = " vs ".join(str(r) for r in groups.values())
                    divergent.append(f"{name} ({coords or 'all ranks'}: data-parallel ranks {split} differ)")
        count = torch.tensor([len(divergent)], dtype=torch.int64, device=device)
        dist.all_reduce(count)
        if int(count.item()) == 0:
            return []
        reports: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, divergent)
        found = sorted({line for report in reports for line in (report or [])})
        message = (
            f"DPConsistencyCheck: data-parallel replicas diverged at global step {trainer.global_step}: "
            f"{len(found)} parameter(s) differ bitwise across the data-parallel group:\n  "
            + "\n  ".join(found[:20])
            + (f"\n  ... and {len(found) - 20} more" if len(found) > 20 else "")
        )
        if self.action == "raise":
            raise mark_agreed(DPDivergenceError(message))
        if trainer.global_rank == 0:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(message)
        return [line.split(" ", 1)[0] for line in found]
