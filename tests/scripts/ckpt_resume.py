"""Save and exact resume at one layout, ModelCheckpoint top-k / last / removal, and another model's checkpoint.

Runs, in one launch (Lightning's launcher starts the ranks), all writing ``OUT/resume.pt`` from rank 0:

* ``straight``: NoisyMLP, 10 steps, no checkpoint (the reference);
* ``saving``: the same with a ModelCheckpoint that saves after every step (must not perturb the run);
* ``from4`` / ``from5``: resume from the step-4 (end of epoch 0) and step-5 (mid-epoch 1) checkpoints to 10;
* ``drop_straight`` / ``drop_from5``: a model with dropout in the body, resumed from step 5;
* ``acc_straight`` / ``acc_from3``: the same with ``accumulate_grad_batches=2`` (two batches per optimizer step),
  resumed from the step-3 checkpoint, which falls in the middle of epoch 1;
* ``clean``: noise-free run that keeps every step's checkpoint in ``OUT/all`` (for the reshard tests, with full
  snapshots at step 5 and the continuation) and runs ModelCheckpoint(monitor, top-2, save_last) in ``OUT/top``;
* ``wrong``: ``trainer.fit(OtherMLP(), ckpt_path=step 5)`` must fail naming keys, with parameters unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import DropoutMLP, NoisyMLP, OtherMLP, Recorder, loader, local_snapshot, trainer

STEPS = 10


class Snapshot(L.Callback):
    """Local parameter shards when fit starts (after setup, before a checkpoint is restored)."""

    def on_fit_start(self, trainer, pl_module):
        self.before = local_snapshot(pl_module)


def run(
    args,
    name: str,
    model: L.LightningModule,
    ckpt_path: str | None = None,
    callbacks=(),
    at_steps=(),
    **trainer_kwargs,
) -> dict:
    L.seed_everything(1234, verbose=False)
    recorder = Recorder(at_steps)
    t = trainer(args.tp, args.pp, args.dp, STEPS, [recorder, *callbacks], **trainer_kwargs)
    t.fit(model, train_dataloaders=loader(args.dp), ckpt_path=ckpt_path)
    result = recorder.record()
    result["ckpt_path"] = t.ckpt_path
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rec: dict = {}
    rec["straight"] = run(args, "straight", NoisyMLP())
    every = ModelCheckpoint(dirpath=out / "noisy", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    rec["saving"] = run(args, "saving", NoisyMLP(), callbacks=[every])
    rec["from4"] = run(args, "from4", NoisyMLP(), ckpt_path=str(out / "noisy" / "step=4.ckpt"))
    rec["from5"] = run(args, "from5", NoisyMLP(), ckpt_path=str(out / "noisy" / "step=5.ckpt"))
    drop = ModelCheckpoint(dirpath=out / "drop", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    rec["drop_straight"] = run(args, "drop_straight", DropoutMLP(), callbacks=[drop])
    rec["drop_from5"] = run(args, "drop_from5", DropoutMLP(), ckpt_path=str(out / "drop" / "step=5.ckpt"))
    acc = ModelCheckpoint(dirpath=out / "acc", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    rec["acc_straight"] = run(args, "acc_straight", NoisyMLP(), callbacks=[acc], accumulate_grad_batches=2)
    rec["acc_from3"] = run(
        args, "acc_from3", NoisyMLP(), ckpt_path=str(out / "acc" / "step=3.ckpt"), accumulate_grad_batches=2
    )

    keep_all = ModelCheckpoint(dirpath=out / "all", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    top = ModelCheckpoint(
        dirpath=out / "top",
        monitor="train_loss",
        save_top_k=2,
        save_last=True,
        every_n_train_steps=1,
        filename="{step}-{train_loss:.4f}",
    )
    rec["clean"] = run(args, "clean", NoisyMLP(noise=False), callbacks=[keep_all, top], at_steps=(5,))
    rec["top"] = {
        "best_k": {str(k): float(v) for k, v in top.best_k_models.items()},
        "best": top.best_model_path,
        "last": top.last_model_path,
        "listing": sorted(os.listdir(out / "top")),
    }

    snap = Snapshot()
    L.seed_everything(1234, verbose=False)
    t = trainer(args.tp, args.pp, args.dp, STEPS, [snap])
    try:
        t.fit(OtherMLP(), train_dataloaders=loader(args.dp), ckpt_path=str(out / "all" / "step=5.ckpt"))
        rec["wrong"] = {"error": None}
    except Exception as exc:  # every rank raises the same error
        after = local_snapshot(t.lightning_module)
        same = all(torch.equal(snap.before[k], after[k]) for k in snap.before) and snap.before.keys() == after.keys()
        opt_empty = all(not o.state for o in t.optimizers)
        rec["wrong"] = {"error": f"{type(exc).__name__}: {exc}", "unchanged": same, "optimizer_untouched": opt_empty}
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, rec["wrong"].get("unchanged"))
    rec["wrong"]["unchanged_all_ranks"] = flags
    if t.global_rank == 0:
        torch.save(rec, out / "resume.pt")


if __name__ == "__main__":
    main()
