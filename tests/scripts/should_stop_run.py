"""``self.trainer.should_stop = True`` set in ``training_step`` after the model call, against one device (float64).

Code after ``self(x)`` runs on the last pipeline stage only, so the request is made there. ``--when batch``: at a
fixed batch of epoch 1 (the same step on any layout); ``--when loss``: when the step's loss falls below a threshold
(under pipeline parallelism each micro-batch's loss, so any replica's micro-batch may trip it). ``--metric`` also logs
a torchmetrics accuracy (the logs then travel by object, not in the packed tensor). Every rank writes its global step
and its callback metrics to ``OUT/rank<N>.json``: every rank must have stopped at the same step, none left waiting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import NanoGPT, OrderedData, quiet_trainer, same_start

LAYOUTS = {"single": None, "pp2": {"pp": 2}, "pp2dp2": {"pp": 2}, "tp2pp2": {"tp": 2, "pp": 2}}
STOP_EPOCH, STOP_BATCH, THRESHOLD = 1, 2, 3.5


class Stopping(NanoGPT):
    def __init__(self, when: str, metric: bool) -> None:
        super().__init__(build="init")
        self.when = when
        self.acc = MulticlassAccuracy(num_classes=self.vocab, average="micro") if metric else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).reshape(-1, self.vocab)
        loss = torch.nn.functional.cross_entropy(logits, y.reshape(-1))
        self.log("train_loss", loss)
        if self.acc is not None:
            self.acc.update(logits, y.reshape(-1))
            self.log("train_acc", self.acc, on_step=True, on_epoch=False)
        if self.when == "batch" and self.current_epoch == STOP_EPOCH and batch_idx == STOP_BATCH:
            self.trainer.should_stop = True
        if self.when == "loss" and loss < THRESHOLD:
            self.trainer.should_stop = True
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--when", choices=("batch", "loss"), required=True)
    parser.add_argument("--metric", action="store_true")
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    model = Stopping(args.when, args.metric)
    same_start(model, args.init)
    layout = LAYOUTS[args.layout]
    world = {"single": 1, "pp2": 2}.get(args.layout, 4)
    dp = 1 if layout is None else world // (layout.get("tp", 1) * layout["pp"])
    kwargs = (
        {"devices": 1}
        if layout is None
        else {"devices": world, "strategy": ThreeDStrategy(micro_batches=2, train_timeout=60, **layout)}
    )
    trainer = quiet_trainer(
        max_epochs=3,
        limit_train_batches=6,
        limit_val_batches=1,
        **kwargs,
    )
    trainer.fit(model, datamodule=OrderedData("nano", batch_size=8 // dp, n=64, val_n=8))
    args.out.mkdir(parents=True, exist_ok=True)
    row = {"step": trainer.global_step, "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
