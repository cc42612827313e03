"""A ``ThreeDStrategy`` checkpoint folder read by single-device Lightning, against one device's own checkpoint file
of the same training (float64; written by ``lightning_callbacks_run.py --save``), in one process.

Writes to ``OUT`` the largest differences of: the checkpoint dict (``lightning_file.lightning_checkpoint``) against
``torch.load`` of the file (the model, the weight-averaging callback's state with its model copy, and the keys);
``NanAtStep.load_from_checkpoint`` of the folder against that of the file; and the validation loss of a
single-device ``Trainer.validate(ckpt_path=...)`` of each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_callbacks_run import BATCH, NanAtStep

from lightning_3d.checkpoint.lightning_file import lightning_checkpoint

from models import OrderedData, quiet_trainer

AVERAGING = ("EMAWeightAveraging", "StochasticWeightAveraging")


def _largest_difference(got: Any, want: Any, where: str, mismatches: list[str]) -> float:
    """The largest relative difference between two trees of tensors; non-tensor leaves that differ are named."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            mismatches.append(where)
            return float("inf")
        scale = want.abs().max().clamp_min(1e-30)
        return float((got - want).abs().max() / scale) if want.numel() else 0.0
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            mismatches.append(f"{where} keys {list(got) if isinstance(got, dict) else got} != {list(want)}")
            return float("inf")
        return max([_largest_difference(got[k], want[k], f"{where}/{k}", mismatches) for k in want], default=0.0)
    if got != want:
        mismatches.append(f"{where}: {got!r} != {want!r}")
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    got = lightning_checkpoint(args.folder, weights_only=False)
    want = torch.load(args.file, weights_only=False)
    mismatches: list[str] = []
    report: dict[str, Any] = {"missing": sorted(set(want) - set(got) - {"optimizer_states"})}
    report["extra"] = sorted(set(got) - set(want))
    report["model"] = _largest_difference(got["state_dict"], want["state_dict"], "state_dict", mismatches)
    report["steps"] = [(got["epoch"], got["global_step"]), (want["epoch"], want["global_step"])]
    averaging = {k: v for k, v in want.get("callbacks", {}).items() if k.startswith(AVERAGING)}
    report["averaging"] = _largest_difference(
        {k: got["callbacks"].get(k) for k in averaging}, averaging, "callbacks", mismatches
    )
    if "current_model_state" in want:  # EMA's trained weights (the average is the state_dict)
        current = _largest_difference(got["current_model_state"], want["current_model_state"], "current", mismatches)
        report["averaging"] = max(report["averaging"], current)
    # the user's habit: load the trained model on one device
    from_folder = NanAtStep.load_from_checkpoint(args.folder, tie=True)
    from_file = NanAtStep.load_from_checkpoint(args.file, tie=True)
    report["loaded"] = _largest_difference(from_folder.state_dict(), from_file.state_dict(), "loaded", mismatches)
    report["still_tied"] = from_folder.lm_head.weight is from_folder.transformer.wte.weight
    losses = []
    for path in (args.folder, args.file):
        L.seed_everything(0)
        trainer = quiet_trainer(devices=1, limit_val_batches=2)
        model = NanAtStep(build="init", tie=True)
        (result,) = trainer.validate(
            model, datamodule=OrderedData("nano", batch_size=BATCH, n=64, val_n=16), ckpt_path=path, verbose=False
        )
        losses.append(result["val_loss"])
    report["val_losses"] = losses
    report["mismatches"] = mismatches
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
