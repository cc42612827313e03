"""A Hugging Face Llama held by a LightningModule, written as a ``from_pretrained`` folder during ``fit``.

``--layout single``: one device, the model's own ``save_pretrained`` at the start and the end of training.
``--layout tp2pp2``: ``trainer.strategy.save_hf`` on every rank at the start and the end (``OUT/start``,
``OUT/end``); with ``--plain`` instead, rank 0 calls the model's own ``save_pretrained`` at the end (the Hugging
Face habit), which the strategy refuses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import HFCausalLM, OrderedData, quiet_trainer, same_start


class Saving(HFCausalLM):
    def __init__(self, out: Path, single: bool, plain: bool) -> None:
        super().__init__("llama")
        self.out, self.single, self.plain = out, single, plain

    def _save(self, name: str) -> None:
        if self.single or (self.plain and name == "end"):
            if self.global_rank == 0:
                self.model.save_pretrained(self.out / name)
        else:
            self.trainer.strategy.save_hf(self.out / name)

    def on_train_start(self) -> None:
        self._save("start")

    def on_train_end(self) -> None:
        self._save("end")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["single", "tp2pp2"], required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    L.seed_everything(0)
    single = args.layout == "single"
    model = Saving(args.out, single, args.plain)
    model.configure_model()
    same_start(model, args.init)
    kwargs = {"devices": 1} if single else {"devices": 4, "strategy": ThreeDStrategy(tp=2, pp=2, micro_batches=2)}
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        **kwargs,
    )
    trainer.fit(model, datamodule=OrderedData("llama", batch_size=8, n=64))


if __name__ == "__main__":
    main()
