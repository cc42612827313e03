"""Checkpoints across data-parallel modes: save under FSDP, load replicated (and at another dp), and back.

``--phase save`` (under ``--data-parallel``, normally ``fsdp``): the noise-free NoisyMLP for 10 steps, a
checkpoint after every step in ``OUT/all``, full snapshots of parameters and Adam states at step 5 and the
per-step losses; then, at the same layout, ``fit(ckpt_path=step 5)`` to step 10 (exact resume under FSDP).
Writes ``OUT/fsdp-save.pt``.

``--phase load``: ``fit(ckpt_path=OUT/all/step=5.ckpt)`` to step 10 at this launch's layout and mode, with full
snapshots right after the restore and at the end. Writes ``OUT/fsdp-load-<mode>-tp<t>-pp<p>-dp<d>.pt``.

``--hsdp`` (the same launch, its world size must be 4): the save phase also runs the same 10 steps under HSDP at
(tp1, pp1, dp4 = 2 replicas x 2 shards), checkpointing in ``OUT/hsdp``, and resumes from its step 5 there
(records ``hsdp_clean``, ``hsdp_from5``); the load phase also resumes from ``OUT/hsdp/step=5.ckpt`` at its own
layout and mode (record ``resume_hsdp``).

``--submodule``: the save phase also runs ``NestedMLP`` (parameters one module below the body's layers) for 10 steps
under ``fsdp_unit="submodule"`` at the launch's layout, checkpointing in ``OUT/sub``, and resumes from its step 5
there (records ``sub_clean``, ``sub_from5``); the load phase also resumes ``NestedMLP`` from ``OUT/sub/step=5.ckpt``
at its own layout and mode (record ``resume_sub``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_common import NestedMLP, NoisyMLP, Recorder, loader

from lightning_3d import ThreeDStrategy

STEPS = 10


def run(
    args: argparse.Namespace, callbacks: list, ckpt_path: str | None = None, at_steps=(), nested: bool = False
) -> dict:
    L.seed_everything(1234, verbose=False)
    recorder = Recorder(at_steps)
    unit = "submodule" if nested and args.data_parallel != "replicate" else "block"
    strategy = ThreeDStrategy(
        tp=args.tp,
        pp=args.pp,
        print_layout=False,
        data_parallel=args.data_parallel,
        dp_shard=args.dp_shard,
        fsdp_unit=unit,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.tp * args.pp * args.dp,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, *callbacks],
        enable_checkpointing=bool(callbacks),
    )
    model = NestedMLP() if nested else NoisyMLP(noise=False)
    trainer.fit(model, train_dataloaders=loader(args.dp), ckpt_path=ckpt_path)
    result = recorder.record()
    result["rank"] = trainer.global_rank
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--data-parallel", default="fsdp")
    parser.add_argument("--dp-shard", type=int, default=None)
    parser.add_argument("--hsdp", action="store_true", help="also save / load under HSDP (see the module text)")
    parser.add_argument("--submodule", action="store_true", help="also fsdp_unit='submodule' (see the module text)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hsdp = argparse.Namespace(**{**vars(args), "tp": 1, "pp": 1, "dp": 4, "data_parallel": "hsdp", "dp_shard": 2})
    hsdp_step5 = str(Path(args.out) / "hsdp" / "step=5.ckpt")
    torch.set_num_threads(1)
    out = Path(args.out)
    step5 = str(out / "all" / "step=5.ckpt")
    sub_step5 = str(out / "sub" / "step=5.ckpt")
    if args.phase == "save":
        keep = ModelCheckpoint(dirpath=out / "all", filename="{step}", every_n_train_steps=1, save_top_k=-1)
        rec = {"clean": run(args, [keep], at_steps=(5,)), "from5": run(args, [], ckpt_path=step5)}
        if args.hsdp:
            keep = ModelCheckpoint(dirpath=out / "hsdp", filename="{step}", every_n_train_steps=5, save_top_k=-1)
            rec["hsdp_clean"] = run(hsdp, [keep], at_steps=(5,))
            rec["hsdp_from5"] = run(hsdp, [], ckpt_path=hsdp_step5)
        if args.submodule:
            keep = ModelCheckpoint(dirpath=out / "sub", filename="{step}", every_n_train_steps=5, save_top_k=-1)
            rec["sub_clean"] = run(args, [keep], at_steps=(5,), nested=True)
            rec["sub_from5"] = run(args, [], ckpt_path=sub_step5, nested=True)
        name = "fsdp-save.pt"
    else:
        rec = {"resume": run(args, [], ckpt_path=step5)}
        if args.hsdp:
            rec["resume_hsdp"] = run(args, [], ckpt_path=hsdp_step5)
        if args.submodule:
            rec["resume_sub"] = run(args, [], ckpt_path=sub_step5, nested=True)
        name = f"fsdp-load-{args.data_parallel}-tp{args.tp}-pp{args.pp}-dp{args.dp}.pt"
    if next(iter(rec.values()))["rank"] == 0:
        torch.save(rec, out / name)


if __name__ == "__main__":
    main()
