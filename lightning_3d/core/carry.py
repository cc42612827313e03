"""Values that cross pipeline stage boundaries besides the tensor flowing from block to block.

A stage sends the next one the output of its last block (``stage_exec.py``). Many models also hand a later block
something an earlier module made: an encoder-decoder's encoder output, read by every decoder block's
cross-attention; T5's position biases, computed by the first block of each stack and returned to the stack's loop
for the other blocks; a residual from the embedding added after the blocks. Under pipeline parallelism the module
that makes such a value runs on one stage and a later stage needs it. The stage-boundary check
(``boundary_check.py``) finds each such value on fake tensors before any rank communicates: which module's output,
which of its floating-point tensors (its index in the output, in :func:`map_floating`'s order), which stage makes it
and the last stage that reads it. That is a :class:`CarryPlan`. Each boundary then carries, after the flowing
tensor, the values made on or before it and read after it: torch's ``PipelineStage`` sends a stage's tuple of
outputs as the next stage's inputs and returns each one's gradient in the backward. On the later stage the module's
stand-in returns the received value in its place (``stand_ins.py``), so the model's own forward reads it as it
would on one device.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from . import torch_compat


def map_floating(value: Any, fn: Callable[[int, torch.Tensor], Any], depth: int = 3) -> Any:
    """``value`` with its ``i``-th floating-point tensor replaced by ``fn(i, tensor)``.

    A module's output is walked in one fixed order (a tensor; tuples and lists item by item; mappings and
    ``ModelOutput`` objects value by value, their tensor, tuple and list values only), ``depth`` levels deep.
    Tuples, lists and mappings are rebuilt or shallow-copied, never changed: a dict the module also keeps stays its
    own. The index ``i`` is what names one tensor of a module's output in a :class:`CarryPlan`.
    """
    counter = itertools.count()

    def visit(item: Any, left: int) -> Any:
        if isinstance(item, torch.Tensor):
            return fn(next(counter), item) if item.is_floating_point() else item
        if isinstance(item, (tuple, list)) and left:
            items = [visit(v, left - 1) for v in item]
            if isinstance(item, list):
                return items
            return type(item)(*items) if hasattr(item, "_fields") else type(item)(items)
        if isinstance(item, Mapping) and hasattr(item, "__setitem__") and left:
            new = copy.copy(item)
            for key, v in list(item.items()):
                if isinstance(v, (torch.Tensor, tuple, list)):
                    new[key] = visit(v, left - 1)
            return new
        return item

    return visit(value, depth)


@dataclass(frozen=True, order=True)
class Carried:
    """One value a later stage reads: the ``index``-th floating-point tensor of ``module``'s output, made on
    ``stage`` and read up to stage ``last``."""

    stage: int
    order: int  # the module's place in the model (producers sorted by stage, then model order)
    module: str
    index: int
    last: int

    @property
    def key(self) -> tuple[str, int]:
        return self.module, self.index

    def describe(self) -> str:
        return f"{self.module} (output {self.index}) from stage {self.stage} to {self.last}"


@dataclass(frozen=True)
class CarryPlan:
    """What crosses each stage boundary besides the flowing tensor (see the module docstring). The same on every
    rank: it comes from the same check of the same unsplit model."""

    values: tuple[Carried, ...] = ()

    @classmethod
    def merged(cls, *plans: CarryPlan | None) -> CarryPlan:
        """One plan with every value of ``plans``, each read up to the latest stage any of them reads it."""
        last: dict[tuple[str, int], Carried] = {}
        for plan in plans:
            for value in plan.values if plan is not None else ():
                known = last.get(value.key)
                if known is None or value.last > known.last:
                    last[value.key] = value
        return cls(tuple(sorted(last.values())))

    def crossing(self, boundary: int) -> list[Carried]:
        """The values sent from stage ``boundary`` to stage ``boundary + 1`` (made on or before it, read after)."""
        return [v for v in self.values if v.stage <= boundary < v.last]

    def received_by(self, stage: int) -> list[Carried]:
        """The values stage ``stage`` receives after the flowing tensor (in order)."""
        return self.crossing(stage - 1) if stage > 0 else []

    def made_on(self, stage: int) -> dict[str, list[int]]:
        """The modules of ``stage`` whose outputs a later stage reads, with the indices read."""
        made: dict[str, list[int]] = {}
        for value in self.values:
            if value.stage == stage:
                made.setdefault(value.module, []).append(value.index)
        return made

    def of_module(self, module: str) -> list[int]:
        """The indices of ``module``'s output that cross a boundary."""
        return [v.index for v in self.values if v.module == module]

    def describe(self) -> str:
        """One line per value, for the log."""
        return "; ".join(v.describe() for v in self.values)


def settled(value: torch.Tensor) -> torch.Tensor:
    """``value`` with any pending tensor-parallel reduction done: a DTensor with partial placements (a vocabulary-
    parallel embedding's output) redistributed to replicated there, else ``value`` itself. A carried output is
    settled where its module returns it, so its one reduction happens once (torch's masked partial of an embedding
    keeps its mask for one reduction only) and both the next module and the later stage read the reduced value."""
    if not isinstance(value, DTensor) or not any(p.is_partial() for p in value.placements):
        return value
    return value.redistribute(value.device_mesh, [Replicate() if p.is_partial() else p for p in value.placements])


def sendable(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a stage sends it: a plain tensor (a tensor-parallel DTensor, such as a vocabulary-parallel
    embedding's output before its reduction, crosses as its full value, gathered over the tp ranks, who all run this;
    the gradient flows back through the gather), contiguous (the process group sends it as it is, and a position bias
    is often an expanded view), and not a view (torch's split backward detaches each stage output in place, which a
    view refuses); a copy only when it is either."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if value.is_contiguous() and not torch_compat.is_view(value):
        return value
    return value.clone(memory_format=torch.contiguous_format)


def passed_on(value: torch.Tensor) -> torch.Tensor:
    """A received value a stage sends on unchanged: a copy with its own autograd node (the received tensor itself
    would be detached in place by torch's split backward), whose gradient flows back to the received tensor like
    any output's."""
    return value.clone() if value.requires_grad else value
