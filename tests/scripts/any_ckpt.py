"""Checkpoints of models that are not one nn.Sequential (tests/test_any_model.py).

``--phase save`` (tp2 x pp2 x dp2): ``fit`` 6 steps saving at steps 3 and 6 (float64), then ``fit(ckpt_path=step 3)``
to step 6 again at the same layout; then ``validate`` (val_loss and a torchmetrics accuracy) of the trained model.
The models named by ``--v-models`` run that phase under ``zbvzerobubble`` (two stages per rank in a V: rank 0 holds
the first and the last stage, so a tied embedding and head are two copies on one rank), the others under 1F1B.
``--phase reshard`` (another layout): ``fit(ckpt_path=step 3)`` to step 6, and the same ``validate``.
``--phase single`` (one process, plain Lightning): the reference: 6 steps, and ``validate`` of a module loaded
with the checkpoint's exported weights.

Each writes ``OUT/<model>-<phase>.pt`` from rank 0: per-step losses, full parameters (canonical names) and
optimizer states after the restore and at the end, and the validation results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import Recorder, snapshot

from lightning_3d import ThreeDStrategy
from lightning_3d.checkpoint import LoadWeights
from lightning_3d.core.tied import canonical_names

from models import MODELS, OrderedData

GLOBAL_BATCH, N = 8, 48


def module(name: str) -> L.LightningModule:
    return MODELS[name](build="init")


class StartSnapshot(L.Callback):
    """Full parameters (canonical names) as training starts, after LoadWeights (listed before it)."""

    def on_fit_start(self, trainer, pl_module):
        snap = canonical({"snap_start": snapshot(trainer, pl_module)}, pl_module)
        self.params = snap["snap_start"]["params"]


def trainer(args: argparse.Namespace, steps: int, callbacks: list, single: bool = False, v: bool = False) -> L.Trainer:
    schedule = {"schedule": "zbvzerobubble", "stages_per_rank": 2} if v else {}
    strategy = (
        "auto" if single else ThreeDStrategy(tp=args.tp, pp=args.pp, micro_batches=4, print_layout=False, **schedule)
    )
    return L.Trainer(
        accelerator="cpu",
        devices=1 if single else args.tp * args.pp * args.dp,
        strategy=strategy,
        precision="64-true",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )


def data(dp: int) -> OrderedData:
    """The same global batches in every layout (replica r reads samples r, r + dp, ...)."""
    return OrderedData("llama", GLOBAL_BATCH // dp, n=N, val_n=16)


def canonical(rec: dict, pl_module: L.LightningModule) -> dict:
    aliases = canonical_names(pl_module)
    for snap in [v for k, v in rec.items() if k.startswith("snap_") and isinstance(v, dict)]:
        snap["params"] = {aliases.get(n, n): t for n, t in snap["params"].items()}
        snap["opt"] = {
            next((aliases[a] + n[len(a) :] for a in aliases if n.startswith(a + ".")), n): t
            for n, t in snap["opt"].items()
        }
    return rec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--phase", choices=["save", "reshard", "single"], required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--v-models", default="", help="models whose save phase runs under zbvzerobubble")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        run(args, name)


def run(args: argparse.Namespace, name: str) -> None:
    out = Path(args.out)
    rec: dict = {}
    L.seed_everything(1234, verbose=False)
    model = module(name)
    init = out / f"{name}.init.pt"
    if args.phase == "single":
        torch.save(model.state_dict(), init)
        recorder = Recorder()
        t = trainer(args, 6, [recorder], single=True)
        t.fit(model, datamodule=data(1))
        rec["fit"] = recorder.record()
        rec["validate"] = t.validate(model, datamodule=data(1), verbose=False)[0]
        torch.save(rec, out / f"{name}-single.pt")
        return
    ckpts = out / f"{name}-ckpt"
    v = args.phase == "save" and name in args.v_models.split(",")
    if args.phase == "save":
        recorder = Recorder()
        saver = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1, filename="{step}")
        t = trainer(args, 6, [LoadWeights(str(init)), recorder, saver], v=v)
        t.fit(model, datamodule=data(args.dp))
        rec["fit"] = canonical(recorder.record(), model)
        if t.global_rank == 0:  # the trained model as a Hugging Face folder, and what from_pretrained makes of it
            from transformers import AutoModelForCausalLM

            from lightning_3d.checkpoint import export_hf_checkpoint

            folder = export_hf_checkpoint(ckpts / "step=6.ckpt", out / f"{name}-hf", config=model.model.config)
            loaded = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64)
            rec["hf_params"] = {f"model.{k}": v.detach().clone() for k, v in loaded.named_parameters()}
        t.strategy.barrier()
    if args.phase == "reshard":  # a fresh fit from the Hugging Face folder (fine-tuning a pretrained model)
        start = StartSnapshot()
        L.seed_everything(777, verbose=False)
        t = trainer(args, 1, [LoadWeights(str(out / f"{name}-hf")), start])
        t.fit(module(name), datamodule=data(args.dp))
        rec["from_hf"] = start.params
    recorder = Recorder()
    L.seed_everything(4321, verbose=False)  # the checkpoint, not the seed, decides
    resumed = module(name)
    t = trainer(args, 6, [recorder], v=v)
    t.fit(resumed, datamodule=data(args.dp), ckpt_path=ckpts / "step=3.ckpt")
    rec["resume"] = canonical(recorder.record(), resumed)
    rec["validate"] = t.validate(resumed, datamodule=data(args.dp), verbose=False)[0]
    if t.global_rank == 0:
        torch.save(rec, out / f"{name}-{args.phase}.pt")


if __name__ == "__main__":
    main()
