"""fp16 loss scaling (``precision="16-mixed"``) under ThreeDStrategy against single-device Lightning.

Lightning turns ``precision="16-mixed"`` into ``bf16-mixed`` on CPU, so both sides pass the plugin explicitly:
``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", ...))``. The scaler starts at 2**24, which
overflows fp16 gradients at once (step 0 is skipped and the scale backs off by 2**-12), grows x2 after every 3 good
steps, and the loss of global step ``HUGE_STEP`` is multiplied by 1e6 (its gradients overflow at any scale here:
that step is skipped too). Every rank writes ``OUT/<case>.rank<r>.json``: per step the returned (unscaled) loss, the
logged cross-entropy, the scale and growth tracker after the step; the skipped steps as the strategy recorded them.

* ``--ref``: one process, plain Lightning, ``STEPS`` steps (case ``ref``).
* otherwise 4 ranks (Lightning's launcher), all in one launch, from the reference's initial weights:
  ``pp2dp2``: pp=2 x dp=2, ``RESUME_AT`` steps, a checkpoint, then a new Trainer with a fresh scaler (2**24 again)
  resumes from it up to ``STEPS`` (case ``pp2dp2``; the scale on resume is recorded as ``resumed_scale``);
  ``tp2dp2fsdp``: tp=2 x dp=2 under ``data_parallel="fsdp"`` (gradients are DTensor shards over (dp, tp)),
  ``STEPS`` steps in one go.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import OrderedData, TinyMLP

GLOBAL_BATCH = 16
STEPS = 12
RESUME_AT = 8  # an epoch boundary (4 batches per epoch): the resumed run reads the reference's batches
HUGE_STEP = 5
SCALER = {"init_scale": 2.0**24, "growth_factor": 2.0, "backoff_factor": 2.0**-12, "growth_interval": 3}


class FP16MLP(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        ce = F.cross_entropy(self(x).float(), y)
        self.log("ce", ce)
        return ce * (1e6 if self.trainer.global_step == HUGE_STEP else 1.0)


class Recorder(L.Callback):
    def __init__(self, out: Path, case: str, ref: bool, rec: dict | None = None) -> None:
        self.out, self.case, self.ref = out, case, ref
        self.rec = rec if rec is not None else {"loss": [], "ce": [], "scale": [], "tracker": [], "resumed_scale": []}

    def on_fit_start(self, trainer, pl_module):
        init = self.out / "init.pt"
        if self.ref:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, init)
        elif trainer.ckpt_path is None:
            assert trainer.strategy.load_full_state_dict(torch.load(init)).loaded

    def on_train_start(self, trainer, pl_module):
        if trainer.ckpt_path is not None:
            scaler = trainer.precision_plugin.scaler
            self.rec["resumed_scale"] = [scaler.get_scale(), scaler.state_dict()["_growth_tracker"]]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rec["loss"].append(float(outputs["loss"]))
        self.rec["ce"].append(float(trainer.callback_metrics["ce"]))
        scaler = trainer.precision_plugin.scaler
        self.rec["scale"].append(scaler.get_scale())
        self.rec["tracker"].append(scaler.state_dict()["_growth_tracker"])

    def on_train_end(self, trainer, pl_module):
        scaler = getattr(trainer.strategy, "loss_scaler", None)
        if scaler is not None:
            self.rec.setdefault("skipped", []).extend(scaler.skipped_steps)
        (self.out / f"{self.case}.rank{trainer.global_rank}.json").write_text(json.dumps(self.rec))


ACCUMULATE = 1  # --accumulate (a manual check; the test runs the default)


def trainer_for(strategy, devices: int, steps: int, recorder: Recorder) -> L.Trainer:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER))
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[plugin],
        max_steps=steps,
        gradient_clip_val=1.0,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )


def model() -> FP16MLP:
    L.seed_everything(1234, verbose=False)
    return FP16MLP(build="configure", optimizer="adam", lr=0.01, scheduler=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--on-nonfinite", default="raise")
    args = parser.parse_args()
    global ACCUMULATE
    ACCUMULATE = args.accumulate
    settings = {"micro_batches": 4, "on_nonfinite": args.on_nonfinite}
    torch.set_num_threads(1)
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    data = OrderedData("mlp", GLOBAL_BATCH, n=GLOBAL_BATCH * 4)
    if args.ref:
        trainer_for("auto", 1, STEPS, Recorder(out, "ref", True)).fit(model(), datamodule=data)
        return
    # pp=2 x dp=2: RESUME_AT steps, a checkpoint, a fresh Trainer and scaler resume to STEPS
    data = OrderedData("mlp", GLOBAL_BATCH // 2, n=GLOBAL_BATCH * 4)
    first = Recorder(out, "pp2dp2.first", False)
    trainer = trainer_for(ThreeDStrategy(pp=2, **settings), 4, RESUME_AT, first)
    trainer.fit(model(), datamodule=data)
    trainer.save_checkpoint(out / "ckpt")
    second = Recorder(out, "pp2dp2", False, rec={**first.rec, "skipped": list(first.rec.get("skipped", []))})
    trainer = trainer_for(ThreeDStrategy(pp=2, **settings), 4, STEPS, second)
    trainer.fit(model(), datamodule=data, ckpt_path=out / "ckpt")
    # tp=2 x dp=2 under FSDP (pp=1): the whole run
    strategy = ThreeDStrategy(tp=2, data_parallel="fsdp", **settings)
    trainer = trainer_for(strategy, 4, STEPS, Recorder(out, "tp2dp2fsdp", False))
    trainer.fit(model(), datamodule=data)


if __name__ == "__main__":
    main()
