"""Shared pieces of the checkpoint test scripts (``ckpt_*.py``): models, data, trainer, recorder.

Data: 64 samples, global batch 16 (4 steps per epoch), Lightning's own ``DistributedSampler`` with
shuffling (so the sampler's epoch matters), per-replica batch ``16 // dp``. ``NoisyMLP`` draws torch, python
and numpy random numbers in every training step, so a resume that does not restore RNG states shows.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import TinyMLP, dataset

GLOBAL_BATCH = 16
N_SAMPLES = 64


def _halve_every_3_steps(step: int) -> float:
    return 0.5 ** (step // 3)


class NoisyMLP(TinyMLP):
    """TinyMLP whose training step perturbs its input with torch, python and numpy random numbers."""

    def __init__(self, noise: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.noise = noise

    def configure_optimizers(self):
        """Two parameter groups with their own learning rates, the first layer's and the rest, empty ones left out
        (as the example GPT leaves out a stage's empty no-decay group): pipeline stages then hold one or two
        groups, so rank 0's saved scheduler lists must be fitted to each rank's groups when resuming."""
        first = list(self.body[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        groups = [g for g in ({"params": first, "lr": self.lr}, {"params": rest, "lr": self.lr / 2}) if g["params"]]
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(groups, lr=self.lr)
        # LambdaLR scales each group's own base_lrs entry: resuming needs this rank's entries, not rank 0's
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _halve_every_3_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.noise:
            x = x + 0.01 * torch.randn_like(x) + 0.01 * (random.random() + float(np.random.rand()))
        return super().training_step((x, y), batch_idx)


class DropoutMLP(NoisyMLP):
    """NoisyMLP with dropout inside the body (between the Linears): the body consumes random numbers too."""

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(
            nn.Linear(16, 32),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, 4),
        )


class NestedMLP(NoisyMLP):
    """NoisyMLP (noise-free by default) whose hidden layers are blocks of their own, ``Sequential(Linear, ReLU)``:
    parameters one module below the body's layers (keys ``body.0.0.weight``), so that ``fsdp_unit="submodule"``
    wraps each inner Linear, not the layer."""

    def __init__(self, noise: bool = False, **kwargs: Any) -> None:
        super().__init__(noise=noise, **kwargs)

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU()),
            nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
            nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
            nn.Linear(32, 4),
        )


class OtherMLP(TinyMLP):
    """Another model: one more hidden layer, no ReLU before it (keys body.0, 2, 3, 5 instead of 0, 2, 4, 6)."""

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )


def loader(dp: int) -> DataLoader:
    return DataLoader(dataset("mlp", N_SAMPLES), batch_size=GLOBAL_BATCH // dp, shuffle=True)


def trainer(
    tp: int,
    pp: int,
    dp: int,
    steps: int,
    callbacks: list,
    single: bool = False,
    schedule: dict[str, Any] | None = None,
    **kwargs: Any,
) -> L.Trainer:
    """A CPU trainer under ThreeDStrategy (or plain single-device Lightning with ``single``).

    ``schedule`` holds more strategy settings (``schedule``, ``stages_per_rank``, ``micro_batches``); the other
    keyword arguments go to the Trainer.
    """
    strategy: Any = "auto" if single else ThreeDStrategy(tp=tp, pp=pp, print_layout=False, **(schedule or {}))
    return L.Trainer(
        accelerator="cpu",
        devices=1 if single else tp * pp * dp,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        **kwargs,
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def is_writer(trainer: L.Trainer) -> bool:
    """One rank per pipeline stage contributes full tensors (dp and tp coordinate 0)."""
    strategy = trainer.strategy
    if not isinstance(strategy, ThreeDStrategy):
        return True
    mesh = strategy.device_mesh
    return mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0


def gather(named: dict[str, torch.Tensor], contribute: bool) -> dict[str, torch.Tensor]:
    if not dist.is_initialized():
        return named
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, named if contribute else {})
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out


def snapshot(trainer: L.Trainer, module: L.LightningModule) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters and optimizer states as full tensors, keyed by name (collective)."""
    params = {n: full(p) for n, p in module.named_parameters()}
    opt: dict[str, torch.Tensor] = {}
    if trainer.optimizers:
        optimizer = trainer.optimizers[0]
        names = {id(p): n for n, p in module.named_parameters()}
        for p, st in optimizer.state.items():
            for k, v in st.items():
                opt[f"{names[id(p)]}.{k}"] = full(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
    writer = is_writer(trainer)
    return {"params": gather(params, writer), "opt": gather(opt, writer)}


def local_snapshot(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """This rank's local parameter shards (no communication)."""
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


class Recorder(L.Callback):
    """Per-step returned losses, plus full snapshots at chosen steps, at train start and at the end."""

    def __init__(self, at_steps: tuple[int, ...] = ()) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.at_steps = at_steps
        self.snapshots: dict[Any, Any] = {}

    def on_train_start(self, trainer, pl_module):
        self.snapshots["start"] = snapshot(trainer, pl_module)
        self.snapshots["start_step"] = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.steps.append(trainer.global_step)
        if trainer.global_step in self.at_steps:
            self.snapshots[trainer.global_step] = snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.snapshots["end"] = snapshot(trainer, pl_module)

    def record(self) -> dict[str, Any]:
        return {"losses": self.losses, "steps": self.steps, **{f"snap_{k}": v for k, v in self.snapshots.items()}}
