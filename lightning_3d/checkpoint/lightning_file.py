"""A checkpoint folder as the single file one device's Lightning writes: ``load_from_checkpoint`` and friends.

Lightning users load a trained model with ``MyModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)``
and evaluate with ``Trainer(...).test(model, ckpt_path=...)`` on one device. ``ThreeDStrategy`` writes folders
(``checkpoint/__init__.py``), which Lightning's loader opens as files: ``IsADirectoryError``. Lightning's own
``consolidate_checkpoint`` tool expects its FSDP layout (a ``model`` entry) and fails on them with ``KeyError``.

:func:`lightning_checkpoint` reads a folder into the dict a single-device run would have written: ``meta.pt``'s
entries (loops, callbacks, LR schedulers, hyperparameters, ...), the whole model's ``state_dict`` (every key the
plain module's ``state_dict()`` has, tied weights under each of their names) and the other model-shaped state dicts
Lightning's callbacks keep (``EMAWeightAveraging``'s trained weights, ``StochasticWeightAveraging``'s average), put
back where they were. Optimizer states are left out: a single-device optimizer's state is keyed by its parameters'
positions in its groups, which only the live optimizer knows (resume training from the folder itself, at any layout).

Two ways to use it:

* ``python -m lightning_3d.checkpoint consolidate CKPT_DIR [OUT]`` writes that dict with ``torch.save`` (default
  ``CKPT_DIR.consolidated``, the name Lightning's tool uses), for environments without lightning_3d;
* ``import lightning_3d`` makes Lightning's checkpoint loader (``LightningModule.load_from_checkpoint``,
  ``LightningDataModule.load_from_checkpoint`` and ``TorchCheckpointIO``, which single-device ``Trainer``s use for
  ``ckpt_path=``) read such a folder directly (:func:`read_folders_as_files`). Every other path goes to Lightning's
  loader unchanged.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import DCP_METADATA, META_FILE, SECTION, check_complete, whole_model
from .named_state import MODEL_COPY, put_path

_WRAPPED = "_lightning_3d_reads_folders"
# Lightning's modules that load checkpoints with ``lightning.fabric.utilities.cloud_io._load``, bound by name there
_LOADERS = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io")


def is_checkpoint_folder(path: Any) -> bool:
    """Whether ``path`` names a local folder holding a ``ThreeDStrategy`` checkpoint (DCP's ``.metadata`` and
    ``meta.pt``)."""
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith(("http://", "https://")):
        return False
    folder = Path(path)
    return folder.is_dir() and (folder / DCP_METADATA).is_file() and (folder / META_FILE).is_file()


def lightning_checkpoint(
    checkpoint_dir: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """A checkpoint folder as the checkpoint dict one device's Lightning writes, without optimizer states.

    Args:
        checkpoint_dir: the folder (e.g. ``checkpoints/last.ckpt``).
        map_location: where the tensors go: a ``torch.device`` or device string; anything else (``None``,
            Lightning's default function, a dict) leaves them on the CPU.
        weights_only: as ``torch.load``'s, for ``meta.pt`` (hyperparameters may hold objects of the user's).

    Returns:
        ``meta.pt``'s entries with ``state_dict`` (the whole model) and the callbacks' model-shaped state dicts.
    """
    path = Path(checkpoint_dir)
    check_complete(path)
    checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    section = checkpoint.pop(SECTION, None) or {}
    checkpoint["state_dict"] = whole_model(path, section)
    for i, where in enumerate(section.get("model_copies", [])):
        put_path(checkpoint, tuple(where), whole_model(path, section, MODEL_COPY.format(i)))
    device = map_location if isinstance(map_location, (str, torch.device)) else None
    return _to_device(checkpoint, torch.device(device)) if device is not None else checkpoint


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v, device) for v in tree]
    return tree


def consolidate(checkpoint_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write :func:`lightning_checkpoint` of a folder as one file (``torch.save``), which plain Lightning loads.

    Args:
        checkpoint_dir: the folder.
        out: the file to write; default ``<checkpoint_dir>.consolidated`` (Lightning's tool's name).

    Returns:
        The file written.

    Raises:
        FileExistsError: ``out`` exists (as Lightning's tool, nothing is overwritten).
    """
    folder = Path(checkpoint_dir)
    target = Path(out) if out is not None else folder.with_suffix(folder.suffix + ".consolidated")
    if target.exists():
        raise FileExistsError(f"lightning_3d: {str(target)!r} exists; name another output file or remove it first.")
    torch.save(lightning_checkpoint(folder, weights_only=False), target)
    return target


def read_folders_as_files() -> None:
    """Make Lightning's checkpoint loader read ``ThreeDStrategy`` folders as :func:`lightning_checkpoint` (idempotent;
    run by ``import lightning_3d``). Other paths, and file objects, go to Lightning's loader as before."""
    import importlib

    for name in _LOADERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another Lightning layout: that loader is left alone
            continue
        original = getattr(module, "pl_load", None)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        module.pl_load = _reading_folders(original)


def _reading_folders(original: Any) -> Any:
    @functools.wraps(original)
    def load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_checkpoint_folder(path_or_url):
            return lightning_checkpoint(path_or_url, map_location, weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(load, _WRAPPED, True)
    return load
