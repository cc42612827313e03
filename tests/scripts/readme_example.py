"""Run the README's minimal example as the README writes it, against a single-device reference.

The two Python blocks of the README's "LightningModule contract" section (the ``Classifier`` and the lines that
train it with ``ThreeDStrategy(tp=2, pp=2, micro_batches=4)`` on 8 CPU processes) are read from README.md and
executed. The only edit is to the ``Trainer(...)`` call: a step limit, no logger or progress bar, and the
callbacks below (the initial weights of the reference, a recorder). Each replacement must match exactly once, so
a README edit that breaks the example breaks this script.

``--single`` trains the same ``Classifier`` on one device on the same global batches (see ``data``) from its own
initial weights, which it writes to ``OUT/init.pt`` for the 3D run. Rank 0 writes ``OUT/{single,3d}.pt``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

README = Path(__file__).resolve().parents[2] / "README.md"
STEPS = 8
PER_REPLICA_BATCH = 16
DP = 2  # 8 processes / (tp 2 x pp 2)


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def block_with(needle: str) -> str:
    found = [b for b in python_blocks() if needle in b]
    assert len(found) == 1, f"README.md: expected one python block with {needle!r}, found {len(found)}"
    return found[0]


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"README.md example changed: {old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def data(single: bool) -> tuple[DataLoader, DataLoader]:
    """Four Gaussian blobs in 16 dimensions; one epoch is exactly STEPS global batches (validation at its end).

    Under a distributed strategy Lightning gives every training loader a shuffling ``DistributedSampler``
    (seed ``PL_GLOBAL_SEED``, here 0), as it does under DDP. The single-device reference reads the same global
    batches: step k's batch is the k-th batch of each data-parallel replica's sampler, concatenated.
    """
    g = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(4, 16, generator=g)
    y = torch.randint(0, 4, (STEPS * DP * PER_REPLICA_BATCH + 64,), generator=g)
    x = centres[y] + torch.randn(len(y), 16, generator=g)
    n_train = STEPS * DP * PER_REPLICA_BATCH
    train = TensorDataset(x[:n_train], y[:n_train])
    val = TensorDataset(x[n_train:], y[n_train:])
    if not single:
        return DataLoader(train, batch_size=PER_REPLICA_BATCH), DataLoader(val, batch_size=PER_REPLICA_BATCH)
    replicas = [list(DistributedSampler(train, num_replicas=DP, rank=r, shuffle=True, seed=0)) for r in range(DP)]
    b = PER_REPLICA_BATCH
    batches = [[i for rep in replicas for i in rep[k * b : (k + 1) * b]] for k in range(STEPS)]
    return DataLoader(train, batch_sampler=batches), DataLoader(val, batch_size=DP * b)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        self.logged = {k: float(v) for k, v in trainer.callback_metrics.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(block_with("class Classifier(LightningModule)"), namespace)

    limits = (
        "max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False, callbacks=CALLBACKS, "
    )
    if args.single:
        model = namespace["Classifier"]()
        model.configure_model()
        torch.save(model.state_dict(), out / "init.pt")
        train_loader, val_loader = data(single=True)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=STEPS,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[recorder],
        )
        trainer.fit(model, train_loader, val_loader)
    else:
        from lightning_3d.checkpoint import LoadWeights

        train_loader, val_loader = data(single=False)
        namespace.update(
            train_loader=train_loader,
            val_loader=val_loader,
            STEPS=STEPS,
            CALLBACKS=[LoadWeights(out / "init.pt"), recorder],
        )
        code = block_with("trainer.fit(Classifier()")
        code = replace_once(code, "Trainer(accelerator=", f"Trainer({limits}accelerator=")
        exec(code, namespace)
        trainer = namespace["trainer"]
    if trainer.global_rank == 0:
        torch.save(
            {"losses": recorder.losses, "logged": recorder.logged}, out / ("single.pt" if args.single else "3d.pt")
        )


if __name__ == "__main__":
    main()
