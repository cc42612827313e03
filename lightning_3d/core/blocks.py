"""Finding a model's repeated blocks and deciding which modules each pipeline stage holds.

A model is split at its **block container**: the ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` whose
children are the repeated blocks (``model.layers`` of a Hugging Face Llama, ``transformer.h`` of GPT-2 or nanoGPT).
It is found, in this order:

1. named by the user (``ThreeDStrategy(blocks="model.model.layers")``);
2. declared by a Hugging Face model (``config.base_model_pp_plan``: the entry whose module is a container);
3. the container that holds the most parameters (an ``nn.Sequential``, or a list / dict of same-type blocks).

Every other module that owns parameters is assigned by where it sits relative to the container: modules
the forward runs before it (embeddings) go with the first stage, modules it runs after it (final norm, head) with
the last stage. Registration order tells which, unless one forward on fake tensors shows a module registered
before the container called after it (``block_calls.first_calls``: OPT's final norm); the user may also
list the modules of every stage (``ThreeDStrategy(stages=[[...], [...]])``, checked by
:func:`stage_ranges_from_names`). Modules without parameters (dropout, rotary tables) stay on every stage, so the
model's own forward can run unchanged everywhere. Parameters shared by modules on different stages
(an LM head tied to the input embedding) are reported in ``tied`` so the caller can keep their copies equal.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from torch import nn

from . import torch_compat

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

BLOCKS_CONTRACT = (
    "Under pipeline parallelism lightning_3d splits the model at its repeated blocks: a container "
    "(nn.ModuleList, nn.ModuleDict or nn.Sequential) of blocks that pass one tensor from block to block, such as "
    "`self.layers = nn.ModuleList(Block(...) for _ in range(n))` used as `for block in self.layers: x = block(x, ...)`."
)


@dataclass(frozen=True)
class BlockContainer:
    """Where the blocks live: ``fqn`` is the container's name in the root module; ``names`` its children's keys."""

    fqn: str
    module: nn.Module
    names: tuple[str, ...]
    source: str  # "named", "hugging face pp plan" or "largest container"

    def block_fqn(self, name: str) -> str:
        return f"{self.fqn}.{name}" if self.fqn else name


@dataclass
class ModelSplit:
    """Which modules each pipeline stage holds.

    Attributes:
        container: the block container.
        stage_blocks: per stage, the container keys of its blocks (contiguous, in order).
        first: fully qualified names of the modules outside the container run before it (held by the first stage
            unless ``placement`` says otherwise).
        last: ... run after it (held by the last stage unless ``placement`` says otherwise).
        stage_to_rank: pipeline rank of each stage.
        tied: groups of parameter names that are one tensor held on different stages (first name canonical).
        aliases: every group of names under which one parameter is registered (first name canonical), on one
            stage or several: checkpoints and state dicts name each such parameter once.
        placement: outside modules the user put on a stage of their choice (``stages=``), by name.
    """

    container: BlockContainer | None  # None: one stage holding the whole model (pp = 1, no container)
    stage_blocks: list[list[str]]
    first: list[str]
    last: list[str]
    stage_to_rank: list[int]
    tied: list[tuple[str, ...]] = field(default_factory=list)
    aliases: list[tuple[str, ...]] = field(default_factory=list)
    placement: dict[str, int] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def stage_of(self, name: str) -> int:
        """The stage holding the outside module or block ``name``."""
        if name in self.placement:
            return self.placement[name]
        if name in self.first:
            return 0
        if name in self.last:
            return self.num_stages - 1
        assert self.container is not None, name
        key = name[len(self.container.fqn) + 1 :] if self.container.fqn else name
        return next(s for s, blocks in enumerate(self.stage_blocks) if key in blocks)

    def modules_of(self, stage: int) -> list[str]:
        """Names of the modules stage ``stage`` holds (outside modules and blocks), in model order."""
        names = [n for n in self.first if self.stage_of(n) == stage]
        if self.container is not None:
            names += [self.container.block_fqn(b) for b in self.stage_blocks[stage]]
        return names + [n for n in self.last if self.stage_of(n) == stage]

    def describe(self, estimates: Sequence[str] = ()) -> str:
        """One line per stage (its pp rank, blocks and the modules before / after them), each stage's
        ``estimates`` entry (the compute / memory partitioner's cost) in brackets when given, then the ties."""
        if self.container is None:
            return "  stage 0: the whole model (no block container; pp = 1)"
        lines = []
        for stage, blocks in enumerate(self.stage_blocks):
            parts = []
            before = [n for n in self.first if self.stage_of(n) == stage]
            if before:
                parts.append(", ".join(before))
            shown = f"{blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else blocks[0]
            parts.append(f"{self.container.fqn}[{shown}] ({self.container.source})")
            after = [n for n in self.last if self.stage_of(n) == stage]
            if after:
                parts.append(", ".join(after))
            rank = f" on pp rank {self.stage_to_rank[stage]}" if self.stage_to_rank else ""
            estimate = f" ({estimates[stage]})" if estimates else ""
            lines.append(f"  stage {stage}{rank}: " + " + ".join(parts) + estimate)
        for group in self.tied:
            lines.append(f"  tied across stages: {' = '.join(group)} (gradients summed over first and last stage)")
        return "\n".join(lines)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _hf_container(root: nn.Module) -> str | None:
    """The block container a Hugging Face model declares in ``config.base_model_pp_plan``."""
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        plan = getattr(config, "base_model_pp_plan", None) if config is not None else None
        if not plan or not hasattr(module, "base_model_prefix"):
            continue
        base = getattr(module, module.base_model_prefix, module) if module.base_model_prefix else module
        base_name = name
        if base is not module:
            base_name = f"{name}.{module.base_model_prefix}" if name else module.base_model_prefix
        for key in plan:
            sub = getattr(base, key, None)
            if isinstance(sub, CONTAINERS) and len(sub) > 0:
                return f"{base_name}.{key}" if base_name else key
    return None


def _largest_container(root: nn.Module) -> str | None:
    best, best_size = None, 0
    for name, module in root.named_modules():
        if not isinstance(module, CONTAINERS) or len(module) < 2:
            continue
        children = list(module.children())
        # a Sequential is a chain of layers whatever their types; a list or dict of blocks is one block type
        if len(children) != len(module) or (
            not isinstance(module, nn.Sequential) and len({type(c) for c in children}) != 1
        ):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = name, size
    return best


def find_blocks(root: nn.Module, name: str | None = None) -> BlockContainer:
    """Locate the block container of ``root`` (see the module docstring for the order of the searches).

    Raises:
        ValueError: ``name`` is not a container, or no container was found (naming what was searched).
    """
    source = "named"
    if name is None:
        name, source = _hf_container(root), "hugging face pp plan"
        if name is None:
            name, source = _largest_container(root), "largest container"
        if name is None:
            raise ValueError(
                f"{type(root).__name__} has no block container to split into pipeline stages: searched for a Hugging "
                "Face `config.base_model_pp_plan`, an nn.Sequential of at least two layers and an nn.ModuleList / "
                "nn.ModuleDict of at least two blocks of one type. Name it with "
                f"ThreeDStrategy(blocks='attribute.path'), or use pp=1. {BLOCKS_CONTRACT}"
            )
    try:
        module = root.get_submodule(name)
    except AttributeError:
        raise ValueError(f"ThreeDStrategy(blocks={name!r}): the module has no submodule {name!r}.") from None
    if not isinstance(module, CONTAINERS):
        raise ValueError(
            f"ThreeDStrategy(blocks={name!r}): {name!r} is a {type(module).__name__}, not an nn.ModuleList, "
            f"nn.ModuleDict or nn.Sequential. {BLOCKS_CONTRACT}"
        )
    names = tuple(torch_compat.child_modules(module))
    if not names:
        raise ValueError(f"The block container {name!r} is empty. {BLOCKS_CONTRACT}")
    return BlockContainer(name, module, names, source)


def outside_modules(
    root: nn.Module, container: BlockContainer, called_after: Collection[str] = (), called_before: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """Modules with parameters outside the container, as (before, after) it.

    Walks from the root down the path to the container: at each level, siblings registered before the path go
    first, siblings after it go last. A sibling without parameters is on every stage and listed in neither.
    ``called_after``: modules registered before the container that the forward calls after it
    (``block_calls.first_calls``); they go last, ahead of the ones registered after it. ``called_before``:
    modules registered after the container that the forward calls before it (``block_calls.first_calls``);
    they go first, after the ones registered before it.
    """
    before: list[str] = []
    after_levels: list[list[str]] = []  # per level: a deeper level's modules run first after the blocks
    parts = container.fqn.split(".") if container.fqn else []
    module, prefix = root, ""
    if next(root.parameters(recurse=False), None) is not None:
        raise ValueError(
            f"{type(root).__name__} owns parameters directly ({[n for n, _ in root.named_parameters(recurse=False)]}); "
            "under pipeline parallelism every parameter must belong to a submodule that one stage holds."
        )
    for part in parts:
        seen_path = False
        after: list[str] = []
        after_levels.insert(0, after)
        for child_name, child in torch_compat.child_modules(module).items():
            if child is None:
                continue
            full = f"{prefix}{child_name}"
            if child_name == part:
                seen_path = True
                continue
            if _has_params(child):
                (after if seen_path else before).append(full)
        module = torch_compat.child_modules(module)[part]
        if next(module.parameters(recurse=False), None) is not None and module is not container.module:
            raise ValueError(
                f"{prefix}{part} owns parameters directly and contains the block container {container.fqn!r}: they "
                "would be on no stage. Move them into a submodule."
            )
        prefix = f"{prefix}{part}."
    moved = [name for name in before if name in called_after]
    after = [name for level in after_levels for name in level]
    early = [name for name in after if name in called_before]
    first = [name for name in before if name not in moved] + early
    return first, moved + [name for name in after if name not in early]


def tied_parameters(root: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names under which one parameter is registered more than once (first name canonical)."""
    groups: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def layer_drop(root: nn.Module) -> list[tuple[str, float]]:
    """The modules of ``root`` that skip their blocks at random while training (LayerDrop, as Hugging Face's
    encoders and decoders do: ``if self.training and torch.rand([]) < self.layerdrop: skip the layer``), with their
    ``layerdrop`` probability; empty when none does. A stage runs whichever of its blocks the model calls
    (``stage_exec``); the stage-boundary check turns it off to see every block (``boundary_check``)."""
    found = []
    for name, module in root.named_modules():
        rate = getattr(module, "layerdrop", None)
        if isinstance(rate, float) and rate > 0:
            found.append((name, rate))
    return found


def split_model(
    root: nn.Module,
    container: BlockContainer,
    pp: int,
    ranges: Sequence[range],
    stages_per_rank: int = 1,
    placement: dict[str, int] | None = None,
    called_after: Collection[str] = (),
    called_before: Collection[str] = (),
) -> ModelSplit:
    """Assign blocks to ``pp * stages_per_rank`` stages by ``ranges`` (indices into ``container.names``), and the
    outside modules to the first / last stage (``called_after``, ``called_before``: see :func:`outside_modules`),
    or to the stage ``placement`` names (see :func:`stage_ranges_from_names`)."""
    num_stages = pp * stages_per_rank
    before, after = outside_modules(root, container, called_after, called_before)
    stage_blocks = [[container.names[i] for i in r] for r in ranges]
    stage_to_rank = [s % pp for s in range(num_stages)]
    split = ModelSplit(container, stage_blocks, before, after, stage_to_rank, placement=dict(placement or {}))
    owner: dict[str, set[int]] = {}
    for stage in range(num_stages):
        for fqn in split.modules_of(stage):
            for pname, _ in root.get_submodule(fqn).named_parameters(prefix=fqn, remove_duplicate=False):
                owner.setdefault(pname, set()).add(stage)
    split.aliases = tied_parameters(root)
    for group in split.aliases:
        stages = set().union(*(owner.get(n, set()) for n in group))
        if len(stages) > 1:
            ends = {0, num_stages - 1}
            if not stages <= ends:
                raise ValueError(
                    f"The parameter {' = '.join(group)} is shared by modules on pipeline stages {sorted(stages)}: "
                    "only weights tied between the first and the last stage (input embedding and LM head) are "
                    "supported across stages."
                )
            split.tied.append(group)
    return split


def stage_ranges_from_names(
    root: nn.Module, container: BlockContainer, stages: Sequence[Sequence[str]], num_stages: int
) -> tuple[list[range], dict[str, int]]:
    """Check the user's per-stage module lists (``ThreeDStrategy(stages=...)``) and turn them into block ranges.

    Args:
        root: the LightningModule (names are relative to it).
        container: the block container.
        stages: one list of module names per pipeline stage: blocks by their container-qualified names
            (``model.layers.3``), and optionally modules outside the blocks (an embedding, the final norm, the head)
            to put them on a stage other than the default (first stage before the blocks, last stage after).
        num_stages: ``pp * stages_per_rank``.

    Returns:
        The block indices of each stage and the stage of every outside module named.

    Raises:
        ValueError: wrong number of lists, an unknown name (close names suggested), a block named twice or not
            at all, a stage without a block, or blocks not contiguous and in order.
    """
    where = "ThreeDStrategy(stages=...)"
    if len(stages) != num_stages:
        raise ValueError(
            f"{where} has {len(stages)} lists but there are {num_stages} pipeline stages (pp x stages_per_rank): give "
            "one list of module names per stage."
        )
    block_index = {container.block_fqn(b): i for i, b in enumerate(container.names)}
    before, after = outside_modules(root, container)
    outside = set(before) | set(after)
    placeable = [*before, *block_index, *after]
    seen: dict[str, int] = {}
    placement: dict[str, int] = {}
    per_stage: list[list[int]] = []
    for stage, names in enumerate(stages):
        indices = []
        for name in names:
            if name in seen:
                other = f"stage {seen[name]}" + (" and again" if seen[name] == stage else f" and stage {stage}")
                raise ValueError(f"{where} names {name!r} twice ({other}): every module is on one stage.")
            seen[name] = stage
            if name in block_index:
                indices.append(block_index[name])
            elif name in outside:
                placement[name] = stage
            else:
                raise ValueError(_unknown_name(root, container, name, placeable))
        if not indices:
            raise ValueError(
                f"{where}: stage {stage} holds no block of {container.fqn!r} ({list(names)}); every stage needs at "
                "least one block."
            )
        per_stage.append(indices)
    missing = [name for name in block_index if name not in seen]
    if missing:
        raise ValueError(
            f"{where} leaves out {_shown(missing)} of {container.fqn!r}: every block must be named, on one stage."
        )
    flat = [i for indices in per_stage for i in indices]
    if flat != list(range(len(container.names))):
        shown = "; ".join(
            f"stage {s}: {_shown([container.block_fqn(container.names[i]) for i in ix])}"
            for s, ix in enumerate(per_stage)
        )
        raise ValueError(
            f"{where}: the blocks of {container.fqn!r} must be contiguous and in order over the stages (the "
            f"activation flows from block to block, stage to stage); got {shown}."
        )
    ranges = [range(ix[0], ix[-1] + 1) for ix in per_stage]
    return ranges, placement


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]} ({len(names)} modules)"


def _unknown_name(root: nn.Module, container: BlockContainer, name: str, placeable: Sequence[str]) -> str:
    where = f"ThreeDStrategy(stages=...) names {name!r}"
    try:
        module = root.get_submodule(name)
    except AttributeError:
        module = None
    if module is None:
        why = "which is not a module of the LightningModule"
    elif name.startswith(f"{container.fqn}.") or not container.fqn:
        why = f"which is inside a block of {container.fqn!r}: a stage holds whole blocks"
    elif not _has_params(module):
        why = "which has no parameters: such modules run on every stage; leave it out"
    else:
        why = (
            f"which contains the block container {container.fqn!r} or is not beside it; name the blocks and the "
            "modules around them one by one"
        )
    close = difflib.get_close_matches(name, placeable, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"{where}, {why}.{hint} Names are relative to the LightningModule: the blocks of {container.fqn!r} "
        f"({_shown([container.block_fqn(b) for b in container.names])}) and the modules with parameters around them."
    )


def sequential_blocks(layers: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks among an ``nn.Sequential`` body's layers: those of a class of the user's (not ``torch.nn``'s)
    that occurs more than once and has parameters, as the transformer blocks between an embedding and a head.

    The layers around the blocks (embedding, head) stay eager, as torchtitan leaves them: a vocabulary-parallel
    or gathered head returns DTensors from hooks that compiled code handles badly, and they run once per step.
    """
    counts: dict[type, int] = {}
    for _, layer in layers:
        counts[type(layer)] = counts.get(type(layer), 0) + 1
    return [
        (name, layer)
        for name, layer in layers
        if counts[type(layer)] > 1
        and not type(layer).__module__.startswith("torch.")
        and any(True for _ in layer.parameters())
    ]
