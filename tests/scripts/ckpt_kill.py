"""A save killed midway never becomes the checkpoint that is resumed.

``--phase kill``: NoisyMLP with ModelCheckpoint(every 2 steps, keep all, save_last). While ``last.ckpt`` is
being replaced at step 4, rank 0 SIGKILLs itself after DCP has written every shard and ``.metadata`` but
before ``meta.pt`` and the rename: the most complete an unfinished checkpoint can look. The job dies.

``--phase resume``: ``fit(ckpt_path="last")`` with the same ModelCheckpoint, to step 6, and a reference run of
6 steps without interruption; rank 0 writes ``OUT/kill.pt`` with both runs' losses and final parameters, the
checkpoint Lightning picked, and the folder listing before and after.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import NoisyMLP, Recorder, loader, trainer

import lightning_3d.checkpoint as ckpt


def checkpointing(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("kill", "resume"), required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    folder = out / "kill"
    if args.phase == "kill":
        write_meta = ckpt._write_meta

        def killing(checkpoint: dict, file: Path) -> None:
            if checkpoint.get("global_step") == 4 and file.parent.name == ".last.ckpt.partial":
                print(f"KILLING rank 0 while saving {file.parent}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            write_meta(checkpoint, file)

        ckpt._write_meta = killing
        L.seed_everything(1234, verbose=False)
        t = trainer(1, args.pp, args.dp, 6, [checkpointing(folder)])
        t.fit(NoisyMLP(), train_dataloaders=loader(args.dp))
        return
    before = sorted(os.listdir(folder))
    L.seed_everything(1234, verbose=False)
    resumed = Recorder()
    t = trainer(1, args.pp, args.dp, 6, [resumed, checkpointing(folder)])
    t.fit(NoisyMLP(), train_dataloaders=loader(args.dp), ckpt_path="last")
    picked = t.ckpt_path
    L.seed_everything(1234, verbose=False)
    straight = Recorder()
    t = trainer(1, args.pp, args.dp, 6, [straight])
    t.fit(NoisyMLP(), train_dataloaders=loader(args.dp))
    if t.global_rank == 0:
        rec = {
            "before": before,
            "after": sorted(os.listdir(folder)),
            "picked": picked,
            "resumed": resumed.record(),
            "straight": straight.record(),
        }
        torch.save(rec, out / "kill.pt")


if __name__ == "__main__":
    main()
