"""Train a tiny GPT with ThreeDStrategy and the PipelineTimeline callback on step 1.

Usage: ``timeline_run.py --out DIR [--pp 2] [--tp 1] [--micro-batches 4] [--schedule 1f1b] [--stages-per-rank 1]``;
the processes are started by Lightning (``devices = tp * pp``). Rank 0 writes ``DIR/timeline_step1.json`` (and
the PNG when matplotlib is importable) and ``DIR/summary.json`` with the callback's summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_3d import ThreeDStrategy
from lightning_3d.core import torch_compat
from lightning_3d.tools.timeline import PipelineTimeline, matplotlib_available
from lightning_3d_examples.gpt import GPT


def recorder_wrappers(obj: object) -> list[str]:
    """Instance attributes of ``obj`` that are wrappers made by the timeline's ``ScheduleRecorder``."""
    return [name for name, value in vars(obj).items() if "ScheduleRecorder" in getattr(value, "__qualname__", "")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = GPT("tiny", n_layer=2 * args.stages_per_rank)
    tokens = torch.randint(0, model.config.vocab_size, (3 * args.micro_batches, 17))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.micro_batches)
    timeline = PipelineTimeline(out_dir=args.out, first_step=1, gantt=matplotlib_available())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.tp * args.pp,
        strategy=ThreeDStrategy(
            tp=args.tp,
            pp=args.pp,
            micro_batches=args.micro_batches,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            print_layout=False,
        ),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timeline],
    )
    trainer.fit(model, data)
    # the profiled step's wrappers are gone again, and the callback no longer observes the runtime
    assert torch_compat.p2p_functions_are_torchs(), (
        torch_compat.current_batch_p2p(),
        torch_compat.current_wait_batch_p2p(),
    )
    runtime = trainer.strategy.runner.runtime
    assert timeline.summaries, "the profiled step was not recorded"
    assert not runtime.observers and "run" not in runtime.__dict__
    for sched in runtime._cache.values():
        for obj in [sched, *torch_compat.schedule_stages(sched)]:
            assert not recorder_wrappers(obj), (obj, recorder_wrappers(obj))
    if trainer.global_rank == 0:
        Path(args.out, "summary.json").write_text(json.dumps(timeline.summaries))


if __name__ == "__main__":
    main()
