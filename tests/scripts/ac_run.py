"""Activation checkpointing under tp2 x pp2 with dropout, float64: one launch, several fits.

A body of an input layer, four pre-norm residual MLP blocks (dropout inside the tensor-parallel region and on
the replicated output) and a head; two blocks per pipeline stage. Each case starts from the same weights and
records every step's gradients as full tensors (rank 0 writes them to ``OUT/<case>.pt``):

* ``off``, ``full``, ``every2``, ``selective`` with dropout 0.5: the test compares the last three with ``off``
  bitwise (the recomputation draws the very masks the forward drew, from the stage and region streams);
* ``nodrop_full`` with dropout 0: rank 0 also computes the first step's gradients in one plain process
  (``OUT/nodrop_ref.pt``), the single-device reference;
* ``nano_off``, ``nano_full``, ``nano_selective``: the test model of nanoGPT's layout (blocks in an
  ``nn.ModuleList``, split by the stage executor), the checkpointed cases compared with ``nano_off``.
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
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import MODELS, OrderedData, loader

CASES = {"off": (0.5, None), "full": (0.5, "full"), "every2": (0.5, 2), "selective": (0.5, "selective")}
CASES["nodrop_full"] = (0.0, "full")
# a model split at its block container (nn.ModuleList; the stage executor's hooks on the checkpointed blocks)
NANO_CASES = {"nano_off": None, "nano_full": "full", "nano_selective": "selective"}


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.fc, self.act, self.inner = nn.Linear(32, 64), nn.ReLU(), nn.Dropout(p)
        self.proj, self.outer = nn.Linear(64, 32), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(self.proj(self.inner(self.act(self.fc(self.norm(x))))))


class DropoutModel(L.LightningModule):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), *(Block(p) for _ in range(4)), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Grads(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        mine = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in pl_module.named_parameters()
            if p.grad is not None
        }
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        self.steps.append(merged)


def reference_grads(p: float) -> dict[str, torch.Tensor]:
    """The first step's gradients in one plain process (dropout off: no random stream matters)."""
    L.seed_everything(0, verbose=False)
    model = DropoutModel(p).double()
    x, y = next(iter(loader("mlp", 32)))
    F.cross_entropy(model(x.double()), y).backward()
    return {n: q.grad.detach().clone() for n, q in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    runs = [(case, "mlp", p, ac) for case, (p, ac) in CASES.items()]
    runs += [(case, "nano", 0.0, ac) for case, ac in NANO_CASES.items()]
    for case, data, p, ac in runs:
        L.seed_everything(0, verbose=False)
        model = DropoutModel(p) if data == "mlp" else MODELS["nano"](build="init")
        grads = Grads()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=ThreeDStrategy(tp=2, pp=2, micro_batches=2, activation_checkpointing=ac, print_layout=True),
            precision="64-true",
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[grads],
            use_distributed_sampler=False,  # Lightning's sampler would shuffle: the reference reads in order
        )
        trainer.fit(model, datamodule=OrderedData(data, 32))
        names = sorted(n for n, q in model.named_parameters())
        if trainer.global_rank == 0:
            torch.save({"steps": grads.steps, "names": names}, out / f"{case}.pt")
    if dist.get_rank() == 0:
        torch.save(reference_grads(0.0), out / "nodrop_ref.pt")


if __name__ == "__main__":
    main()
