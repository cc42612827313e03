"""Sharded, atomic, layout-independent checkpoints for ``ThreeDStrategy`` (``torch.distributed.checkpoint``).

A checkpoint is a directory, named like Lightning's checkpoint files (``epoch=0-step=5.ckpt``, ``last.ckpt``)::

    epoch=0-step=5.ckpt/
        __0_0.distcp ...   DCP: each rank writes only its own shards; a tensor replicated over dp (or tp) is
                           written once, by one of its holders
        .metadata          DCP: global shape, dtype and file location of every chunk (written last by DCP)
        meta.pt            rank 0: Lightning's checkpoint without its tensors (loops, callbacks, LR schedulers,
                           hyperparameters, datamodule state) plus a ``lightning_3d`` section: format, layout,
                           every rank's RNG state, the data layout, the model's key order

DCP keys do not depend on the layout: ``state_dict.<fqn>`` for the model (pipeline stages keep the unsplit
layer names) and ``optimizer_<i>.state.<fqn>.<name>`` / ``optimizer_<i>.param_groups.<fqn>.<hyperparameter>``
for optimizer ``i`` (the layout of torch's ``flatten_optimizer_state_dict``); ``model_copy_<i>.<fqn>`` for
other state dicts shaped like the model that Lightning's callbacks put in the checkpoint (``EMAWeightAveraging``'s
trained weights, ``StochasticWeightAveraging``'s average), their places kept in ``meta.pt``. Loading at another
(tp, pp, dp) therefore reads, on every rank, exactly the keys and shards it now holds; DCP reshards DTensors.

Atomicity: every rank writes into ``.<name>.partial`` beside the target. After DCP has written ``.metadata``
and rank 0 has written and synced ``meta.pt``, rank 0 renames the folder to ``<name>`` (an existing checkpoint
of that name is first renamed to ``.<name>.old``, then deleted). Removal renames to ``.<name>.deleting``
before deleting. Dot-names match none of Lightning's ``*.ckpt`` patterns, so ``ckpt_path="last"``, top-k and
version counters only ever see complete checkpoints; a later save of the same name clears the leftovers.

Export: ``python -m lightning_3d.checkpoint export CKPT_DIR OUT.pt`` writes the single-device state dict
(one process, no process group); the :class:`LoadWeights` callback starts 3D training from such a file.
``lightning_file.py`` reads a folder as one device's Lightning checkpoint file (``load_from_checkpoint(folder)``,
``python -m lightning_3d.checkpoint consolidate``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..core.agreed import mark_agreed, on_rank0_told
from ..core.partition import TensorSpec
from ..core.rng import BodyRandomness
from ..core.tied import assign, canonical_keys, canonical_names
from ..core.topology import Topology
from .named_state import (
    MODEL,
    MODEL_COPY,
    compare_keys,
    fit_scheduler_state,
    model_copy_paths,
    model_state_dict,
    optimizer_state_dict,
    optimizer_template,
    param_names,
    pop_path,
    put_path,
    saved_keys,
    saved_model_shapes,
    torch_optimizer_state,
    unsaved_parameters,
)
from .resume import ResumePosition, rng_state, set_rng_state, source_rank, train_batch_size

__all__ = [
    "CheckpointContext",
    "LoadWeights",
    "check_complete",
    "export",
    "load_checkpoint",
    "load_consolidated",
    "model_state_dict",
    "optimizer_count_problem",
    "optimizer_state_dict",
    "read_whole",
    "remove_checkpoint",
    "save_checkpoint",
    "whole_model",
]

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint
DCP_METADATA = ".metadata"
SECTION = "lightning_3d"
FORMAT = 1


@dataclass(frozen=True)
class CheckpointContext:
    """What saving and loading need from the strategy; ``ThreeDStrategy`` builds one per call.

    Args:
        module: the set-up (split, sharded, wrapped) LightningModule.
        topology: the job's (dp, pp, tp) degrees.
        global_rank: this rank.
        device: this rank's device.
        stages: the layer names of every pipeline stage (``None`` before the model is split).
        full_spec: the whole model's tensors (name -> shape, dtype), in ``state_dict`` order.
        optimizers: the strategy's optimizers (Lightning's wrappers or torch's).
        randomness: the body's random streams (saved with every rank's RNG state).
        broadcast: rank 0's object to every rank (collective).
        barrier: all ranks meet (collective).
    """

    module: pl.LightningModule
    topology: Topology
    global_rank: int
    device: torch.device
    stages: list[list[str]] | None
    full_spec: Mapping[str, TensorSpec]
    optimizers: Sequence[Any]
    randomness: BodyRandomness | None
    broadcast: Callable[[Any], Any]
    barrier: Callable[[], None]


# ------------------------------------------------------------------------------------------- paths
def staging_path(path: Path) -> Path:
    """Where a save of ``path`` is written before it is renamed into place."""
    return path.with_name(f".{path.name}.partial")


def check_complete(path: Path) -> None:
    """Raise unless ``path`` is a complete checkpoint folder (DCP ``.metadata`` and ``meta.pt`` present)."""
    if not path.exists():
        old = path.with_name(f".{path.name}.old")
        hint = f" A complete copy was left at {old} by an interrupted save; rename it back." if old.is_dir() else ""
        raise FileNotFoundError(f"lightning_3d: checkpoint {str(path)!r} does not exist.{hint}")
    if not path.is_dir():
        raise ValueError(
            f"lightning_3d: {str(path)!r} is a file, not a ThreeDStrategy checkpoint folder. To start 3D training "
            "from a single-device state dict (e.g. one written by `python -m lightning_3d.checkpoint export`), "
            "pass `callbacks=[lightning_3d.checkpoint.LoadWeights(path)]` to the Trainer instead of `ckpt_path`."
        )
    missing = [name for name in (DCP_METADATA, META_FILE) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"lightning_3d: checkpoint folder {str(path)!r} is incomplete (no {' and no '.join(missing)}): its save "
            "was interrupted, or it was not written by ThreeDStrategy. Resume from an earlier checkpoint."
        )


def _remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_meta(checkpoint: dict[str, Any], file: Path) -> None:
    with open(file, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())


def _publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` folder to ``path``, replacing an older checkpoint of that name."""
    old = path.with_name(f".{path.name}.old")
    _remove_path(old)
    if path.exists() or path.is_symlink():
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(path.parent)
    _remove_path(old)


def remove_checkpoint(filepath: str | os.PathLike, global_rank: int) -> None:
    """Delete a checkpoint (rank 0): first renamed out of sight, so a half-deleted folder is never picked."""
    if global_rank != 0:
        return
    path = Path(filepath)
    if path.is_dir() and not path.is_symlink():
        doomed = path.with_name(f".{path.name}.deleting")
        _remove_path(doomed)
        os.replace(path, doomed)
        path = doomed
    _remove_path(path)


# ------------------------------------------------------------------------------------------- save and load
def _gather_to_rank0(obj: Any) -> list[Any] | None:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _all_ranks(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_optimizer_keys(names: Mapping[int, str], optimizers: Sequence[Any], metadata: Any, path: Path) -> None:
    """Raise on every rank alike when an optimizer holds a parameter the checkpoint's optimizer did not (one
    object all-gather: ranks hold different parameters), instead of leaving its state empty without a word."""
    mine = {n: unsaved_parameters(names, o, f"optimizer_{n}", metadata) for n, o in enumerate(optimizers)}
    unsaved = sorted({(n, fqn) for part in _all_ranks(mine) for n, fqns in part.items() for fqn in fqns})
    if not unsaved:
        return
    listed = ", ".join(f"{fqn!r} (optimizer {n})" for n, fqn in unsaved[:5])
    more = f" and {len(unsaved) - 5} more" if len(unsaved) > 5 else ""
    raise mark_agreed(
        KeyError(
            f"lightning_3d: checkpoint {str(path)!r} has no optimizer state for {listed}{more}: the optimizer "
            "returned by configure_optimizers holds parameters that the saved one did not (as one device's "
            "optimizer.load_state_dict refuses groups of other sizes). Nothing was loaded. To start a new optimizer "
            "from these weights, export them (python -m lightning_3d.checkpoint export CKPT model.pt) and train "
            "with callbacks=[lightning_3d.checkpoint.LoadWeights('model.pt')] instead of resuming."
        )
    )


def _layout(context: CheckpointContext) -> dict[str, Any]:
    dp, pp, tp = context.topology.shape
    return {"dp": dp, "pp": pp, "tp": tp, "world_size": context.topology.world_size, "stages": context.stages}


def save_checkpoint(
    context: CheckpointContext, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
) -> None:
    """Write Lightning's ``checkpoint`` dict as a checkpoint folder at ``filepath`` (collective; see module doc)."""
    if storage_options is not None:
        raise TypeError(
            "ThreeDStrategy.save_checkpoint(..., storage_options=...) is not supported: the checkpoint is written "
            "by torch.distributed.checkpoint, not by a CheckpointIO plugin."
        )
    path = Path(context.broadcast(os.fspath(filepath)))
    staging = staging_path(path)
    is_rank0 = context.global_rank == 0
    if is_rank0:
        _remove_path(staging)  # left by a save that was killed
        staging.mkdir(parents=True)
    context.barrier()
    # each tied weight once, canonically, also where a callback rebuilt the dict after the module's own hook ran
    # (ModelPruning's permanent weights: ``lm_head.weight_orig`` becomes ``lm_head.weight`` there)
    tensors: dict[str, Any] = {MODEL: dict(canonical_keys(checkpoint.pop("state_dict"), context.module))}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    for i, state in enumerate(optimizer_states or []):
        tensors[f"optimizer_{i}"] = state
    shapes = {name: spec.shape for name, spec in context.full_spec.items()}
    copies = model_copy_paths(checkpoint, shapes)  # EMA's current weights, SWA's average, ...
    for i, where in enumerate(copies):
        tensors[MODEL_COPY.format(i)] = pop_path(checkpoint, where)
    rng = _gather_to_rank0(rng_state(context.device, context.randomness))
    dcp.save(tensors, checkpoint_id=staging)

    def finish() -> None:
        trainer = context.module.trainer
        checkpoint[SECTION] = {
            "format": FORMAT,
            "layout": _layout(context),
            "rng": rng,
            "data": {"dp": context.topology.shape[0], "batch_size": train_batch_size(trainer)},
            "keys": list(context.full_spec),
            "model_copies": [list(where) for where in copies],
            "aliases": dict(canonical_names(context.module)),  # tied weights: each other name -> the saved one
        }
        _write_meta(checkpoint, staging / META_FILE)
        _publish(staging, path)

    on_rank0_told(is_rank0, context.broadcast, finish, f"finish the checkpoint {str(path)!r}")


def load_checkpoint(
    context: CheckpointContext, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load a checkpoint folder into the set-up model and optimizers, at any layout (collective).

    Every check runs before anything is modified: a checkpoint of another model raises an error naming the
    missing, unexpected and differently shaped keys, and leaves the model and optimizers as they were.

    Returns:
        Lightning's remaining checkpoint dict (loops, callbacks, LR schedulers, ...), for Lightning to restore.
    """
    path = Path(context.broadcast(os.fspath(checkpoint_path)))
    try:
        check_complete(path)
    except FileNotFoundError as err:
        raise mark_agreed(err) from None
    module = context.module
    metadata = FileSystemReader(path).read_metadata()
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    section = meta.pop(SECTION, None) or {}
    saved = saved_model_shapes(metadata)
    check_state_keys(context, saved, path)
    trainer = module.trainer
    fitting = trainer.state.fn == TrainerFn.FITTING
    optimizers = [getattr(o, "_optimizer", o) for o in context.optimizers] if fitting else []
    saved_optimizers = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("optimizer_")})
    problem = optimizer_count_problem(len(saved_optimizers), len(optimizers), path)
    if problem is not None:
        raise mark_agreed(problem)
    names = param_names(module)
    live = module.state_dict()
    model = {k: torch.empty_like(v) for k, v in live.items() if k in saved}
    state: dict[str, Any] = {MODEL: model}
    copies = [tuple(where) for where in section.get("model_copies", [])]
    for i in range(len(copies)):
        held = saved_keys(metadata, MODEL_COPY.format(i))
        state[MODEL_COPY.format(i)] = {k: torch.empty_like(v) for k, v in live.items() if k in held}
    _check_optimizer_keys(names, optimizers, metadata, path)
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_template(names, optimizer, f"optimizer_{i}", metadata)
    dcp.load(state, checkpoint_id=path)
    # ---- every check passed and everything was read: only now is the live state changed
    targets = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, loaded in model.items():
            _local(targets[key]).copy_(_local(loaded))
    for copy, key in _untied_copies(module, model):
        assign(copy, model[key])
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(torch_optimizer_state(names, optimizer, state[f"optimizer_{i}"]))
    # this rank's part of the model and of its other copies, where Lightning's callbacks look for them
    meta["state_dict"] = model
    for i, where in enumerate(copies):
        put_path(meta, where, state[MODEL_COPY.format(i)])
    fit_schedulers(meta, trainer, fitting)
    restore_rank_state(context, trainer, section, fitting)
    return meta


def check_state_keys(context: CheckpointContext, saved: Mapping[str, tuple[int, ...] | None], path: Path) -> None:
    """Refuse a checkpoint whose model keys (``saved``: name -> global shape) do not fit the model (missing or
    unexpected keys only with the module's ``strict_loading``; a warning otherwise)."""
    report = compare_keys({k: spec.shape for k, spec in context.full_spec.items()}, saved)
    # The checks see the same checkpoint and (setup checked it) the same model on every rank: each rank raises the
    # same error by itself, so they are "agreed" and do not trip the fail-fast watch (see core/agreed.py).
    if report.mismatched or (report and context.module.strict_loading):
        raise mark_agreed(KeyError(report.message(path)))
    if report:
        warnings.warn(report.message(path).replace("Nothing was loaded.", "Loading the common keys."), stacklevel=3)


def optimizer_count_problem(saved: int, live: int, path: Path) -> Exception | None:
    """The error for a checkpoint holding ``saved`` optimizer states where the fit has ``live`` optimizers to restore
    (``0`` when not fitting), or ``None``."""
    if live and not saved:
        return KeyError(
            "Trying to restore optimizer state but checkpoint contains only the model. This is probably due to "
            "`ModelCheckpoint.save_weights_only` being set to `True`."
        )
    if live and saved != live:
        return ValueError(
            f"lightning_3d: checkpoint {str(path)!r} holds {saved} optimizer states but configure_optimizers "
            f"returned {live} optimizers. Nothing was loaded."
        )
    return None


def fit_schedulers(meta: dict[str, Any], trainer: pl.Trainer, fitting: bool) -> None:
    """Lightning's saved LR schedulers (rank 0's, or one device's) fitted to this rank's parameter groups."""
    if fitting and isinstance(meta.get("lr_schedulers"), list):
        configs = trainer.lr_scheduler_configs
        meta["lr_schedulers"] = [
            fit_scheduler_state(saved_state, config.scheduler) if isinstance(saved_state, dict) else saved_state
            for saved_state, config in zip(meta["lr_schedulers"], configs)
        ] + meta["lr_schedulers"][len(configs) :]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _untied_copies(module: nn.Module, loaded: Mapping[str, Tensor]) -> list[tuple[Tensor, str]]:
    """The second copies of tied weights held on this rank beside their canonical parameter (both ends of a V
    schedule with tp or dp > 1: ``core/tied.py``), each with the loaded key it takes its value from; the state dict
    names only the canonical one."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return [
        (params[alias], canonical)
        for alias, canonical in canonical_names(module).items()
        if canonical in loaded and alias in params and canonical in params and params[alias] is not params[canonical]
    ]


def restore_rank_state(context: CheckpointContext, trainer: pl.Trainer, section: dict[str, Any], fitting: bool) -> None:
    """RNG state (and, when fitting, the data position) for this rank; see ``resume.py``."""
    layout, rngs = section.get("layout"), section.get("rng")
    dp, pp, tp = context.topology.shape
    rng = None
    if layout is not None and rngs:
        rng = rngs[source_rank(layout, context.topology, context.global_rank)]
        same_layout = (layout["dp"], layout["pp"], layout["tp"]) == (dp, pp, tp)
        if not same_layout:
            # the body's streams belong to stages and tp ranks of the saved layout: fresh ones here
            rng = {k: v for k, v in rng.items() if k != "streams"}
        if not same_layout and context.global_rank == 0:
            rank_zero_info(
                f"lightning_3d: resharded a checkpoint saved at (tp={layout['tp']}, pp={layout['pp']}, "
                f"dp={layout['dp']}) into (tp={tp}, pp={pp}, dp={dp})."
            )
    if not fitting:
        if rng is not None:
            set_rng_state(rng, context.device, context.randomness)
        return
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ResumePosition)]
    trainer.callbacks.append(ResumePosition(rng, section.get("data", {}), dp, context.device, context.randomness))


# ------------------------------------------------------------------------------------------- export / import
def read_whole(checkpoint_dir: str | os.PathLike, prefix: str = MODEL) -> dict[str, Tensor]:
    """Every tensor a checkpoint folder holds under the DCP key ``prefix`` (``state_dict``, ``model_copy_0``, ...),
    whole and on the CPU, in one process (no process group needed); keys without the prefix, in DCP's order."""
    path = Path(checkpoint_dir)
    metadata = FileSystemReader(path).read_metadata()
    template: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix + "."):
            shape = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            dtype = entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else None
            template[key[len(prefix) + 1 :]] = torch.empty(shape, dtype=dtype) if shape is not None else None
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load({prefix: template}, checkpoint_id=path, no_dist=True)
    return template


def load_consolidated(checkpoint_dir: str | os.PathLike) -> dict[str, Tensor]:
    """The whole model from a checkpoint folder, in one process (no process group needed).

    Returns:
        The single-device state dict: CPU tensors, every key of the plain module's ``state_dict()`` in its order,
        a weight tied to another (saved once) under each of its names, the other names last.
    """
    path = Path(checkpoint_dir)
    check_complete(path)
    try:
        section = torch.load(path / META_FILE, map_location="cpu", weights_only=True).get(SECTION, {})
    except Exception:  # meta.pt with objects that weights_only refuses: DCP's order, tied weights under one name
        section = {}
    return whole_model(path, section)


def whole_model(path: Path, section: Mapping[str, Any], prefix: str = MODEL) -> dict[str, Tensor]:
    """``load_consolidated`` of a complete folder whose ``meta.pt`` section (``SECTION``) is already read; of the
    model copy ``prefix`` (``model_copy_<i>``) instead of the model if given."""
    whole = read_whole(path, prefix)
    ordered = {k: whole[k] for k in section.get("keys", []) if k in whole}
    ordered.update({k: v for k, v in whole.items() if k not in ordered})
    for alias, canonical in section.get("aliases", {}).items():  # the same tensor, as one process's state_dict()
        if canonical in ordered:
            ordered.setdefault(alias, ordered[canonical])
    return ordered


def export(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> dict[str, Tensor]:
    """Write the single-device state dict of a checkpoint folder to ``out`` (``torch.save``) and return it.

    Example:
        >>> sd = export("checkpoints/last.ckpt", "model.pt")  # doctest: +SKIP
        >>> MyModule().load_state_dict(torch.load("model.pt"))  # doctest: +SKIP
    """
    state_dict = load_consolidated(checkpoint_dir)
    torch.save(state_dict, out)
    return state_dict


class LoadWeights(pl.Callback):
    """Start training (or evaluation) from a single-device state dict file, e.g. one written by :func:`export`,
    or from a Hugging Face model folder (``config.json`` + safetensors, e.g. written by ``export-hf``) for a
    LightningModule that holds that Hugging Face model (see :func:`lightning_3d.checkpoint.hf.read_hf_folder`).

    Loads once per callback instance, at the start of the first ``fit`` / ``validate`` / ``test`` /
    ``predict``: after ``ThreeDStrategy`` has split and sharded the model and before a ``ckpt_path`` is
    restored (a resumed checkpoint wins); each rank copies only its own slices. Works with any strategy
    (others get ``load_state_dict``). A Lightning checkpoint file (``{"state_dict": ...}``) works too.

    Args:
        path: the ``torch.save`` file, or a Hugging Face model folder.
        strict: refuse missing or unexpected keys.

    Example:
        >>> Trainer(strategy=ThreeDStrategy(pp=2), callbacks=[LoadWeights("model.pt")])  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, strict: bool = True) -> None:
        self.path, self.strict = Path(path), strict
        self._loaded = False

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loaded:
            return
        self._loaded = True
        from .hf import is_hf_folder, read_hf_folder  # transformers is imported only for a Hugging Face folder

        if is_hf_folder(self.path):
            state_dict = read_hf_folder(self.path, pl_module)
        else:
            state_dict = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(state_dict.get("state_dict"), Mapping):
            state_dict = state_dict["state_dict"]
        load_full = getattr(trainer.strategy, "load_full_state_dict", None)
        if callable(load_full):
            load_full(state_dict, strict=self.strict)
        else:
            pl_module.load_state_dict(state_dict, strict=self.strict)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module)


def export_hf_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    module_attr: str | None = None,
    config: Any = None,
) -> Path:
    """:func:`export_hf` of a ThreeDStrategy checkpoint folder (one process, no process group).

    Args:
        checkpoint_dir: the checkpoint folder (``.../last.ckpt``).
        out_dir: the Hugging Face folder to write.
        module_attr: attribute path of the model in the LightningModule; inferred when None.
        config: the model's config (see :func:`config_from`); None: the ``hf_config`` stored in the checkpoint's
            ``meta.pt`` (see :data:`HF_CONFIG_KEY`).

    Returns:
        ``out_dir``.
    """
    from .hf import HF_CONFIG_KEY, export_hf  # transformers is imported only here

    path = Path(checkpoint_dir)
    state_dict = load_consolidated(path)
    if config is None:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        stored: dict[str, Any] = meta.get(HF_CONFIG_KEY) or {}
        if module_attr is not None:
            if module_attr.strip(".") not in stored:
                raise ValueError(
                    f"lightning_3d: checkpoint {str(path)!r} stores no Hugging Face config for {module_attr!r} "
                    f"(stored: {sorted(stored) or 'none'}); pass --config CONFIG_JSON_OR_FOLDER"
                )
            config = stored[module_attr.strip(".")]
        elif len(stored) == 1:
            module_attr, config = next(iter(stored.items()))
        else:
            raise ValueError(
                f"lightning_3d: checkpoint {str(path)!r} stores "
                f"{'no Hugging Face config' if not stored else f'several ({sorted(stored)}); pass --module-attr'}. "
                f"Pass --config CONFIG_JSON_OR_FOLDER (or store `checkpoint['{HF_CONFIG_KEY}'] = hf_configs(self)` "
                "in the LightningModule's on_save_checkpoint)."
            )
    return export_hf(state_dict, out_dir, config, module_attr=module_attr)
