"""``python -m lightning_3d.train ARGS...`` with one test callback, for torchrun / SLURM-style launches.

The callback prints, on global rank 0, every training step's loss and every validation loss at full precision
(``L3D_LOSS attempt=A step=S train_loss=X`` / ``... val_loss=X``), and the rank's view of the launch on every
rank (``L3D_RANK rank=R node=N local=L world=W env=ClusterEnvironment``). With ``L3D_TEST_KILL_AT_STEP=K`` (and
``L3D_TEST_KILL_RANK``, default 3) that rank SIGKILLs itself at the start of training step K of torchrun's
FIRST attempt only (``TORCHELASTIC_RESTART_COUNT`` = 0), as a crashed node would.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning.pytorch as pl

from lightning_3d.train import app

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_AT = int(os.environ.get("L3D_TEST_KILL_AT_STEP", "-1"))
KILL_RANK = int(os.environ.get("L3D_TEST_KILL_RANK", "3"))


class LossPrinter(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        env = trainer.strategy.cluster_environment
        line = (
            f"L3D_RANK rank={trainer.global_rank} node={trainer.node_rank} local={trainer.local_rank} "
            f"world={trainer.world_size} env={type(env).__name__} attempt={ATTEMPT}\n"
        )
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())  # one write: every rank prints one, into one stream

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if ATTEMPT == 0 and trainer.global_step == KILL_AT and trainer.global_rank == KILL_RANK:
            print(f"L3D_KILL rank={trainer.global_rank} step={KILL_AT}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx):
        loss = trainer.callback_metrics.get("train_loss")
        if trainer.is_global_zero and loss is not None:
            print(f"L3D_LOSS attempt={ATTEMPT} step={trainer.global_step - 1} train_loss={float(loss)!r}", flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if trainer.is_global_zero and loss is not None and not trainer.sanity_checking:
            print(f"L3D_LOSS attempt={ATTEMPT} step={trainer.global_step} val_loss={float(loss)!r}", flush=True)


_app_callbacks = app._callbacks
app._callbacks = lambda cfg, model: [*_app_callbacks(cfg, model), LossPrinter()]

if __name__ == "__main__":
    app.main()
