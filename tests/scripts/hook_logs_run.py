"""``self.log`` in the gradient hooks, with ``sync_dist=True``: one device against tp2 x pp2 (4 CPU processes).

The module logs ``lightning_3d.grad_norm`` (every parameter's gradient norm and the total, 2-norm and max-norm) in
``on_before_optimizer_step`` and, from a callback, a constant summed over processes in ``on_after_backward``: on
one device every key of the whole model and ``1.0``. Under the pipeline each stage holds half of the parameters
(tensor-parallel shards among them), a key another stage logged must still reach rank 0, and a world-wide sum
would count the constant four times. ``training_step`` also gathers its loss with ``self.all_gather`` after the
model call, code that runs on the last stage only: over the data-parallel replicas it is the loss (one device: the
loss itself); over the world it would wait for the first stage forever. Gradients are clipped by value. Rank 0
writes every step's ``callback_metrics`` to ``OUT`` (float64 run, initial weights from ``--init``, written by
``--single``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy, grad_norm

from models import NanoGPT, OrderedData

STEPS = 4


class GradLogged(NanoGPT):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("gathered_loss", self.all_gather(loss.detach()).mean())  # after the model call: the last stage only
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2), sync_dist=True)
        self.log_dict(grad_norm(self, norm_type="inf"))


class CountsBackward(L.Callback):
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("backward_calls", 1.0, reduce_fx="sum", sync_dist=True)


class Record(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    model = GradLogged(build="init")
    if args.single:
        torch.save(model.state_dict(), args.init)
        kwargs: dict[str, object] = {"devices": 1}
    else:
        model.load_state_dict(torch.load(args.init))
        kwargs = {"devices": 4, "strategy": ThreeDStrategy(tp=2, pp=2, micro_batches=2)}
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[CountsBackward(), record],
        # clipping by value, with plain and DTensor gradients on one stage under tp (torch's multi-tensor clamp
        # refuses the mix); 0.002 clips part of every step's gradients, so the later losses depend on it
        gradient_clip_val=0.002,
        gradient_clip_algorithm="value",
        **kwargs,
    )
    trainer.fit(model, datamodule=OrderedData("nano", batch_size=8, n=8 * STEPS))
    if trainer.global_rank == 0:
        args.out.write_text(json.dumps(record.steps))


if __name__ == "__main__":
    main()
