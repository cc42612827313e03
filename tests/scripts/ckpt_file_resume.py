"""Scaling a run up: a checkpoint file written by plain single-device Lightning, resumed under ThreeDStrategy.

``--save FILE``: one device trains ``NoisyMLP`` (noise off: the file holds no RNG states; two parameter groups with
their own learning rates under ``LambdaLR``) for one epoch (4 steps) in float64 and saves ``FILE`` with
``trainer.save_checkpoint``. ``--resume FILE``: training goes on to step 8 from ``FILE``, on one device (``--single``,
the reference) or at ``--tp/--pp/--dp`` (``--fsdp``: sharded data parallelism). Rank 0 writes ``OUT``: the losses
of the resumed steps, the parameters and Adam states at the first resumed step and at the end (full tensors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import GLOBAL_BATCH, N_SAMPLES, NoisyMLP, Recorder, trainer

from models import OrderedData


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    single = args.single or args.save is not None
    dp = 1 if single else args.dp
    recorder = Recorder(at_steps=(5,))
    schedule = {"micro_batches": 2, "data_parallel": "fsdp"} if args.fsdp else {"micro_batches": 2}
    steps = 4 if args.save else 8
    # the same samples in the same order on one device and over dp replicas (no shuffling sampler)
    run = trainer(
        args.tp, args.pp, dp, steps, [recorder], single, None if single else schedule, use_distributed_sampler=False
    )
    model = NoisyMLP(noise=False, build="configure", lr=0.02)
    run.fit(model, datamodule=OrderedData("mlp", GLOBAL_BATCH // dp, n=N_SAMPLES), ckpt_path=args.resume)
    if args.save is not None:
        run.save_checkpoint(args.save)
    elif run.global_rank == 0:
        torch.save(recorder.record(), args.out)


if __name__ == "__main__":
    main()
