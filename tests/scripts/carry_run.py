"""Encoder-decoders through the pipeline (``core/carry.py``), fit with sanity validation and validation, against one
device.

The decoder's blocks are the pipeline's blocks; the encoder runs on the first stage, and the later stages read its
output (and T5's position biases, which its first decoder block returns). Each case is fit in float64 for 4 steps
with validation before (sanity: the evaluation hook's first batch comes before training's) and after every 2 steps,
then ``validate`` once more. Rank 0 writes ``OUT/carry_CASE.pt``: the per-step training losses, every validation's
loss and the final validation's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import MODELS, HFEncoder, OrderedData, quiet_trainer

GLOBAL_BATCH = 8


class Seq2Seq(HFEncoder):
    """The test models' encoder-decoder (T5, FLAN-T5 or BART, every position's next token as its label),
    validated too."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.model(input_ids=x, labels=y).loss, sync_dist=True)


class Recorder(L.Callback):
    def __init__(self, init: Path, ref: bool) -> None:
        self.init, self.ref = init, ref
        self.rec: dict = {"train": [], "val": []}

    def on_fit_start(self, trainer, pl_module):
        if self.ref:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.init)
        else:
            trainer.strategy.load_full_state_dict(torch.load(self.init))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rec["train"].append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module):
        self.rec["val"].append(float(trainer.callback_metrics["val_loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--data-parallel", default="replicate", help="replicate or fsdp")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--cases", default="t5,bart")
    parser.add_argument("--out", required=True)
    parser.add_argument("--init", default=None, help="where the reference left the initial weights (default: --out)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    for case in args.cases.split(","):
        L.seed_everything(3, verbose=False)
        torch.set_default_dtype(torch.float64)
        if args.ref:
            strategy, devices, batch = "auto", 1, GLOBAL_BATCH
        else:
            strategy = ThreeDStrategy(
                tp=args.tp,
                pp=args.pp,
                micro_batches=4 // args.dp,
                schedule=args.schedule,
                stages_per_rank=args.stages_per_rank,
                data_parallel=args.data_parallel,
                print_layout=False,
            )
            devices, batch = args.tp * args.pp * args.dp, GLOBAL_BATCH // args.dp
        recorder = Recorder(Path(args.init or out) / f"carry_{case}.init.pt", args.ref)
        trainer = quiet_trainer(
            devices=devices,
            strategy=strategy,
            precision="64-true",
            max_steps=4,
            val_check_interval=2,
            num_sanity_val_steps=1,  # the evaluation hook's first batch comes before training's
            limit_val_batches=2,
            use_distributed_sampler=False,
            callbacks=[recorder],
        )
        # a Hugging Face encoder-decoder, validated too; or a test model with validation of its own
        model = Seq2Seq(case) if case in ("t5", "flant5", "bart", "m2m_100") else MODELS[case]()
        data = OrderedData(case, batch, n=GLOBAL_BATCH * 4, val_n=GLOBAL_BATCH * 2)
        trainer.fit(model, datamodule=data)
        recorder.rec["validate"] = float(trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"])
        if trainer.global_rank == 0:
            torch.save(recorder.rec, out / f"carry_{case}.pt")


if __name__ == "__main__":
    main()
