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

The other direction, :func:`load_lightning_file`: ``ThreeDStrategy``'s ``ckpt_path=`` of a file one device (or DDP)
wrote resumes that run at any layout, optimizer states included (scaling a run up).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..core.agreed import mark_agreed
from ..core.materialize import load_full_state_dict
from ..core.tied import canonical_keys, canonical_names
from . import (
    DCP_METADATA,
    META_FILE,
    SECTION,
    check_complete,
    check_state_keys,
    fit_schedulers,
    optimizer_count_problem,
    restore_rank_state,
    whole_model,
)
from .named_state import MODEL_COPY, model_copy_paths, param_names, pop_path, put_path, torch_optimizer_state

if TYPE_CHECKING:
    from . import CheckpointContext

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


# ------------------------------------------------------------------------------------ a file into a 3D layout
def single_device_groups(unsplit: nn.Module | str | None) -> list[list[list[str]]]:
    """The parameters of one device's optimizers, by name: for each optimizer the user's ``configure_optimizers``
    makes for the unsplit model, for each of its groups, its parameters' names in order (the order that numbers
    them in the optimizer's ``state_dict``).

    Args:
        unsplit: a structure-only copy of the unsplit LightningModule (``boundary_check.make_skeleton``), or why
            none could be made.

    Raises:
        ValueError: no copy, or ``configure_optimizers`` holds parameters that are not the copy's (it read them
            from somewhere else than the module, e.g. ``self.trainer.model``).
    """
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    if not isinstance(unsplit, nn.Module):
        raise ValueError(f"no copy of the unsplit model to run configure_optimizers on ({unsplit or 'none kept'})")
    names: dict[int, str] = {}
    for name, param in unsplit.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)  # a tied weight: its first (canonical) name
    optimizers, _ = _init_optimizers_and_lr_schedulers(unsplit)
    groups = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "configure_optimizers, run on a copy of the unsplit model, gave parameters that are not the "
                "LightningModule's (read from self.parameters() or the module's submodules, not self.trainer.model)"
            )
        groups.append([[names[id(p)] for p in g["params"]] for g in optimizer.param_groups])
    return groups


def _optimizer_by_name(
    saved: Mapping[str, Any], groups: list[list[str]], which: int, path: Path
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """One device's ``optimizer.state_dict()`` (``saved``) by parameter name: each parameter's group
    hyperparameters and state (full tensors), its parameters numbered in the order of ``groups``."""
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise mark_agreed(
            ValueError(
                f"lightning_3d: optimizer {which} in {str(path)!r} has parameter groups of {sizes} parameters, but "
                f"configure_optimizers gives the unsplit model groups of {[len(g) for g in groups]}. Nothing was "
                "loaded."
            )
        )
    by_name: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for group, names in zip(saved["param_groups"], groups, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for index, fqn in zip(group["params"], names, strict=True):
            by_name[fqn] = (hyper, saved["state"].get(index, {}))
    return by_name


def _like(param: Tensor, value: Any) -> Any:
    """An optimizer state entry for ``param`` from the full one: this rank's slice of a tensor shaped like the
    parameter (a DTensor like it), other entries (``step``) as they are, each a copy of its own."""
    if not isinstance(value, Tensor):
        return value
    if value.dim() == 0 or tuple(value.shape) != tuple(param.shape):
        return value.clone()
    if isinstance(param, DTensor):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.to(param.device, copy=True)


def _rank_part(module: nn.Module, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """This rank's part of a whole-model state dict: the keys it holds, DTensor shards like its own."""
    full = canonical_keys(full, module)
    return {
        key: _like(target, full[key]) if isinstance(target, DTensor) else full[key].to(target.device)
        for key, target in module.state_dict(keep_vars=True).items()
        if key in full
    }


def load_lightning_file(
    context: CheckpointContext, path: Path, weights_only: bool | None, unsplit: nn.Module | str | None
) -> dict[str, Any]:
    """``ckpt_path=`` of a checkpoint file one device (or DDP) wrote, into the set-up model and optimizers at this
    layout: scaling a run up from plain Lightning. Each rank reads the file and takes its own slices (no
    communication); every check runs before anything is changed.

    The model's tensors are matched by name. One device's optimizer state numbers the parameters in the order of
    its groups, so the groups the user's ``configure_optimizers`` makes for the unsplit model (run on ``unsplit``,
    :func:`single_device_groups`) name them; each rank then takes the states and hyperparameters of the parameters
    its optimizers hold. The RNG states are not in such a file; a mid-epoch position is taken as the same number of
    batches per replica.

    Returns:
        Lightning's remaining checkpoint dict (loops, callbacks, LR schedulers fitted to this rank's groups).
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise mark_agreed(
            ValueError(
                f"lightning_3d: {str(path)!r} is neither a ThreeDStrategy checkpoint folder nor a Lightning checkpoint "
                "file (no 'state_dict'). To start from a plain state dict, pass `callbacks=[lightning_3d.checkpoint."
                "LoadWeights(path)]` to the Trainer instead of `ckpt_path`."
            )
        )
    module = context.module
    state = dict(canonical_keys(checkpoint.pop("state_dict"), module))
    check_state_keys(context, {k: tuple(v.shape) for k, v in state.items()}, path)
    trainer = module.trainer
    fitting = trainer.state.fn == TrainerFn.FITTING
    optimizers = [getattr(o, "_optimizer", o) for o in context.optimizers] if fitting else []
    saved_optimizers = checkpoint.pop("optimizer_states", None) or []
    problem = optimizer_count_problem(len(saved_optimizers), len(optimizers), path)
    if problem is not None:
        raise mark_agreed(problem)
    names = param_names(module)
    loads = []
    if optimizers:
        try:
            groups = single_device_groups(unsplit)
        except ValueError as err:
            raise mark_agreed(
                ValueError(f"lightning_3d: cannot restore the optimizer states of {str(path)!r}: {err}.")
            ) from None
        for i, (optimizer, saved) in enumerate(zip(optimizers, saved_optimizers, strict=True)):
            by_name = _optimizer_by_name(saved, groups[i], i, path)
            params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
            absent = sorted(fqn for fqn in params if fqn not in by_name)
            if absent:
                raise mark_agreed(
                    KeyError(
                        f"lightning_3d: optimizer {i} holds parameters that the one in {str(path)!r} did not: "
                        f"{', '.join(absent[:12])}. Nothing was loaded."
                    )
                )
            flat: dict[str, Any] = {}
            for fqn, param in params.items():
                hyper, entries = by_name[fqn]
                flat.update({f"param_groups.{fqn}.{k}": v for k, v in hyper.items()})
                flat.update({f"state.{fqn}.{k}": _like(param, v) for k, v in entries.items()})
            loads.append((optimizer, torch_optimizer_state(names, optimizer, flat)))
    # ---- every check passed and everything was read: only now is the live state changed
    load_full_state_dict(module, state, full_keys=context.full_spec.keys(), strict=False)
    for optimizer, torch_state in loads:
        optimizer.load_state_dict(torch_state)
    # this rank's part of the model and of the callbacks' copies of it, where Lightning's callbacks look for them
    checkpoint["state_dict"] = dict(module.state_dict())
    shapes = {name: spec.shape for name, spec in context.full_spec.items()}
    # one device's copies name a tied weight under each of its names, as its state_dict() does
    shapes.update({alias: shapes[name] for alias, name in canonical_names(module).items() if name in shapes})
    for where in model_copy_paths(checkpoint, shapes):
        put_path(checkpoint, where, _rank_part(module, pop_path(checkpoint, where)))
    fit_schedulers(checkpoint, trainer, fitting)
    restore_rank_state(context, trainer, {}, fitting)
    return checkpoint
