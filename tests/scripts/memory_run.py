"""Memory of a large GPT built in configure_model: no rank ever materialises the whole model.

Four ranks (tp2 x pp2) build the example GPT's "large" preset (86M parameters, 343 MB in float32) in
``configure_model`` (meta device) and train one step. Each rank records the growth of its peak RSS from just
before ``configure_model`` to the end of setup, and the elements of every parameter it holds. Rank 0 writes
``OUT/memory.pt``.
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_3d import ThreeDStrategy
from lightning_3d_examples.gpt import GPT


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Probe(L.Callback):
    def __init__(self, out: Path):
        self.out = out
        self.before = 0

    def setup(self, trainer, pl_module, stage):
        self.before = peak_rss_bytes()

    def on_fit_start(self, trainer, pl_module):
        growth = peak_rss_bytes() - self.before
        numels = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in pl_module.named_parameters()}
        mesh = trainer.strategy.device_mesh
        mine = {
            "coords": (mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()),
            "growth": growth,
            "numels": numels,
        }
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if trainer.global_rank == 0:
            full = {n: s.shape for n, s in trainer.strategy.full_spec.items() if s.is_parameter}
            torch.save({"ranks": ranks, "full_shapes": full}, self.out / "memory.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="large")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = GPT(preset=args.preset)
    block = model.config.block_size
    tokens = torch.randint(0, model.config.vocab_size, (8, 9))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    assert block >= 8
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ThreeDStrategy(tp=2, pp=2, micro_batches=2, print_layout=False),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe(Path(args.out))],
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
