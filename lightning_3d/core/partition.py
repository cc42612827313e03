"""Finding the model body and splitting it into pipeline stages.

The user contract: the LightningModule holds its model body as ONE ``nn.Sequential`` (embedding first, head
last) and ``forward`` applies it. This module finds that body, checks that no parameter lives outside it,
assigns its layers to stages with a pluggable partitioner, and prunes a rank's copy of the body down to the
layers of the stages it owns. Pruning removes entries from the Sequential's registry of children instead of building
a new Sequential, so every kept layer keeps the name it had in the unsplit model (``body.7.attn.q_proj``):
checkpoint keys never depend on the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from . import pieces, torch_compat
from .balance import ComputePartitioner, MemoryPartitioner, rank_balanced

CONTRACT = (
    "lightning_3d needs the model body as ONE nn.Sequential attribute of the LightningModule (embedding layer "
    "first, head last) that forward() applies, e.g. `self.body = nn.Sequential(embed, *blocks, head)` and "
    "`def forward(self, x): return self.body(x)`."
)


@dataclass
class BodyRef:
    """Where the body lives: ``parent.<attr>`` is the Sequential, ``fqn`` its name in the LightningModule."""

    parent: nn.Module
    attr: str
    fqn: str
    module: nn.Sequential


def find_body(root: nn.Module, name: str | None = None) -> BodyRef:
    """Locate the ``nn.Sequential`` body of ``root``.

    Args:
        root: the LightningModule.
        name: dotted attribute path of the body; ``None`` finds the single outermost Sequential.

    Raises:
        ValueError: no Sequential, several candidates, or ``name`` is not a Sequential.
    """
    if name is not None:
        try:
            module = root.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"ThreeDStrategy(body={name!r}): the module has no submodule {name!r}. {CONTRACT}"
            ) from None
        if not isinstance(module, nn.Sequential):
            raise ValueError(
                f"ThreeDStrategy(body={name!r}): {name!r} is a {type(module).__name__}, not an nn.Sequential. "
                f"{CONTRACT}"
            )
        candidates = [name]
    else:
        sequentials = [n for n, m in root.named_modules() if n and isinstance(m, nn.Sequential)]
        candidates = [n for n in sequentials if not any(n.startswith(o + ".") for o in sequentials if o != n)]
        if not candidates:
            raise ValueError(f"{type(root).__name__} has no nn.Sequential submodule. {CONTRACT}")
        if len(candidates) > 1:
            raise ValueError(
                f"{type(root).__name__} has several nn.Sequential submodules ({', '.join(candidates)}); say which one "
                f"is the body with ThreeDStrategy(body='...'). {CONTRACT}"
            )
    fqn = candidates[0]
    parent_name, _, attr = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    module = getattr(parent, attr)
    if len(module) == 0:
        raise ValueError(f"The body {fqn!r} is an empty nn.Sequential. {CONTRACT}")
    return BodyRef(parent=parent, attr=attr, fqn=fqn, module=module)


def check_no_outside_parameters(root: nn.Module, body: BodyRef) -> None:
    """Refuse parameters outside the body: they would be on no stage and never be trained."""
    prefix = body.fqn + "."
    outside = [n for n, _ in root.named_parameters() if not n.startswith(prefix)]
    if outside:
        shown = ", ".join(outside[:8]) + (" ..." if len(outside) > 8 else "")
        raise ValueError(
            f"Parameters outside the body {body.fqn!r}: {shown}. Under pipeline parallelism only the body is split "
            f"into stages; move these layers into the nn.Sequential. {CONTRACT}"
        )


class Partitioner(Protocol):
    """A policy that assigns the body's layers to stages: contiguous, non-empty ranges in order."""

    def __call__(self, layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]: ...


def _units(layers: Sequence[tuple[str, nn.Module]]) -> list[list[int]]:
    """Group layers into units: each parameter-free layer (an activation, dropout) joins the layer before it
    (or, at the start, the one after it), so that no stage is left without parameters to train."""
    units: list[list[int]] = []
    pending: list[int] = []
    for i, (_, module) in enumerate(layers):
        has_params = any(True for _ in module.parameters())
        if has_params:
            units.append([*pending, i])
            pending = []
        elif units:
            units[-1].append(i)
        else:
            pending.append(i)
    if pending:  # no layer has parameters at all
        units.append(pending)
    return units


class UniformPartitioner:
    """Equal numbers of layers per stage (the first ``layers % stages`` stages take one more).

    Layers without parameters (activations, dropout) are not counted: they stay with the layer before them.
    """

    def __call__(self, layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        units = _units(layers)
        if len(units) < num_stages:
            raise ValueError(
                f"The body has {len(units)} layers with parameters ({len(layers)} entries) but {num_stages} pipeline "
                f"stages were asked for: every stage needs at least one layer with parameters. Use pp <= {len(units)}."
            )
        base, extra = divmod(len(units), num_stages)
        ranges, start = [], 0
        for stage in range(num_stages):
            size = base + (1 if stage < extra else 0)
            members = [i for unit in units[start : start + size] for i in unit]
            ranges.append(range(members[0], members[-1] + 1))
            start += size
        return ranges


class ParameterPartitioner:
    """Balance stages by parameter count (greedy, contiguous); a policy for uneven layers.

    Args:
        first: parameters the first stage holds besides its layers (a model split at its blocks: the embeddings,
            an encoder-decoder's whole encoder); counted towards its share.
        last: the same for the last stage (final norm, head).
    """

    def __init__(self, first: int = 0, last: int = 0) -> None:
        self.first, self.last = first, last

    def __call__(self, layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        sizes = [sum(p.numel() for p in m.parameters()) or 1 for _, m in layers]
        ranges, start, remaining = [], 0, float(sum(sizes) + self.first + self.last)
        for stage in range(num_stages):
            stages_left = num_stages - stage
            if stages_left == 1:
                ranges.append(range(start, len(layers)))
                break
            acc = float(self.first) if stage == 0 else 0.0
            target, end = remaining / stages_left, start
            # leave at least one layer for every later stage
            while end < len(layers) - (stages_left - 1) and (end == start or acc + sizes[end] / 2 <= target):
                acc += sizes[end]
                end += 1
            ranges.append(range(start, end))
            remaining -= acc
            start = end
        return ranges


PARTITIONERS: dict[str, type] = {
    "uniform": UniformPartitioner,
    "parameters": ParameterPartitioner,
    "compute": ComputePartitioner,
    "memory": MemoryPartitioner,
}


def get_partitioner(spec: str | Partitioner) -> Partitioner:
    if callable(spec) and not isinstance(spec, str):
        return spec
    try:
        return PARTITIONERS[spec]()
    except KeyError:
        raise ValueError(
            f"Unknown partitioner {spec!r}; choose one of {sorted(PARTITIONERS)} or pass a callable."
        ) from None


@dataclass
class StagePlan:
    """Which layers (by their names in the body) make up each pipeline stage."""

    layer_names: list[list[str]]
    body_fqn: str = "body"
    stage_to_rank: list[int] = field(default_factory=list)
    estimates: list[str] = field(default_factory=list)  # each stage's cost under the partitioner (when it has one)
    costs: list[float] = field(default_factory=list)  # the same costs as numbers (seconds, FLOPs or bytes)
    shown: dict[str, str] = field(default_factory=dict)  # how the layout names a part of a layer (``pieces.py``)

    def predicted_imbalance(self) -> float | None:
        """The busiest pp rank's cost (its stages together) over the mean rank's, from the partitioner's
        estimates; ``None`` without estimates."""
        if not self.costs:
            return None
        ranks = self.stage_to_rank or list(range(self.num_stages))
        per_rank: dict[int, float] = {}
        for cost, rank in zip(self.costs, ranks):
            per_rank[rank] = per_rank.get(rank, 0.0) + cost
        mean = sum(per_rank.values()) / len(per_rank)
        return max(per_rank.values()) / mean if mean > 0 else None

    @property
    def num_stages(self) -> int:
        return len(self.layer_names)

    def describe(self) -> str:
        """One line per stage: its index, its pp rank and the names of its layers in the body."""
        lines = []
        for index, names in enumerate(self.layer_names):
            rank = f" on pp rank {self.stage_to_rank[index]}" if self.stage_to_rank else ""
            estimate = f" ({self.estimates[index]})" if self.estimates else ""
            held = ", ".join(self.shown.get(n, n) for n in names)
            lines.append(f"  stage {index}{rank}: {self.body_fqn}[{held}]{estimate}")
        return "\n".join(lines)


def checked_ranges(
    partitioner: Partitioner, layers: Sequence[tuple[str, nn.Module]], num_stages: int, what: str = "layers"
) -> list[range]:
    """The partitioner's ranges for ``layers``, checked: ``num_stages`` contiguous non-empty ranges in order."""
    ranges = partitioner(layers, num_stages)
    flat = [i for r in ranges for i in r]
    if len(ranges) != num_stages or flat != list(range(len(layers))) or any(len(r) == 0 for r in ranges):
        raise ValueError(
            f"Partitioner {partitioner!r} returned {ranges}: expected {num_stages} contiguous non-empty ranges "
            f"covering {what} 0..{len(layers) - 1} in order."
        )
    return list(ranges)


def plan_stages(
    body: BodyRef,
    pp: int,
    partitioner: Partitioner,
    stages_per_rank: int = 1,
    placement: Sequence[int] | None = None,
    example: object = None,
    keep_whole: Sequence[str] = (),
) -> StagePlan:
    """Split ``body`` into ``pp * stages_per_rank`` stages; stage ``s`` runs on pp rank ``placement[s]`` (default
    ``s % pp``, looping; a V schedule's placement comes from ``pipeline.stage_ranks``).

    A partitioner with ``split_layers = True`` (the compute partitioner) is given the layers already cut where one
    tensor crosses (``pieces.py``; checked on ``example``'s meta shapes, and never the layers in ``keep_whole``), and a
    stage may then hold part of a layer (``"5#0-1"``)."""
    layers = list(body.module.named_children())
    num_stages = pp * stages_per_rank
    if len(layers) < num_stages:
        raise ValueError(
            f"The body {body.fqn!r} has {len(layers)} layers but {num_stages} pipeline stages were asked for "
            f"(pp={pp}{f' x {stages_per_rank} stages per rank' if stages_per_rank > 1 else ''}): every stage needs "
            f"at least one layer. Use pp <= {len(layers) // stages_per_rank}, or split the model into more layers."
        )
    if getattr(partitioner, "split_layers", False):
        layers = pieces.cut_layers(layers, example, keep_whole)
    ranges = checked_ranges(partitioner, layers, num_stages)
    ranks = list(placement) if placement is not None else [s % pp for s in range(num_stages)]
    costs: list[float] = []
    if isinstance(partitioner, (ComputePartitioner, MemoryPartitioner)):
        ranges = rank_balanced(partitioner, layers, ranges, ranks)  # a rank's stages together, when it has several
        costs = partitioner.stage_costs(layers, ranges)
    names = pieces.stage_names(layers, ranges)
    parts = pieces.build_parts(body.module, [n for stage in names for n in stage])
    shown = {n: pieces.describe(n, m) for n, m in parts.items()}
    estimates = [partitioner.describe(c, stage) for stage, c in enumerate(costs)]
    return StagePlan(names, body.fqn, ranks, estimates, costs, shown)


class OnAnotherStage(nn.Module):
    """Stands in, inside the body, for a layer that another pipeline rank holds (no parameters, no buffers).

    The body keeps its length and every layer its position, so single-device code that indexes it reads what it
    reads in the unsplit model: ``self.body[0].parameters()`` in ``configure_optimizers`` (a learning rate of the
    embedding's own) is empty on a rank that does not hold layer 0, never another layer, and ``len(self.body)``
    is unchanged. Training runs the stages' own containers, so it is never called; calling it raises.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.layer_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"lightning_3d: {self.layer_name} is held by another pipeline stage; under pipeline parallelism the "
            "body runs stage by stage, not as a whole on one rank."
        )

    def extra_repr(self) -> str:
        return self.layer_name


def prune_body(body: BodyRef, keep: Sequence[str]) -> None:
    """Replace every layer of the body that is not in ``keep`` by an :class:`OnAnotherStage` (its parameters are
    freed); kept layers keep their names and positions."""
    keep_set = set(keep)
    children = torch_compat.child_modules(body.module)
    prefix = f"{body.fqn}." if body.fqn else ""
    for name in list(children):
        if name not in keep_set:
            children[name] = OnAnotherStage(f"{prefix}{name}")


def stage_container(body: BodyRef, names: Sequence[str], parts: dict[str, nn.Module] | None = None) -> nn.Sequential:
    """A Sequential holding the given layers of the body under their original names (shared modules); a part of a
    layer (``"5#0-1"``) is its piece module (from ``parts``, else traced from the body), under the layer's name."""
    container = nn.Sequential()
    children = torch_compat.child_modules(body.module)
    for name in names:
        layer = pieces.layer_of(name)
        if layer == name:
            module = children[name]
        else:
            given = (parts or {}).get(name)
            module = given if given is not None else pieces.build_parts(body.module, [name])[name]
        torch_compat.child_modules(container)[layer] = module
    return container


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


def full_model_spec(root: nn.Module) -> dict[str, TensorSpec]:
    """Shapes and dtypes of every parameter and persistent buffer of the unsplit model (meta-safe)."""
    spec = {n: TensorSpec(tuple(p.shape), p.dtype, True) for n, p in root.named_parameters()}
    state_keys = set(root.state_dict(keep_vars=True).keys())
    for n, b in root.named_buffers():
        if n in state_keys:
            spec[n] = TensorSpec(tuple(b.shape), b.dtype, False)
    return spec
