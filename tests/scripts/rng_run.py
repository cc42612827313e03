"""Dropout masks under tp2 x pp2: the body's random streams (``lightning_3d/rng.py``).

A body of two pre-norm residual MLP blocks, one per pipeline stage, each ``norm -> fc -> ReLU -> dropout
(inner: a tensor-parallel region) -> proj -> dropout (outer: replicated)``. Every dropout records its input and
output at every training call: torch's shape inference for the new schedule (on stage 1 with uninitialised
inputs), then the real micro-batches. Rank 0 writes every rank's records, with their coordinates, to ``OUT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import loader


def record_calls(module: nn.Module, args, output) -> None:
    if module.training:
        module.__dict__.setdefault("calls", []).append((args[0].detach().clone(), output.detach().clone()))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)  # pre-norm, as in a transformer: the residual stream stays whole
        self.fc, self.act, self.inner = nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5)
        self.proj, self.outer = nn.Linear(64, 32), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(self.proj(self.inner(self.act(self.fc(self.norm(x))))))


class DropoutModel(L.LightningModule):
    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(nn.Linear(16, 32), Block(), Block(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    model = DropoutModel()
    model.configure_model()  # built on the meta device by the strategy otherwise; hooks survive materialisation
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(record_calls)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ThreeDStrategy(tp=2, pp=2, micro_batches=2, print_layout=False),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, loader("mlp", 32))
    masks = {n: m.calls for n, m in model.named_modules() if "calls" in m.__dict__}
    coords = {d: trainer.strategy.device_mesh[d].get_local_rank() for d in ("dp", "pp", "tp")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"coords": coords, "masks": masks})
    if trainer.global_rank == 0:
        torch.save(gathered, args.out)


if __name__ == "__main__":
    main()
