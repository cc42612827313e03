"""Exact resume, ModelCheckpoint and validation under a CSV action list and torch's V schedules (pp2 x dp2).

Under a V placement (stage ``i`` and ``2p - 1 - i`` on pp rank ``i``) rank 0 holds the first AND the last of the
four stages (one Linear each): the loss, the logs and the checkpoint shards of the last Linear live on rank 0, not
on the last pp rank as under 1F1B, and rank 1 runs two stages that both draw dropout masks. One launch (4 ranks,
Lightning's launcher); every run trains ``DropoutMLP`` (dropout on three stages, and torch, python and numpy random
numbers in each training step) for 10 steps with validation every 2 batches (36 samples, 18 per replica: batches
of 8, 8 and a short 2, which runs 2 micro-batches forward-only over the V). Rank 0 writes ``OUT/schedules.pt``:

* ``csv_plain``: ``schedule="conf/schedules/zbv_pp2_m4.csv"`` (torch's ZB-V written out, run by torch's
  ``_PipelineScheduleRuntime``), no checkpointing: the reference;
* ``csv_saving``: the same with a ModelCheckpoint saving every step (``OUT/csv``) and one keeping the two best
  ``val_loss`` checkpoints (``OUT/csv_top``): must not change a bit of the run;
* ``csv_from5``: ``fit(ckpt_path=OUT/csv/step=5.ckpt)`` (mid-epoch 1) to step 10, saving every step into
  ``OUT/csv_resumed``;
* ``zbv_saving`` / ``zbv_from5`` and ``dualpipev_saving`` / ``dualpipev_from5``: the same resume under torch's
  ``zbvzerobubble`` and ``dualpipev`` (``OUT/zbv``, ``OUT/dualpipev``); ``zbh1_saving`` / ``zbh1_from5``: under
  ``interleavedzerobubble`` with one stage per rank (ZB-H1: 1F1B's placement, split backwards; ``OUT/zbh1``);
* ``csv_acc_saving`` / ``csv_acc_from3``: the CSV list with ``accumulate_grad_batches=2`` (20 batches, the
  data-parallel reduction held back every other batch), resumed from the step-3 checkpoint (mid-epoch 1);
* ``csv_quiet_from5`` / ``1f1b_from_csv5``: the CSV checkpoint of step 5 loaded under the CSV list again and under
  plain 1F1B at pp2 (two stages, one per rank: the last Linear now on pp rank 1), to step 10 with no noise and
  ``p=0`` (which rank draws the step's random numbers depends on the placement);
* ``validate``: ``trainer.validate(ckpt_path=OUT/csv/step=10.ckpt)`` under the CSV list and under 1F1B.

Each run records the returned losses, the logged ``train_loss`` and ``val_loss`` (every rank's, to check they
agree), full snapshots of parameters and optimizer states (at train start, step 5 and the end) and, for the top-k
callback, what it kept.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import GLOBAL_BATCH, NoisyMLP, Recorder, dataset, loader, trainer

STEPS = 10
VAL_SAMPLES = 36  # 18 per replica at dp2: batches of 8, 8 and 2
CSV = Path(__file__).resolve().parents[2] / "conf" / "schedules" / "zbv_pp2_m4.csv"
SCHEDULES: dict[str, dict[str, Any]] = {
    "csv": {"schedule": str(CSV), "stages_per_rank": 2, "micro_batches": 4},
    "zbv": {"schedule": "zbvzerobubble", "stages_per_rank": 2, "micro_batches": 4},
    "dualpipev": {"schedule": "dualpipev", "stages_per_rank": 2, "micro_batches": 4},
    # ZB-H1: torch's interleaved zero-bubble schedule over one stage per rank (split backwards, 1F1B's placement)
    "zbh1": {"schedule": "interleavedzerobubble", "stages_per_rank": 1, "micro_batches": 4},
    "1f1b": {"schedule": "1f1b", "micro_batches": 4},
}


class Logged(L.Callback):
    """What ``self.log`` delivered to this rank: ``train_loss`` after every batch, ``val_loss`` after every
    validation run of ``fit`` (with the step it ran at)."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


class DropoutMLP(NoisyMLP):
    """NoisyMLP with dropout after each of its first three Linears: under the V (one Linear per stage), the first
    stage draws on pp rank 0 and both stages of pp rank 1 draw. ``p=0.0`` keeps the keys and drops nothing."""

    def __init__(self, p: float = 0.2, **kwargs: Any) -> None:
        self.p = p  # before TinyMLP's __init__, which may build the body
        super().__init__(**kwargs)

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        hidden = [m for _ in range(2) for m in (nn.Linear(32, 32), nn.ReLU(), nn.Dropout(self.p))]
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(self.p), *hidden, nn.Linear(32, 4))


def every_step(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=-1)


def val_loader(dp: int) -> DataLoader:
    return DataLoader(dataset("mlp", VAL_SAMPLES, seed=1), batch_size=GLOBAL_BATCH // dp)


def run(
    dp: int,
    schedule: str,
    ckpt_path: Path | None = None,
    callbacks: tuple = (),
    quiet: bool = False,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    recorder, logged = Recorder(at_steps=(5,)), Logged()
    kwargs = {"val_check_interval": 2, **trainer_kwargs}
    t = trainer(1, 2, dp, STEPS, [recorder, logged, *callbacks], schedule=SCHEDULES[schedule], **kwargs)
    t.fit(
        DropoutMLP(p=0.0, noise=False) if quiet else DropoutMLP(),
        train_dataloaders=loader(dp),
        val_dataloaders=val_loader(dp),
        ckpt_path=None if ckpt_path is None else str(ckpt_path),
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"train": logged.train, "val": logged.val})
    return {**recorder.record(), "logged_train": logged.train, "logged_val": logged.val, "logged_by_rank": everyone}


def validate(dp: int, schedule: str, ckpt_path: Path) -> float:
    """``trainer.validate`` of a checkpoint (weights only, no optimizer) under ``schedule``: the logged ``val_loss``."""
    t = trainer(1, 2, dp, STEPS, [], schedule=SCHEDULES[schedule])
    result = t.validate(DropoutMLP(), dataloaders=val_loader(dp), ckpt_path=str(ckpt_path), verbose=False)
    return float(result[0]["val_loss"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rec: dict[str, Any] = {}
    rec["csv_plain"] = run(args.dp, "csv")
    top = ModelCheckpoint(dirpath=out / "csv_top", monitor="val_loss", save_top_k=2, filename="{step}-{val_loss:.5f}")
    rec["csv_saving"] = run(args.dp, "csv", callbacks=(every_step(out / "csv"), top))
    rec["csv_top"] = {
        "best_k": {str(k): float(v) for k, v in top.best_k_models.items()},
        "best": top.best_model_path,
        "listing": sorted(os.listdir(out / "csv_top")),
    }
    rec["csv_from5"] = run(args.dp, "csv", out / "csv" / "step=5.ckpt", (every_step(out / "csv_resumed"),))
    for name in ("zbv", "dualpipev", "zbh1"):
        rec[f"{name}_saving"] = run(args.dp, name, callbacks=(every_step(out / name),))
        rec[f"{name}_from5"] = run(args.dp, name, out / name / "step=5.ckpt")
    acc = every_step(out / "csv_acc")
    rec["csv_acc_saving"] = run(args.dp, "csv", callbacks=(acc,), accumulate_grad_batches=2, val_check_interval=4)
    rec["csv_acc_from3"] = run(
        args.dp, "csv", out / "csv_acc" / "step=3.ckpt", accumulate_grad_batches=2, val_check_interval=4
    )
    # Another layout: noise-free continuations (which rank draws the step's random numbers depends on the placement:
    # under the V, rank 0 also runs the last stage's steps), under the CSV list and under 1F1B, from one checkpoint.
    step5 = out / "csv" / "step=5.ckpt"
    rec["csv_quiet_from5"] = run(args.dp, "csv", step5, quiet=True)
    rec["1f1b_from_csv5"] = run(args.dp, "1f1b", step5, quiet=True)
    # trainer.validate(ckpt_path=...): the weights of step 10 (saved under the CSV list), validated under it and 1F1B
    rec["validate"] = {name: validate(args.dp, name, out / "csv" / "step=10.ckpt") for name in ("csv", "1f1b")}
    if dist.get_rank() == 0:
        torch.save(rec, out / "schedules.pt")


if __name__ == "__main__":
    main()
