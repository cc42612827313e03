"""Validation, test, predict and torchmetrics through the pipeline, against a single-device reference.

One launch: ``fit`` with sanity validation on and validation every 2 training batches, then standalone
``validate``, ``test`` and ``predict``. The validation set (44 samples, global batch 16) ends with a short
batch, so evaluation sees a micro-batch count that does not divide every batch. Rank 0 writes
``OUT/eval.pt``: per-step training values, every validation epoch's values, the validate/test results and
the predictions (the 3D run's are its data-parallel replica's share, in dataset order). A ``BasePredictionWriter``
written as Lightning documents it (the DDP habit: one file per global rank) writes to ``OUT/written``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import MetricMLP, OrderedData

GLOBAL_BATCH, VAL_N = 16, 44


class Writer(BasePredictionWriter):
    """Lightning's documented prediction writer: each rank saves what it holds, named by its global rank."""

    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="epoch")
        self.out = out

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.out.mkdir(exist_ok=True)
        torch.save((predictions, batch_indices), self.out / f"predictions_{trainer.global_rank}.pt")


class Recorder(L.Callback):
    def __init__(self, out: Path, ref: bool):
        self.out, self.ref = out, ref
        self.rec: dict = {"train": [], "val": [], "sanity_ran": 0}

    def on_fit_start(self, trainer, pl_module):
        init = self.out / "eval.init.pt"
        if self.ref:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, init)
        else:
            trainer.strategy.load_full_state_dict(torch.load(init))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rec["train"].append({k: float(m[k]) for k in ("train_loss", "train_acc_step") if k in m})

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            self.rec["sanity_ran"] += 1

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            m = trainer.callback_metrics
            self.rec["val"].append({k: float(m[k]) for k in ("val_loss", "val_acc") if k in m})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    L.seed_everything(7, verbose=False)
    if args.ref:
        strategy, devices, batch = "auto", 1, GLOBAL_BATCH
    else:
        strategy = ThreeDStrategy(
            tp=args.tp,
            pp=args.pp,
            micro_batches=args.micro,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            print_layout=False,
        )
        devices, batch = args.tp * args.pp * args.dp, GLOBAL_BATCH // args.dp
    recorder = Recorder(out, args.ref)
    # Callbacks read what rank 0 logs: their decisions must follow the single-device values.
    stopper = EarlyStopping(monitor="val_loss", patience=100, mode="min")
    best = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max", save_top_k=1, save_weights_only=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=6,
        val_check_interval=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder, stopper, best, Writer(out / "written")],
    )
    model = MetricMLP(build="configure", scheduler=False, lr=0.02)
    data = OrderedData("mlp", batch, n=GLOBAL_BATCH * 3, val_n=VAL_N)
    trainer.fit(model, datamodule=data)
    recorder.rec["early_stopping_best"] = float(stopper.best_score)
    recorder.rec["checkpoint_best"] = (float(best.best_model_score), Path(best.best_model_path).name)
    recorder.rec["validate"] = {
        k: float(v) for k, v in trainer.validate(model, datamodule=data, verbose=False)[0].items()
    }
    recorder.rec["test"] = {k: float(v) for k, v in trainer.test(model, datamodule=data, verbose=False)[0].items()}
    predictions = trainer.predict(model, datamodule=data)
    recorder.rec["predict"] = torch.cat([p.detach().cpu() for p in predictions])
    if trainer.global_rank == 0:
        torch.save(recorder.rec, out / "eval.pt")


if __name__ == "__main__":
    main()
