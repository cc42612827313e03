"""What a test job's process sees of itself, for tests/test_launch.py.

``ranks`` mode: print this process's view (argv, __name__, sys.path[0], environment, seeds, Lightning's rank).
``lightning`` mode: a 3-process ``Trainer`` on CPU (plain DDP) whose every rank prints the same view, then runs
one step. ``exit CODE`` / ``raise`` / ``kill`` / ``hang``: end that way (a timed-out job must be killed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch


def say(line: str) -> None:
    """Print ``line`` in one write: under ``PYTHONUNBUFFERED`` ``print`` writes the text and its newline apart, so
    lines from ranks sharing the job's stdout could interleave into one."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def view(tag: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    record = {
        "tag": tag,
        "argv": sys.argv[1:],
        "name": __name__,
        "path0": sys.path[0],
        "rank_env": os.environ.get("RANK", os.environ.get("LOCAL_RANK")),
        "rank_zero_only": rank_zero_only.rank,
        "probe_env": os.environ.get("L3D_PROBE"),
        "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
        "cwd": os.getcwd(),
        "torch_seed": torch.initial_seed(),
        "py_random": random.random(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
    say("PROBE " + json.dumps(record))


def lightning_job() -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    view("lightning")
    data = DataLoader(TensorDataset(torch.ones(6, 2)), batch_size=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    say(f"PROBE-DONE rank {trainer.global_rank}")
    # the job ends with rank 0 (the launching process), as a fresh launch does: every rank has printed before it
    trainer.strategy.barrier()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ranks":
        view("ranks")
    elif mode == "lightning":
        lightning_job()
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise RuntimeError("probe failure")
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "hang":
        time.sleep(600)
