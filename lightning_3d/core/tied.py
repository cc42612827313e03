"""Weights tied across the first and the last pipeline stage (an LM head sharing the input embedding's matrix).

Megatron's way, which keeps single-device numbers: the first stage (embedding) and the last stage (head) each hold
the weight, start from the same values (broadcast from the first stage at setup), and after every batch's backward
the two gradients are summed over the *embedding group* (the first and last stage rank of each pipeline, i.e. the
same dp and tp coordinates), so both copies take the same optimizer step. The gradient norm counts the weight once
(the last stage's copy is left out of the norm), and checkpoints store it once, under the name it has in the
unsplit model (the first name it is registered under): ``alias_hooks`` renames the other name in ``state_dict`` and
back in ``load_state_dict``.

Under a V schedule the first and the last stage share a pipeline rank. At dp = tp = 1 the weight stays one tensor
there; with tensor or data parallelism each stage is wrapped on its own, and two wrappers cannot share one
parameter, so that rank holds two copies as well (:func:`untie`), and their gradients are summed locally
(:meth:`TiedWeights.local`) instead of over an embedding group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .agreed import mark_agreed

ALIASES_ATTR = "_lightning_3d_aliases"


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def install_alias_hooks(module: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Make ``module.state_dict()`` name each tied weight once, canonically, and ``load_state_dict`` accept that.

    Args:
        module: the root module (the LightningModule).
        groups: names of one tied parameter each; the first is canonical (``ModelSplit.aliases``).
    """
    aliases = {alias: group[0] for group in groups for alias in group[1:]}
    if not aliases:
        return
    setattr(module, ALIASES_ATTR, aliases)

    def save_hook(mod: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for alias, canonical in aliases.items():
            key = prefix + alias
            if key not in state:
                continue
            value = state.pop(key)
            state.setdefault(prefix + canonical, value)

    def load_hook(mod: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        raw = {name for name, _ in mod.named_parameters(remove_duplicate=False)}
        for alias, canonical in aliases.items():
            if prefix + canonical not in state or alias not in raw or prefix + alias in state:
                continue
            if canonical in raw:  # both names held here (one stage): the one tensor under both keys
                state[prefix + alias] = state[prefix + canonical]
            else:  # only the alias is held here (the last stage)
                state[prefix + alias] = state.pop(prefix + canonical)

    module.register_state_dict_post_hook(save_hook)
    module.register_load_state_dict_pre_hook(load_hook)


def retie(root: nn.Module, groups: Sequence[Sequence[str]], prefix: str) -> None:
    """Point the parameters under ``prefix`` that are tied to an already materialised canonical parameter back at it.

    Materialising modules one at a time allocates each module's meta parameters anew, which unties a weight shared
    by two modules; calling this before materialising each module keeps the tie (the canonical module comes first).
    """
    named = dict(root.named_parameters(remove_duplicate=False))
    for group in groups:
        canonical = named.get(group[0])
        if canonical is None or canonical.is_meta:
            continue
        for alias in group[1:]:
            if alias not in named or named[alias] is canonical:
                continue
            if prefix and not (alias == prefix or alias.startswith(prefix + ".")):
                continue
            owner_name, _, leaf = alias.rpartition(".")
            owner = root.get_submodule(owner_name) if owner_name else root
            owner.register_parameter(leaf, canonical)


def untie(root: nn.Module, groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """Give every alias of ``groups`` that ``root`` holds as the canonical parameter itself a parameter of its own,
    equal to it (on the meta device while the model is): the two can then be wrapped by different stages.

    Returns:
        The groups that were untied (both names held by ``root``).
    """
    named = dict(root.named_parameters(remove_duplicate=False))
    untied = []
    for group in groups:
        canonical = named.get(group[0])
        if canonical is None:
            continue
        aliases = [alias for alias in group[1:] if named.get(alias) is canonical]
        for alias in aliases:
            owner_name, _, leaf = alias.rpartition(".")
            owner = root.get_submodule(owner_name) if owner_name else root
            copy = nn.Parameter(canonical.detach().clone(), requires_grad=canonical.requires_grad)
            owner.register_parameter(leaf, copy)
        if aliases:
            untied.append(tuple(group))
    return untied


def _in_layout(src: Tensor, like: Tensor) -> Tensor:
    """``src`` laid out as ``like``: the same DTensor mesh and placements, or a plain tensor."""
    if not isinstance(like, DTensor):
        return src.full_tensor() if isinstance(src, DTensor) else src
    if isinstance(src, DTensor):
        if src.device_mesh == like.device_mesh:
            return src if src.placements == like.placements else src.redistribute(like.device_mesh, like.placements)
        src = src.full_tensor()
    # every rank holds the whole value: each takes its own shard, no communication
    return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=None)


def assign(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for two copies of one tied weight, whatever their layouts (plain, or DTensors of any
    placements); local when the layouts agree."""
    with torch.no_grad():
        if _same_layout(dst, src):
            _local(dst).copy_(_local(src))
        else:
            dst.copy_(_in_layout(src, dst))


def _same_layout(a: Tensor, b: Tensor) -> bool:
    if isinstance(a, DTensor) and isinstance(b, DTensor):
        return a.device_mesh == b.device_mesh and a.placements == b.placements
    return not isinstance(a, DTensor) and not isinstance(b, DTensor)


def canonical_names(module: nn.Module) -> Mapping[str, str]:
    """``{alias: canonical}`` for the tied weights of ``module`` (empty when there are none)."""
    return getattr(module, ALIASES_ATTR, {})


def with_alias_keys(state: dict[str, Tensor], module: nn.Module) -> dict[str, Tensor]:
    """``state`` (a whole-model state dict named as ``module.state_dict()`` names it: each tied weight once, under
    its canonical name) with each alias added as the same tensor: the keys one process's ``state_dict()`` of the
    unsplit model has, so ``load_state_dict`` of a plain copy of the model takes it."""
    for alias, canonical in canonical_names(module).items():
        if canonical in state:
            state.setdefault(alias, state[canonical])
    return state


def canonical_keys(state: Mapping[str, Tensor], module: nn.Module) -> Mapping[str, Tensor]:
    """``state`` with each tied weight under its canonical name only, as ``module`` names it: an alias key
    (what one process's ``state_dict()`` of the unsplit model also has) is dropped when the canonical key is
    there and renamed to it when not. ``state`` itself is not changed."""
    aliases = canonical_names(module)
    if not any(alias in state for alias in aliases):
        return state
    out = dict(state)
    for alias, canonical in aliases.items():
        if alias in out:
            out.setdefault(canonical, out.pop(alias))
    return out


def embedding_groups(grid: Sequence[Sequence[Sequence[int]]], end_ranks: tuple[int, int] | None) -> list[list[int]]:
    """The embedding groups of a (dp, pp, tp) grid of global ranks: for each (dp, tp) position, the global ranks of
    the pp ranks holding the first and the last stage (``end_ranks``; ``None``: pp ranks 0 and pp - 1), first
    stage first. The same list, in the same order, on every rank."""
    pp = len(grid[0])
    first, last = end_ranks if end_ranks is not None else (0, pp - 1)
    return [[plane[first][t], plane[last][t]] for plane in grid for t in range(len(plane[0]))]


class TiedWeights:
    """This rank's copies of the weights tied across the first and last stage, and their embedding groups.

    Build it on every rank (it creates process groups: a collective call); ranks on neither end stage hold nothing.
    A rank holding both ends (a V schedule with tensor or data parallelism) uses :meth:`local` instead.

    Args:
        module: the LightningModule, already pruned to this rank's stages.
        groups: the tied parameter names (first canonical), from ``ModelSplit.tied``.
        mesh: the (dp, pp, tp) mesh.
        end_ranks: the pp ranks holding the first and the last stage (the schedule's placement: ``(0, pp - 1)``
            for one stage per rank and round-robin interleaving; a CSV action list may place them elsewhere).
    """

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[Sequence[str]],
        mesh: DeviceMesh,
        end_ranks: tuple[int, int] | None = None,
    ) -> None:
        self.group: dist.ProcessGroup | None = None
        self.first = 0
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (canonical, copy), both held here
        self.pair_names: list[str] = []  # each pair's tied names, for messages
        me = dist.get_rank()
        for ranks in embedding_groups(mesh.mesh.tolist(), end_ranks):
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if me in ranks:
                self.group, self.first = group, ranks[0]
        named = dict(module.named_parameters(remove_duplicate=False))
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []  # each of ``params``' tied names, for messages
        self.secondary: set[int] = set()  # the last stage's copies: left out of the gradient norm
        for names in groups:
            present = [n for n in names if n in named]
            if not present:
                continue
            param = named[present[0]]
            self.params.append(param)
            self.names.append(" / ".join(names))
            if names[0] not in named:
                self.secondary.add(id(param))

    @classmethod
    def local(cls, module: nn.Module, groups: Sequence[Sequence[str]]) -> TiedWeights:
        """The tied weights of a rank that holds the first and the last stage, each stage its own copy (after
        :func:`untie`): their gradients are summed here, no process group is created (not a collective call).

        Args:
            module: the LightningModule, already pruned to this rank's stages.
            groups: the untied groups (first name canonical).
        """
        self = cls.__new__(cls)
        self.group, self.first, self.params, self.names, self.secondary, self.pairs = None, 0, [], [], set(), []
        self.pair_names: list[str] = []
        named = dict(module.named_parameters(remove_duplicate=False))
        for names in groups:
            held = [named[n] for n in names if n in named]
            for copy in held[1:]:
                if copy is not held[0]:
                    self.pairs.append((held[0], copy))
                    self.pair_names.append(" / ".join(names))
                    self.secondary.add(id(copy))
        return self

    def check_trainable(self) -> None:
        """Raise (on both ends, "agreed") if the copies of a tied weight disagree on ``requires_grad``.

        On one device the tied modules share one tensor, so freezing either freezes both. Here each end stage
        holds a copy, and ``requires_grad`` changed after setup on one module only (a ``BaseFinetuning`` callback
        unfreezing the head, say) changes one copy: that end would train the weight and the other not, and the
        copies would drift apart without a word. One all-reduce of a flag per weight over the embedding group.
        """
        mixed = [name for (a, b), name in zip(self.pairs, self.pair_names) if a.requires_grad != b.requires_grad]
        if self.group is not None and self.params:
            flags = torch.tensor([float(p.requires_grad) for p in self.params], device=_local(self.params[0]).device)
            counts = torch.stack([flags, 1.0 - flags])  # copies trainable, copies frozen
            dist.all_reduce(counts, group=self.group)
            mixed += [name for name, (on, off) in zip(self.names, counts.T.tolist()) if on > 0 and off > 0]
        if mixed:
            raise mark_agreed(
                RuntimeError(
                    f"lightning_3d: the weight tied as {', '.join(mixed)} is trainable on one pipeline stage and "
                    "frozen on the other. On one device the tied modules share one tensor; here the first and the "
                    "last stage each hold a copy, and requires_grad was changed after setup on a module one stage "
                    "holds (a BaseFinetuning callback freezing or unfreezing one of them, for example): that stage "
                    "would train the weight and the other not. Freeze or unfreeze both modules together, or set "
                    "requires_grad before the Trainer sets the model up (in __init__, configure_model or a "
                    "callback's setup)."
                )
            )

    def broadcast_from_first(self) -> None:
        """Give the last stage's copies the first stage's values (they must start equal)."""
        for canonical, copy in self.pairs:
            assign(copy, canonical)
        if self.group is None:
            return
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(_local(param), src=self.first, group=self.group)

    def sum_grads(self, params: Sequence[nn.Parameter], grads: list[Tensor | None]) -> None:
        """Sum one batch's gradients of the tied weights over the embedding group, in ``grads`` (aligned with
        ``params``): both copies then hold the gradient single-device training computes for the one weight."""
        index = {id(p): i for i, p in enumerate(params)}
        copies: dict[int, list[int]] = {}  # every copy here, by its canonical parameter (all added, then assigned)
        for canonical, copy in self.pairs:
            copies.setdefault(index[id(canonical)], []).append(index[id(copy)])
        for i, others in copies.items():  # the first stage's gradient + the other copies' (an encoder-decoder's
            # embedding is registered under 4 names: the shared one, the encoder's, the decoder's and the head's)
            total = grads[i] if grads[i] is not None else torch.zeros_like(params[i])
            held = [grads[j] if grads[j] is not None else torch.zeros_like(params[j]) for j in others]
            with torch.no_grad():
                for grad in held:
                    if _same_layout(total, grad):
                        _local(total).add_(_local(grad))
                    else:
                        total.add_(_in_layout(grad, total))
            for j, grad in zip(others, held, strict=True):
                assign(grad, total)
                grads[j] = grad
            grads[i] = total
        if self.group is None:
            return
        for param in self.params:
            i = index[id(param)]
            grad = grads[i]
            # in the parameter's layout: DTensor may return a gradient laid out otherwise (a vocabulary-sharded
            # embedding's comes back replicated while the tied head's is sharded), and both ends must reduce
            # the same shard
            grad = torch.zeros_like(param) if grad is None else _in_layout(grad, param)
            grads[i] = grad
            dist.all_reduce(_local(grad), group=self.group)

    def for_norm(self, params: Sequence[Tensor]) -> list[Tensor]:
        """``params`` without the copies the gradient norm must not count twice."""
        return [p for p in params if id(p) not in self.secondary]
