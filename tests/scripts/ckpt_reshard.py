"""Load a checkpoint written at another layout, continue training, and (in one process) the plain paths.

Under ThreeDStrategy(tp, pp) on tp * pp * dp ranks (Lightning's launcher starts them), writing
``OUT/reshard-<tag>.pt`` from rank 0:

* ``resume``: ``fit(ckpt_path=CKPT)`` to step 10, with full snapshots of parameters and optimizer states right
  after the restore (``snap_start``) and at the end, and the per-step losses;
* ``imported`` (with ``--weights FILE``): a fresh fit with ``LoadWeights(FILE)``: the full parameters as training
  starts, then one step.

With ``--plain`` (run it with one process): also plain single-device Lightning, no ThreeDStrategy:
``LoadWeights(FILE)`` with the exported weights (``plain_imported``), and ``load_state_dict`` of the export into a
fresh module (``plain``), and ``trainer.validate(ckpt_path=CKPT)`` under ThreeDStrategy against that module's
loss on the same data (``validate``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import NoisyMLP, Recorder, dataset, loader, snapshot, trainer

from lightning_3d.checkpoint import LoadWeights


class StartSnapshot(L.Callback):
    """Full parameters right after fit starts (after LoadWeights, which is listed first)."""

    def on_fit_start(self, trainer, pl_module):
        self.params = snapshot(trainer, pl_module)["params"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--weights", default=None, help="an exported single-device state dict")
    parser.add_argument("--plain", action="store_true", help="also plain single-device Lightning")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tag = f"tp{args.tp}-pp{args.pp}-dp{args.dp}"
    rec: dict = {}
    L.seed_everything(1234, verbose=False)
    recorder = Recorder()
    t = trainer(args.tp, args.pp, args.dp, 10, [recorder])
    t.fit(NoisyMLP(noise=False), train_dataloaders=loader(args.dp), ckpt_path=args.ckpt)
    rec["resume"] = recorder.record()
    rank = t.global_rank
    if args.weights:
        L.seed_everything(4321, verbose=False)  # another seed: the weights must come from the file
        start = StartSnapshot()
        t = trainer(args.tp, args.pp, args.dp, 1, [LoadWeights(args.weights), start])
        t.fit(NoisyMLP(noise=False), train_dataloaders=loader(args.dp))
        rec["imported"] = start.params
    if args.plain:
        L.seed_everything(4321, verbose=False)
        start = StartSnapshot()
        t = trainer(1, 1, 1, 1, [LoadWeights(args.weights), start], single=True)
        t.fit(NoisyMLP(noise=False, build="init"), train_dataloaders=loader(1))
        rec["plain_imported"] = start.params
        plain = NoisyMLP(noise=False, build="init")
        result = plain.load_state_dict(torch.load(args.weights, weights_only=True))
        val = DataLoader(dataset("mlp", 64, seed=1), batch_size=64)
        t = trainer(args.tp, args.pp, args.dp, 1, [])
        got = t.validate(NoisyMLP(noise=False), dataloaders=val, ckpt_path=args.ckpt, verbose=False)[0]["val_loss"]
        with torch.no_grad():
            x, y = next(iter(val))
            rec["validate"] = (float(got), float(F.cross_entropy(plain(x), y)))
        rec["plain"] = {
            "missing": list(result.missing_keys),
            "unexpected": list(result.unexpected_keys),
            "params": {n: p.detach().clone() for n, p in plain.named_parameters()},
        }
    if rank == 0:
        torch.save(rec, Path(args.out) / f"reshard-{tag}.pt")


if __name__ == "__main__":
    main()
