"""Manual optimization (``automatic_optimization = False``) under ThreeDStrategy at pp = 1, against one device
(float64).

The step uses what manual optimization is for: two optimizers (AdamW over the embeddings and blocks, SGD with
momentum over the final norm and head), ``manual_backward`` twice, ``clip_gradients`` on the first optimizer, a
second forward after the first optimizer's step (which must see the updated weights), ``toggle_optimizer`` around
the second backward, and an LR scheduler stepped by hand. ``--layout``: ``single``, ``tp2dp2`` (replicate),
``dp2fsdp``, ``tp2dp2fsdp``, ``dp4hsdp`` (HSDP, shards over 2), or ``pp2`` (refused). ``--save DIR`` /
``--resume CKPT``: ``last.ckpt`` after the run, or a run resumed from one (4 more steps). Rank 0 writes ``OUT``:
every step's logged losses, the final parameters as full tensors, and the error if the run was refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import NanoGPT, OrderedData, quiet_trainer, same_start

LAYOUTS = {
    "single": None,
    "tp2dp2": {"tp": 2},
    "dp2fsdp": {"data_parallel": "fsdp"},
    "tp2dp2fsdp": {"tp": 2, "data_parallel": "fsdp"},
    "dp4hsdp": {"data_parallel": "hsdp", "dp_shard": 2},
    "pp2": {"pp": 2},
}
WORLD = {"dp2fsdp": 2, "pp2": 2}
BATCH = 8


class Manual(NanoGPT):
    def __init__(self) -> None:
        super().__init__(build="init", example=True)
        self.automatic_optimization = False

    def configure_optimizers(self):
        head = [*self.transformer.ln_f.parameters(), *self.lm_head.parameters()]
        body = [p for p in self.parameters() if all(p is not q for q in head)]
        opt_body = torch.optim.AdamW(body, lr=0.01)
        opt_head = torch.optim.SGD(head, lr=0.05, momentum=0.9)
        return [opt_body, opt_head], [torch.optim.lr_scheduler.StepLR(opt_body, step_size=2, gamma=0.5)]

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        opt_body, opt_head = self.optimizers()
        loss = self._loss(batch)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_body, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_body.step()
        self.toggle_optimizer(opt_head)  # the head alone learns from the updated body
        head_loss = self._loss(batch)
        opt_head.zero_grad()
        self.manual_backward(head_loss)
        opt_head.step()
        self.untoggle_optimizer(opt_head)
        self.lr_schedulers().step()
        self.log("train_loss", loss, sync_dist=True)
        self.log("head_loss", head_loss, sync_dist=True)


class Record(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({k: float(metrics[k]) for k in ("train_loss", "head_loss")})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    model = Manual()
    same_start(model, args.init)
    layout = LAYOUTS[args.layout]
    dp = 1
    kwargs: dict[str, object] = {"devices": 1}
    if layout is not None:
        world = WORLD.get(args.layout, 4)
        dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
        micro = layout.get("pp", 1)  # (a pipeline needs at least pp micro-batches under 1F1B)
        kwargs = {"devices": world, "strategy": ThreeDStrategy(micro_batches=micro, train_timeout=60, **layout)}
    record = Record()
    callbacks: list[L.Callback] = [record]
    if args.save is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.save, save_last=True, save_top_k=0))
    steps = 8 if args.resume else 4
    trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, enable_checkpointing=args.save is not None, **kwargs)
    result: dict[str, object] = {}
    try:
        trainer.fit(model, datamodule=OrderedData("nano", batch_size=BATCH // dp, n=64), ckpt_path=args.resume)
    except ValueError as err:
        result["error"] = str(err)
    if "error" not in result:
        whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        result.update(rows=record.rows, params={n: p.detach().tolist() for n, p in whole.items()})
    if trainer.global_rank == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
