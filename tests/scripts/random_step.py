"""A training step that draws random numbers before the body (``before``), after it (``after``) or not at all.

Three fits of 3 steps at pp2 x dp2 in one launch (4 processes, Lightning's launcher); every rank records the
warnings it raised; rank 0 writes them, per case and rank, to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
import weakref
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import TinyMLP, loader


class RandomStep(TinyMLP):
    def __init__(self, where: str) -> None:
        super().__init__(scheduler=False)
        self.where = where

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.where == "before":  # a random input mask that the loss also uses: the case the warning is for
            keep = torch.rand(x.shape[0]) > 0.25
            x = x * keep[:, None]
        logits = self(x)
        if self.where == "after":  # label smoothing by chance: drawn after the body, the same on every stage
            smoothing = float(torch.rand(()) * 0.1)
            return F.cross_entropy(logits, y, label_smoothing=smoothing)
        return F.cross_entropy(logits, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    counts: dict[str, object] = {}
    fitted: list[weakref.ref] = []
    for where in ("none", "after", "before"):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=ThreeDStrategy(pp=2, print_layout=False),
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = RandomStep(where)
            trainer.fit(model, loader("mlp", 8))
        fitted += [weakref.ref(model), weakref.ref(trainer.strategy)]
        texts = [str(w.message) for w in caught if "before calling the body" in str(w.message)]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, texts)
        counts[where] = gathered
    rank = trainer.global_rank
    del model, trainer
    gc.collect()
    alive = [type(ref()).__name__ for ref in fitted if ref() is not None]
    counts["alive_after_fits"] = [None] * dist.get_world_size()
    dist.all_gather_object(counts["alive_after_fits"], alive)
    if rank == 0:
        Path(args.out).write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
