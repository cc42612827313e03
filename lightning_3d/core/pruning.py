"""Lightning's ``ModelPruning`` callback on a model split into pipeline stages.

``ModelPruning.setup`` lists the ``(module, name)`` pairs to prune from the LightningModule, which Lightning
calls before the strategy splits the model. Under pp > 1 that list held every stage's modules on every rank: the
other stages' modules stayed alive (their memory never freed) and were pruned each epoch at their initial values,
and ``use_global_unstructured=True`` chose each rank's threshold over that mix (one stage's trained weights and
the others' stale ones): at pp2 the losses drifted from one device by 0.7% within three epochs.

After the strategy's setup, :func:`prune_this_stage` keeps the pairs this rank holds (the lottery-ticket copies
re-indexed alike), and global pruning is made exact across stages: each rank gathers every stage's importance
scores and current masks over the pipeline group, ordered as ``ModelPruning.setup`` listed them on the unsplit
model, runs torch's ``global_unstructured`` on that whole vector (the same vector one device prunes) and applies
its own slice with ``custom_from_mask``, as ``global_unstructured`` does on one device. Local pruning is per
tensor and needs nothing else. A random pruning method draws its own numbers on each rank (as under any change of
layout).

Under data or tensor parallelism the parameters are DTensors that ``replicate`` / FSDP2 / tensor parallelism own:
``torch.nn.utils.prune`` renames a parameter (``weight`` to ``weight_orig``) and assigns a plain tensor under its
old name before each forward, which FSDP2 refuses, and its masks index DTensors. :func:`refuse_pruning` says so
before any training instead of failing in the first forward (dp2: "cannot assign 'torch.DoubleTensor' as parameter
'weight'") or at the first pruning (tp2: "aten.index_put_.default: in-place operations that require placement
changes are not supported").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelPruning
from torch import nn
from torch.nn.utils import prune as torch_prune

from . import torch_compat


def pruning_callbacks(callbacks: Sequence[Any]) -> list[ModelPruning]:
    """The ``ModelPruning`` callbacks among ``callbacks``."""
    return [c for c in callbacks if isinstance(c, ModelPruning)]


def refuse_pruning(callbacks: Sequence[Any], dp: int, tp: int) -> None:
    """Raise where ``ModelPruning`` cannot work: any parameter a DTensor (data or tensor parallelism).

    Raises:
        ValueError: ``callbacks`` hold a ``ModelPruning`` and ``dp * tp > 1``.
    """
    if not pruning_callbacks(callbacks) or dp * tp == 1:
        return
    raise ValueError(
        f"lightning_3d: ModelPruning works with pipeline parallelism only (tp=1, one data-parallel replica); this run "
        f"has dp={dp}, tp={tp}. Under data or tensor parallelism every parameter is a DTensor owned by "
        "replicate / FSDP2 / tensor parallelism, and torch.nn.utils.prune renames the parameters it prunes "
        "('weight' to 'weight_orig') and computes masks by indexing them, which those refuse. Prune at pp only "
        "(ThreeDStrategy(pp=..., tp=1) on pp processes), or prune the trained model's checkpoint afterwards."
    )


def _held_pairs(callback: ModelPruning, module: nn.Module) -> list[int]:
    """Positions in the callback's list of the pairs whose module is part of ``module`` (this rank's stages)."""
    held = {id(m) for m in module.modules()}
    return [i for i, (owner, _) in enumerate(callback._parameters_to_prune) if id(owner) in held]


def prune_this_stage(
    callbacks: Sequence[Any], module: nn.Module, full_keys: Sequence[str], group: Any | None
) -> Callable[[], None]:
    """After the strategy's setup: each ``ModelPruning`` of ``callbacks`` prunes the modules this rank holds, and
    its global pruning covers every stage's (collective over ``group``, the pipeline group; ``None``: one stage).

    ``full_keys`` are the unsplit model's state-dict keys in order: the gathered vector is ordered by parameter
    name (``callback``'s ``parameter_names``, ``weight`` before ``bias``) and then by the tensor's place in the
    model, as ``ModelPruning`` lists the unsplit model.

    Returns:
        The undo (the callbacks' own global pruning back), for teardown.
    """
    undo: list[Callable[[], None]] = []
    place = {key: n for n, key in enumerate(full_keys)}
    for callback in pruning_callbacks(callbacks):
        keep = _held_pairs(callback, module)
        index = {old: new for new, old in enumerate(keep)}
        callback._parameters_to_prune = [callback._parameters_to_prune[i] for i in keep]
        if callback._original_layers is not None:  # the lottery ticket's initial copies, of this rank's modules
            callback._original_layers = {
                key: {"data": ref["data"], "names": [(index[i], name) for i, name in ref["names"] if i in index]}
                for key, ref in callback._original_layers.items()
                if any(i in index for i, _ in ref["names"])
            }  # type: ignore[assignment]
        if group is None or "_apply_global_pruning" in vars(callback):
            continue
        fqns = {id(m): fqn for fqn, m in module.named_modules()}
        names = list(callback._parameter_names)

        def key_of(owner: nn.Module, name: str, _fqns: dict[int, str] = fqns, _names: list[str] = names) -> tuple:
            full = f"{_fqns[id(owner)]}.{name}".lstrip(".")
            return (_names.index(name) if name in _names else len(_names), place.get(full, len(place)), full)

        def apply_global(amount: float, _callback: ModelPruning = callback, _key: Callable = key_of) -> None:
            prune_globally(_callback, amount, _key, group)

        callback._apply_global_pruning = apply_global  # type: ignore[method-assign]
        undo.append(lambda _callback=callback: vars(_callback).pop("_apply_global_pruning", None))

    def undo_all() -> None:
        for step in undo:
            step()

    return undo_all


def prune_globally(
    callback: ModelPruning, amount: float, key_of: Callable[[nn.Module, str], tuple], group: Any
) -> None:
    """``ModelPruning``'s global unstructured pruning over every pipeline stage's pairs (collective over ``group``).

    Each rank contributes its pairs' ``(key, importance, current mask)``; every rank then runs torch's
    ``global_unstructured`` on holder modules of the whole gathered vector, ordered by key, and applies its own
    pairs' masks with ``custom_from_mask``, as ``global_unstructured`` does on one device."""
    mine = []
    for owner, name in callback._parameters_to_prune:
        mask = getattr(owner, name + "_mask", None)
        mine.append((key_of(owner, name), getattr(owner, name).detach().cpu(), None if mask is None else mask.cpu()))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    holders: dict[tuple, nn.Module] = {}
    for key, score, mask in sorted((entry for part in gathered for entry in part), key=lambda entry: entry[0]):
        holder = nn.Module()
        holder.register_parameter("tensor", nn.Parameter(score, requires_grad=False))
        if mask is not None:
            holder.register_buffer("tensor_mask", mask)
        holders[key] = holder
    torch_prune.global_unstructured(
        [(holder, "tensor") for holder in holders.values()],
        pruning_method=callback.pruning_fn,
        **callback._resolve_global_kwargs(amount),
    )
    for owner, name in callback._parameters_to_prune:
        mask = holders[key_of(owner, name)].tensor_mask
        torch_prune.custom_from_mask(owner, name, mask=mask.to(getattr(owner, name).device))


def natural_name(module: nn.Module, name: str) -> str:
    """The name of parameter ``name`` of ``module`` in a pruned module's permanent state dict: ``torch.nn.utils.prune``
    keeps a pruned ``weight`` as ``weight_orig`` (and a mask), and ``ModelPruning`` saves ``weight`` again; any other
    name is returned as it is."""
    owner, _, attr = name.rpartition(".")
    if not attr.endswith("_orig"):
        return name
    base = attr[: -len("_orig")]
    holder = module.get_submodule(owner)
    pruned = any(
        isinstance(hook, torch_prune.BasePruningMethod) and getattr(hook, "_tensor_name", None) == base
        for hook in torch_compat.forward_pre_hooks(holder)
    )
    return name[: -len("_orig")] if pruned else name


__all__ = ["natural_name", "prune_globally", "prune_this_stage", "pruning_callbacks", "refuse_pruning"]
