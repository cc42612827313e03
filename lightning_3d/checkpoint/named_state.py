"""Layout-independent state: one rank's model and optimizer keyed by parameter name, and key checks.

Pipeline stages keep the unsplit layer names (``body.7.attn.q_proj.weight``), so a rank's shard of the model
is simply its ``state_dict()``, DTensors included. The optimizer is keyed the same way, in the flattened
layout of torch's ``flatten_optimizer_state_dict``: ``state.<fqn>.<name>`` (``exp_avg`` ...) and
``param_groups.<fqn>.<hyperparameter>`` (``lr`` ...), so that any layout finds the entries of the parameters
it holds. Loading goes the other way: empty tensors shaped like the rank's parameters (DTensors with the
same placements, so DCP reads just the local shard) are filled by DCP and handed to
``optimizer.load_state_dict`` in torch's own format.

Optimizer states must be shaped like their parameter (Adam, SGD momentum, ...) or be replicated values such
as Adam's scalar ``step``; factored states (e.g. Adafactor's row/column statistics) are not resharded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..core.pruning import natural_name
from ..core.tied import canonical_names

MODEL = "state_dict"  # DCP key prefix of the model; ``optimizer_<i>`` for optimizer i


def model_state_dict(module: nn.Module) -> dict[str, Any]:
    """This rank's shard of the model: its stages' tensors under their unsplit names (DTensors as they are)."""
    return module.state_dict()


def param_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``module`` (the unsplit model's name), by object identity."""
    aliases = canonical_names(module)  # a tied weight is keyed by its canonical name (the first registered)
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        # a weight pruned by torch.nn.utils.prune (``weight_orig``) by the name ModelPruning's checkpoints give it
        plain = natural_name(module, name)
        names[id(p)] = aliases.get(plain, plain)
    return names


def _name_of(names: Mapping[int, str], param: Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise RuntimeError(
            f"lightning_3d: the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter "
            "of the LightningModule; only the module's own parameters can be checkpointed."
        ) from None


def optimizer_state_dict(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name (torch's flattened layout).

    Unlike ``get_optimizer_state_dict``, an optimizer that never stepped is saved as it is (hyperparameters
    only) instead of being initialised with a zero-gradient step, which would change the run being saved.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    names = param_names(module)
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            fqn = _name_of(names, param)
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in hyper.items()})
            flat.update({f"state.{fqn}.{k}": v for k, v in optimizer.state.get(param, {}).items()})
    return flat


def optimizer_template(names: Mapping[int, str], optimizer: Any, prefix: str, metadata: Metadata) -> dict[str, Any]:
    """Empty tensors (like the parameter, or as saved) for every saved key of this rank's parameters."""
    saved: dict[str, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix + "."):
            owner, _, name = key[len(prefix) + 1 :].rpartition(".")
            saved.setdefault(owner, {})[name] = entry
    template: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = _name_of(names, param)
            template.update({f"param_groups.{fqn}.{k}": None for k in saved.get(f"param_groups.{fqn}", {})})
            for name, entry in saved.get(f"state.{fqn}", {}).items():
                key = f"state.{fqn}.{name}"
                if not isinstance(entry, TensorStorageMetadata):
                    template[key] = None
                elif tuple(entry.size) == tuple(param.shape) and param.dim() > 0:
                    template[key] = torch.empty_like(param, dtype=entry.properties.dtype)
                else:
                    template[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return template


def unsaved_parameters(names: Mapping[int, str], optimizer: Any, prefix: str, metadata: Metadata) -> list[str]:
    """The names of ``optimizer``'s parameters that the checkpoint's optimizer ``prefix`` did not hold (every
    parameter an optimizer holds is saved with its group's hyperparameters, stepped or not)."""
    saved = {
        key[len(prefix) + len(".param_groups.") :].rpartition(".")[0]
        for key in metadata.state_dict_metadata
        if key.startswith(prefix + ".param_groups.")
    }
    live = [_name_of(names, param) for group in optimizer.param_groups for param in group["params"]]
    return [fqn for fqn in dict.fromkeys(live) if fqn not in saved]


def torch_optimizer_state(names: Mapping[int, str], optimizer: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened state of this rank's parameters in ``optimizer.load_state_dict`` form."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    seen: set[str] = set()
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for position, param in enumerate(group["params"]):
            fqn = _name_of(names, param)
            if position == 0:  # a group's hyperparameters are those saved for its first parameter
                new.update({k: flat[f"param_groups.{fqn}.{k}"] for k in new if f"param_groups.{fqn}.{k}" in flat})
            head = f"state.{fqn}."
            entries = {key[len(head) :]: value for key, value in flat.items() if key.startswith(head)}
            if fqn in seen:  # a tied weight's second copy (both ends of a V on this rank): states of its own, as
                # torch's load_state_dict keeps the tensors it is given and the optimizer updates them in place
                entries = {k: v.clone() if isinstance(v, Tensor) else v for k, v in entries.items()}
            seen.add(fqn)
            if entries:
                state[index] = entries
            ids.append(index)
            index += 1
        new["params"] = ids
        groups.append(new)
    return {"state": state, "param_groups": groups}


# LR scheduler entries that hold one value per parameter group, and the group hyperparameter each one equals:
# ``LRScheduler`` sets ``base_lrs[i] = group["initial_lr"]`` and, after each step, ``_last_lr[i] = group["lr"]``.
_PER_GROUP_HYPERPARAMETER = {"base_lrs": "initial_lr", "_last_lr": "lr"}
# Other per-group lists of torch's schedulers (LambdaLR / MultiplicativeLR, ReduceLROnPlateau, CyclicLR).
_PER_GROUP_LISTS = ("lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def fit_scheduler_state(saved: Mapping[str, Any], scheduler: Any) -> dict[str, Any]:
    """An LR scheduler's saved state fitted to this rank's optimizer (after the optimizer itself was restored).

    Lightning saves rank 0's schedulers only, and a scheduler keeps lists with one entry per parameter group;
    a pipeline stage can hold another number of groups than rank 0's (a stage of embeddings alone has no biases
    or norms, so a LightningModule that leaves out empty groups gives it one group where the others have two),
    and at another layout the groups hold other parameters. The group lists are therefore rebuilt from this
    rank's optimizer, whose hyperparameters were restored per parameter: ``base_lrs`` from each group's
    ``initial_lr``, ``_last_lr`` from its ``lr``. The other per-group lists of torch's schedulers (``lr_lambdas``,
    ``min_lrs``, ``max_lrs``, momentum bounds) are taken over when the counts agree, and otherwise only when all
    their entries are equal; the scalars (``last_epoch``, the step count) are rank 0's, the same on every rank.
    ``SequentialLR`` / ``ChainedScheduler`` have each of their schedulers fitted.

    Raises:
        ValueError: a per-group list with different entries cannot be matched to this rank's groups.
    """
    out = dict(saved)
    inner = getattr(scheduler, "_schedulers", None)
    if isinstance(out.get("_schedulers"), list) and isinstance(inner, (list, tuple)):
        out["_schedulers"] = [
            fit_scheduler_state(state, sub) if isinstance(state, Mapping) else state
            for state, sub in zip(out["_schedulers"], inner)
        ] + out["_schedulers"][len(inner) :]
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
    if not groups:
        return out
    for key, hyper in _PER_GROUP_HYPERPARAMETER.items():
        if isinstance(out.get(key), list) and all(hyper in group for group in groups):
            out[key] = [group[hyper] for group in groups]
    for key in _PER_GROUP_LISTS:
        value = saved.get(key)
        if not isinstance(value, list) or not value or len(value) == len(groups):
            continue
        if any(v != value[0] for v in value[1:]):
            raise ValueError(
                f"lightning_3d: cannot restore {type(scheduler).__name__}.{key}: the checkpoint holds a different "
                f"value for each of rank 0's {len(value)} parameter groups ({value!r}), and this rank's optimizer "
                f"has {len(groups)} groups. Keep the same parameter groups on every pipeline stage (empty groups "
                "are fine) or give the groups equal values."
            )
        out[key] = [value[0]] * len(groups)
    return out


# ------------------------------------------------------------------------------------------- key checks
@dataclass
class KeyReport:
    """How a checkpoint's model keys compare with the model's."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def message(self, path: Path | str) -> str:
        def show(keys: list[str]) -> str:
            return ", ".join(keys[:12]) + (f" ... ({len(keys)} in all)" if len(keys) > 12 else "") or "none"

        return (
            f"lightning_3d: checkpoint {str(path)!r} does not match the model. Missing keys (in the model, not in "
            f"the checkpoint): {show(self.missing)}. Unexpected keys (in the checkpoint, not in the model): "
            f"{show(self.unexpected)}. Shape mismatches: {show(self.mismatched)}. Nothing was loaded."
        )


def saved_model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...] | None]:
    """Model keys of a checkpoint with their global shapes (``None`` for non-tensor entries)."""
    head = MODEL + "."
    return {
        key[len(head) :]: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(head)
    }


def compare_keys(expected: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...] | None]) -> KeyReport:
    """Missing, unexpected and differently shaped keys of ``saved`` against the full model's ``expected``."""
    return KeyReport(
        missing=sorted(k for k in expected if k not in saved),
        unexpected=sorted(k for k in saved if k not in expected),
        mismatched=[
            f"{k}: checkpoint {saved[k]}, model {tuple(shape)}"
            for k, shape in expected.items()
            if k in saved and saved[k] is not None and tuple(saved[k] or ()) != tuple(shape)
        ],
    )


# ------------------------------------------------------------------ other copies of the model in the checkpoint
MODEL_COPY = "model_copy_{}"  # DCP key prefix of the i-th other state dict shaped like the model


def model_copy_paths(
    checkpoint: Mapping[str, Any], model_shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, ...]]:
    """Where ``checkpoint`` holds other state dicts shaped like the model, besides its ``state_dict``.

    Lightning's ``EMAWeightAveraging`` moves the trained weights to ``checkpoint["current_model_state"]`` (the
    averaged ones go to ``"state_dict"``), ``StochasticWeightAveraging`` keeps its averaged model in its callback
    state: each rank holds its own stages' part of these (DTensors included), so, like the model, they are written
    by every rank through DCP instead of rank 0's ``meta.pt``. A state dict here is a non-empty mapping of tensors
    whose keys are all keys of the model, each with the model's (global) shape for that key; nested dicts are
    searched, ``state_dict`` and ``optimizer_states`` not.

    Returns:
        The key paths, in the checkpoint's order (the same on every rank).
    """
    found: list[tuple[str, ...]] = []

    def like_model(state: Mapping[str, Any]) -> bool:
        return bool(state) and all(
            isinstance(v, Tensor) and k in model_shapes and tuple(v.shape) == tuple(model_shapes[k])
            for k, v in state.items()
        )

    def visit(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            if not isinstance(value, Mapping) or (not path and key in ("state_dict", "optimizer_states")):
                continue
            if like_model(value):
                found.append((*path, key))
            else:
                visit(value, (*path, key))

    visit(checkpoint, ())
    return found


def pop_path(tree: dict[str, Any], path: Sequence[str]) -> Any:
    """Remove and return ``tree[path[0]][path[1]]...``."""
    for key in path[:-1]:
        tree = tree[key]
    return tree.pop(path[-1])


def put_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def saved_keys(metadata: Metadata, prefix: str) -> set[str]:
    """The keys a checkpoint holds under the DCP prefix ``prefix`` (``state_dict``, ``model_copy_0``, ...)."""
    head = prefix + "."
    return {key[len(head) :] for key in metadata.state_dict_metadata if key.startswith(head)}
