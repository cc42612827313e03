"""State the user's step keeps after the model call, without sanity validation, against one device (float64).

A nanoGPT (blocks in a ``ModuleList``: the per-stage step path) with torchmetrics accuracies in training (epoch value)
and validation; a ``MetricCollection`` of macro F1 and precision whose forward's tensors training logs per step;
and Lightning's documented recipe for epoch-end values: ``training_step`` / ``validation_step`` append each loss to
a list, ``on_train_epoch_end`` / ``on_validation_epoch_end`` log the stacked mean (training with
``sync_dist=True``), and a callback of the user's that logs the stacked mean of the validation list too;
``num_sanity_val_steps=0``; then ``trainer.test``. Rank 0 writes to ``OUT`` the logged values,
the test accuracy, and each last-stage rank's validation list (entries and mean) per epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import NanoGPT, OrderedData, quiet_trainer, same_start

LAYOUTS = {"single": None, "tp2pp2": {"tp": 2, "pp": 2}, "pp2dp2": {"pp": 2}}
BATCH = 8


class Counted(NanoGPT):
    def __init__(self) -> None:
        super().__init__(build="init")
        self.train_acc = MulticlassAccuracy(num_classes=self.vocab, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=self.vocab, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=self.vocab, average="micro")
        macro = {
            "f1": MulticlassF1Score(self.vocab, average="macro"),
            "prec": MulticlassPrecision(self.vocab, average="macro"),
        }
        self.train_macro = MetricCollection(macro, prefix="train_")  # compute groups on (torchmetrics' default)
        self.val_losses: list[torch.Tensor] = []
        self.train_losses: list[torch.Tensor] = []
        self.seen: list[dict[str, float]] = []  # per validation epoch: the list's length and mean

    def _logits(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return self(x).reshape(-1, self.vocab), y.reshape(-1)

    def training_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        self.train_acc.update(logits, y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        # the tensors the collection's forward returns (its docs' recipe): the batch's macro values, not a micro-batch's
        self.log_dict(self.train_macro(logits, y), on_step=True, on_epoch=False)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.train_losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train_epoch_average", torch.stack(self.train_losses).mean(), sync_dist=True)
        self.train_losses.clear()

    def validation_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)
        self.val_losses.append(loss.detach())
        return loss

    def on_validation_epoch_end(self) -> None:
        # the list is the last stage's (the other stages' steps stop at their blocks): its entries per rank
        self.seen.append(
            {"entries": len(self.val_losses), "mean": float(torch.stack(self.val_losses).mean())}
            if self.val_losses
            else {}
        )
        self.log("val_epoch_average", torch.stack(self.val_losses).mean())  # Lightning's recipe, as it is
        self.val_losses.clear()

    def test_step(self, batch, batch_idx):
        logits, y = self._logits(batch)
        self.test_acc.update(logits, y)
        self.log("test_acc", self.test_acc)


class ReadsTheList(L.Callback):
    """A callback of the user's reading the module's list at epoch end (Lightning runs it before the module's)."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("val_callback_average", torch.stack(pl_module.val_losses).mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    model = Counted()
    same_start(model, args.init)
    layout = LAYOUTS[args.layout]
    dp = 1 if layout is None else 4 // (layout.get("tp", 1) * layout["pp"])

    kwargs = {"devices": 1} if layout is None else {"devices": 4, "strategy": ThreeDStrategy(micro_batches=2, **layout)}
    fit = quiet_trainer(
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        callbacks=[ReadsTheList()],
        **kwargs,
    )

    data = OrderedData("nano", batch_size=BATCH // dp, n=64, val_n=16)
    fit.fit(model, datamodule=data)
    keys = ("train_acc", "val_acc", "train_epoch_average", "val_epoch_average", "train_f1", "train_prec")
    keys += ("val_callback_average",)
    row: dict[str, object] = {k: float(fit.callback_metrics[k]) for k in keys}
    (result,) = fit.test(model, datamodule=data, verbose=False)
    row["test_acc"] = result["test_acc"]
    seen: list[object] = [model.seen]
    if torch.distributed.is_initialized():  # every rank's lists; the last stage's hold entries
        seen = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(seen, model.seen)
    row["val_lists"] = [s for s in seen if s and s[0]]
    if fit.global_rank == 0:
        args.out.write_text(json.dumps(row))


if __name__ == "__main__":
    main()
