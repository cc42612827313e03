"""Gradients grouped for one fused pass per group: by pipeline stage, device and dtype.

The non-finite scan (``reliability.py``) checks every gradient of a step with one fused kernel per group (torch's
multi-tensor kernels take tensors of one device and dtype) and reports one flag per pipeline stage. Which parameter
falls into which group is fixed once the stages are built (a parameter's stage, device and dtype do not change, and
torch requires a ``.grad`` to have its parameter's device and dtype), so the grouping is planned once per parameter
list and each step only picks the gradients out by index: no per-parameter dictionary work on the step's path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import torch_compat

GroupKey = tuple[int, torch.device, torch.dtype]
"""Gradients scanned together: (pipeline stage, device, dtype)."""

Groups = dict[GroupKey, tuple[list[Tensor], list[Tensor]]]
"""Per group: the gradients as held (DTensors stay DTensors) and their local tensors (the storage itself)."""


@dataclass(frozen=True)
class _Plan:
    params: Sequence[torch.nn.Parameter]  # the list the plan was made for (compared by identity)
    size: int
    groups: tuple[tuple[GroupKey, list[int], bool], ...]  # key, parameter indices, whether any is a DTensor


class GradGrouper:
    """Groups a step's gradients by (stage, device, dtype), planned once per parameter list.

    Args:
        stage_of: ``id(parameter) -> pipeline stage``; a parameter not in it counts to ``default_stage``.
        default_stage: the stage of parameters outside ``stage_of`` (the last stage).
    """

    def __init__(self, stage_of: Mapping[int, int], default_stage: int) -> None:
        self._stage_of = stage_of
        self._default_stage = default_stage
        self._plan: _Plan | None = None

    def group(self, params: Sequence[torch.nn.Parameter], grads: Sequence[Tensor | None]) -> Groups:
        """The gradients (``grads[i]`` belongs to ``params[i]``; ``None`` entries are left out), grouped.

        Groups appear in the order of their first parameter, each with its gradients in parameter order.
        """
        plan = self._plan
        if plan is None or plan.params is not params or plan.size != len(params):
            plan = self._plan = self._make_plan(params)
        out: Groups = {}
        for key, indices, distributed in plan.groups:
            held = [g for i in indices if (g := grads[i]) is not None]
            if held:
                out[key] = (held, [torch_compat.local_tensor(g) for g in held] if distributed else held)
        return out

    def _make_plan(self, params: Sequence[torch.nn.Parameter]) -> _Plan:
        by_key: dict[GroupKey, tuple[list[int], list[bool]]] = {}  # indices, and whether any is a DTensor
        for i, p in enumerate(params):
            local = torch_compat.local_tensor(p)
            key = (self._stage_of.get(id(p), self._default_stage), local.device, local.dtype)
            indices, distributed = by_key.setdefault(key, ([], [False]))
            indices.append(i)
            distributed[0] |= local is not p
        groups = tuple((key, indices, distributed[0]) for key, (indices, distributed) in by_key.items())
        return _Plan(params, len(params), groups)
