"""Lightning's callbacks that hold or change the model's parameters, under ThreeDStrategy against one device
(float64).

``--callback ema``: ``EMAWeightAveraging`` (updated every step; validation runs on the averaged weights, swapped in
and out by the callback; at the end of fit the averaged weights become the model's). ``--callback swa``:
``StochasticWeightAveraging`` from epoch 1 (its own learning-rate schedule; the average becomes the model's after
the last epoch). Both copy the model before the strategy splits it; under the pipeline each rank must average its
own stages' tensors. ``--callback finetune``: a ``BaseFinetuning`` that freezes the first block and the head
before training and unfreezes them into a new parameter group at epoch 1 (Lightning's filter of the parameters
already in the optimizer compared values with ``torch.equal``: a collective per pair on DTensors).
``--callback prune`` / ``prune-global``: ``ModelPruning`` (L1, 30% at the end of every epoch, each tensor alone or
all of them together), which lists the modules to prune before the strategy splits the model.
``--callback none --detect-anomaly``: no such callback, ``Trainer(detect_anomaly=True)`` (``--nan-step N``: the
loss of step N times NaN, which anomaly detection must report from the backward).

``--save DIR`` keeps ``last.ckpt`` there (EMA moves the trained weights to the checkpoint's
``current_model_state``, SWA keeps its average in its callback state), ``--resume`` continues from one, possibly
saved at another layout. Rank 0 writes to ``OUT`` the training loss of every step, the validation loss of every
epoch and, after fit, the loss of a ``trainer.validate`` of the final weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import NanoGPT, OrderedData, same_start

LAYOUTS = {
    "single": None,
    "tp2pp2": {"tp": 2, "pp": 2},
    "pp2dp2": {"pp": 2},
    "pp2dp2fsdp": {"pp": 2, "data_parallel": "fsdp"},
    "pp2": {"pp": 2},
    "pp4": {"pp": 4},
}
WORLD = {"pp2": 2}  # processes per layout; 4 otherwise
BATCH = 8


class TrainableOnly(NanoGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)


class UnfreezeAtEpoch1(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze([pl_module.transformer.h[0], pl_module.lm_head])

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            modules = [pl_module.transformer.h[0], pl_module.lm_head]
            self.unfreeze_and_add_param_group(modules=modules, optimizer=optimizer, lr=0.005)


class NanAtStep(NanoGPT):
    """The loss times NaN at global step ``nan_step`` (after the model call: on the last stage)."""

    nan_step = -1

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.nan_step:
            loss = loss * torch.tensor(-1.0, dtype=loss.dtype).sqrt()
        return loss


class Record(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.rows.append({"step": trainer.global_step, "train_loss": float(trainer.callback_metrics["train_loss"])})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.rows.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"])})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    kinds = ["ema", "swa", "finetune", "prune", "prune-global", "none"]
    parser.add_argument("--callback", choices=kinds, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--detect-anomaly", action="store_true")
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--tied-finetune", action="store_true", help="finetune with the head tied to the embedding")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    # a head tied to the embedding across stages, unfrozen by unfreezing the head alone, is refused (the first
    # stage's copy would stay frozen): ``--tied-finetune``
    finetune = args.callback == "finetune"
    model = (TrainableOnly if finetune else NanAtStep)(build="init", tie=not finetune or args.tied_finetune)
    model.nan_step = args.nan_step
    same_start(model, args.init)
    layout = LAYOUTS[args.layout]
    if layout is None:
        kwargs: dict[str, object] = {"devices": 1}
        dp = 1
    else:
        world = WORLD.get(args.layout, 4)
        dp = world // (layout.get("tp", 1) * layout["pp"])
        kwargs = {"devices": world, "strategy": ThreeDStrategy(micro_batches=max(2, layout["pp"]), **layout)}
    record = Record()
    callbacks: list[L.Callback] = [record]
    if args.callback == "ema":
        callbacks.insert(0, EMAWeightAveraging(decay=0.5))
    elif args.callback == "swa":
        callbacks.insert(0, StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=1))
    elif args.callback.startswith("prune"):
        global_ = args.callback == "prune-global"
        callbacks.insert(0, ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=global_))
    elif finetune:
        callbacks.insert(0, UnfreezeAtEpoch1())
    if args.save:
        callbacks.append(ModelCheckpoint(dirpath=args.save, save_last=True, save_top_k=0))
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=args.save is not None,
        enable_model_summary=False,
        callbacks=callbacks,
        detect_anomaly=args.detect_anomaly,
        **kwargs,
    )
    data = OrderedData("nano", batch_size=BATCH // dp, n=64, val_n=16)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    (result,) = trainer.validate(model, datamodule=data, verbose=False)
    record.rows.append({"final_val_loss": result["val_loss"]})
    if trainer.global_rank == 0:
        args.out.write_text(json.dumps(record.rows))


if __name__ == "__main__":
    main()
