"""Checkpoints when a stage boundary lies inside a layer (``pieces.py``), pp2 x dp2 (Lightning's launcher).

``TinyGPT`` (built in ``configure_model``) with every stage boundary inside a layer (``CutInsideBlocks``: block 1's
attention on stage 0, its MLP on stage 1), 6 steps, saving every step (``OUT/parts``); then, in the same launch:

* ``parts_from3``: the step-3 checkpoint resumed at the same split, to step 6;
* ``whole_from3``: the same checkpoint resumed with whole layers (the uniform split: block 1 entirely on stage 0),
  to step 6.

Rank 0 writes ``OUT/parts.pt``: per run the returned losses and full snapshots (parameters and Adam states) at the
start, at step 3 and at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import Recorder, trainer

from models import MODELS, CutInsideBlocks, loader

STEPS, DP, GLOBAL_BATCH = 6, 2, 8


def run(out: Path, partitioner: object, callbacks: list, ckpt_path: str | None = None) -> dict:
    L.seed_everything(1234, verbose=False)
    recorder = Recorder(at_steps=(3,))
    settings = {"partitioner": partitioner, "micro_batches": 2}
    t = trainer(1, 2, DP, STEPS, [recorder, *callbacks], schedule=settings)
    t.fit(
        MODELS["gpt"](build="configure"), train_dataloaders=loader("gpt", GLOBAL_BATCH // DP, 48), ckpt_path=ckpt_path
    )
    return recorder.record()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    every = ModelCheckpoint(dirpath=out / "parts", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    rec = {"parts_saving": run(out, CutInsideBlocks(), [every])}
    step3 = str(out / "parts" / "step=3.ckpt")
    rec["parts_from3"] = run(out, CutInsideBlocks(), [], ckpt_path=step3)
    rec["whole_from3"] = run(out, "uniform", [], ckpt_path=step3)
    if torch.distributed.get_rank() == 0:
        torch.save(rec, out / "parts.pt")


if __name__ == "__main__":
    main()
