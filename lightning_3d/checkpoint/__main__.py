"""``python -m lightning_3d.checkpoint {export,consolidate,export-hf,info} ...``: checkpoint folders from the command
line, one process."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader

from . import META_FILE, SECTION, check_complete, export, saved_model_shapes


def _natural(key: str) -> list[Any]:
    """Sort key of a parameter name with its numbers compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_3d.checkpoint {export,consolidate,export-hf,info} ...``"""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_3d.checkpoint", description="Export or inspect a lightning_3d checkpoint folder."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export", help="write the single-device state dict of a checkpoint folder")
    p_export.add_argument("checkpoint", help="checkpoint folder (e.g. checkpoints/last.ckpt)")
    p_export.add_argument("out", help="output file (torch.save)")
    p_one = sub.add_parser(
        "consolidate",
        help="write a checkpoint folder as the one file single-device Lightning loads (load_from_checkpoint, "
        "ckpt_path=), without optimizer states",
    )
    p_one.add_argument("checkpoint", help="checkpoint folder (e.g. checkpoints/last.ckpt)")
    p_one.add_argument("out", nargs="?", default=None, help="output file (default: CHECKPOINT.consolidated)")
    p_hf = sub.add_parser(
        "export-hf", help="write the Hugging Face model of a checkpoint folder as a from_pretrained folder"
    )
    p_hf.add_argument("checkpoint", help="checkpoint folder (e.g. checkpoints/last.ckpt)")
    p_hf.add_argument("out", help="output folder (config.json + model.safetensors)")
    p_hf.add_argument(
        "--module-attr", default=None, help="attribute of the LightningModule holding the model (default: inferred)"
    )
    p_hf.add_argument(
        "--config", default=None, help="config.json or a folder with one (default: the config stored in the checkpoint)"
    )
    p_info = sub.add_parser("info", help="print the layout, progress and keys of a checkpoint folder")
    p_info.add_argument("checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            state_dict = export(args.checkpoint, args.out)
            numel = sum(t.numel() for t in state_dict.values() if isinstance(t, Tensor))
            print(f"wrote {args.out}: {len(state_dict)} tensors, {numel:,} elements")
        elif args.command == "consolidate":
            from .lightning_file import consolidate

            out = consolidate(args.checkpoint, args.out)
            print(f"wrote {out}: load it with YourModule.load_from_checkpoint({str(out)!r})")
        elif args.command == "export-hf":
            from . import export_hf_checkpoint

            out = export_hf_checkpoint(args.checkpoint, args.out, module_attr=args.module_attr, config=args.config)
            print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
        else:
            path = Path(args.checkpoint)
            check_complete(path)
            meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
            shapes = saved_model_shapes(FileSystemReader(path).read_metadata())
            layout = meta.get(SECTION, {}).get("layout", {})
            print(f"{path}: epoch {meta.get('epoch')}, global step {meta.get('global_step')}, layout {layout}")
            for key in sorted(shapes, key=_natural):  # layers in model order: layers.2 before layers.10
                print(f"  {key}: {shapes[key]}")
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
