"""Propagate "this tensor would be sharded" through the operations of one forward pass.

A :class:`~lightning_3d.core.tensor_parallel.rules.Tag` marks a tensor that is derived from the output
of column-wise candidate Linears (``srcs``) and says which of its dimensions would be sharded
under tensor parallelism. The :class:`FlowMode` (a ``TorchFunctionMode``) sees every torch call of
the forward pass and asks :mod:`~lightning_3d.core.tensor_parallel.rules` how the tags of the inputs
map to the outputs. An operation that mixes or reduces the sharded dimension, or that the rules do
not know, is refused: the Linears in ``srcs`` are then recorded as unshardable with that reason.
Replicated is always correct; a wrong shard is a silent numerical bug, so unknown means refuse."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_3d.core.tensor_parallel.rules import (
    BENIGN,
    NO_GRAD,
    SELF_ONLY,
    UNARY,
    Refuse,
    Tag,
    apply_rule,
    op_name,
    tensors_in,
)


def user_location() -> str:
    """``file:line`` of the innermost caller outside torch and this package (for messages)."""
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((here, torch_dir)) and "contextlib" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class FlowState:
    """Everything one traced forward pass learned about the data flow between Linears.

    Tags are keyed by ``id(tensor)``; ``_keep`` holds a reference to every tagged tensor so that
    ids are not reused during the pass. ``watch`` maps the ids of candidate modules' parameters to
    the module; ``direct`` records modules whose parameters are used outside their own forward.
    """

    tags: dict[int, Tag] = field(default_factory=dict)
    grad: set[int] = field(default_factory=set)
    parent: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    splits: dict[str, set[int]] = field(default_factory=dict)
    attention: set[str] = field(default_factory=set)
    events: list[tuple[str, list[tuple[int, ...]], list[Tag | None]]] = field(default_factory=list)
    watch: dict[int, str] = field(default_factory=dict)
    direct: dict[str, str] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    inplace: dict[str, str] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)  # parameters of modules that are not candidates, by id
    casts: dict[int, str] = field(default_factory=dict)  # tensors that are such a parameter, cast or copied
    summed: dict[str, set[str]] = field(default_factory=dict)  # parameter -> sharded groups whose tensors it meets
    full_uses: dict[str, str] = field(default_factory=dict)  # parameter -> an operation it takes part in unsharded
    passthrough: int = 0
    _keep: list[torch.Tensor] = field(default_factory=list)

    # -- groups (union-find over Linear names) ---------------------------------------------
    def find(self, name: str) -> str:
        """Representative of the group of Linear ``name``."""
        root = name
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        self.parent[name] = root
        return root

    def union(self, names: Iterable[str]) -> None:
        """Put all ``names`` in one group: they must be sharded together or not at all."""
        roots = [self.find(n) for n in names]
        for r in roots[1:]:
            self.parent[r] = roots[0]

    def refuse(self, srcs: Iterable[str], reason: str) -> None:
        """Record that the groups of ``srcs`` cannot be sharded (first reason wins)."""
        for s in srcs:
            self.reasons.setdefault(s, reason)

    # -- tensors ---------------------------------------------------------------------------
    def tag_of(self, t: torch.Tensor) -> Tag | None:
        """Tag of ``t``, or None when ``t`` would be replicated (full) on every rank."""
        return self.tags.get(id(t))

    def set_tag(self, t: torch.Tensor, tag: Tag | None, grad: bool) -> None:
        """Attach ``tag`` (or none) and the needs-gradient flag to ``t``."""
        self._keep.append(t)
        if tag is None:
            self.tags.pop(id(t), None)
        else:
            self.tags[id(t)] = tag
        if grad and (t.is_floating_point() or t.is_complex()):
            self.grad.add(id(t))
        else:
            self.grad.discard(id(t))

    def is_grad(self, t: torch.Tensor) -> bool:
        """Whether ``t`` would carry a gradient in training (derived from a parameter or the input)."""
        return id(t) in self.grad or (isinstance(t, nn.Parameter) and t.requires_grad)

    def param_of(self, t: torch.Tensor) -> str | None:
        """Name of the parameter (of a module that is not a candidate) that ``t`` is, or is a cast of."""
        return self.owners.get(id(t)) or self.casts.get(id(t))

    def sums_grad(self, t: torch.Tensor, srcs: Iterable[str]) -> bool:
        """Whether ``t`` is a parameter (or a cast of one) whose gradient can be summed over the tp ranks, as it meets
        the tensors of ``srcs`` (a per-head norm's weight): recorded, and the analysis keeps the sharding."""
        name = self.param_of(t)
        if name is None:
            return False
        self.summed.setdefault(name, set()).update(srcs)
        return True

    def add_split(self, srcs: Iterable[str], n: int) -> None:
        """Record that the output of ``srcs`` is split into ``n`` parts (heads): ``n % tp`` must be 0."""
        for s in srcs:
            self.splits.setdefault(s, set()).add(n)

    # -- one torch call --------------------------------------------------------------------
    def on_error(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception
    ) -> None:
        """Called when ``func`` raised; the error propagates afterwards (the full run has no use for it)."""

    def on_op(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Update tags after ``out = func(*args, **kwargs)``."""
        name, in_place = op_name(func)
        ins = tensors_in((args, kwargs))
        if (in_place or name == "setitem") and args and isinstance(args[0], torch.Tensor):
            module = self.outputs.get(id(args[0]))  # a candidate module's output, modified in place (`out += x`)
            if module is not None:
                self.inplace.setdefault(module, f"`{name}` at {user_location()}")
        for t in ins:  # a candidate's parameter used outside its own forward (reading its shape is fine)
            owner = self.watch.get(id(t))
            if owner is not None and owner not in self.direct and name not in BENIGN:
                self.direct[owner] = f"`{name}` at {user_location()}"
        tagged = [tag for tag in map(self.tag_of, ins) if tag is not None]
        outs = tensors_in(out)
        params = [p for p in map(self.param_of, ins) if p is not None]
        if params and not tagged:
            if (name in SELF_ONLY or name in UNARY) and len(ins) == 1:  # `weight.to(dtype)`: still that parameter
                for o in outs:
                    self._keep.append(o)
                    self.casts[id(o)] = params[0]
            elif outs and name not in BENIGN:
                for p in params:
                    self.full_uses.setdefault(p, f"`{name}` at {user_location()}")
        srcs = frozenset().union(*(t.srcs for t in tagged)) if tagged else frozenset()
        if not outs:
            if name == "setitem" and tagged:
                self.refuse(srcs, f"is written into with `x[...] = ...` at {user_location()}")
                self.set_tag(args[0], None, True)
            elif tagged and name not in BENIGN:
                self.refuse(srcs, f"is read as plain values by `{name}` at {user_location()}")
            return
        grad = name not in NO_GRAD and any(self.is_grad(t) for t in ins)
        new: list[Tag | None] = [None] * len(outs)
        if tagged:
            try:
                new = apply_rule(name, args, kwargs, outs, self)
            except Refuse as e:
                self.refuse(srcs, f"{e} (`{name}` at {user_location()})")
                new = [None] * len(outs)
            except Exception as e:  # arguments a rule did not expect: refuse rather than guess
                self.refuse(
                    srcs,
                    f"goes through `{name}` at {user_location()}, which the analysis could not "
                    f"follow ({type(e).__name__}: {e})",
                )
                new = [None] * len(outs)
        for o, tag in zip(outs, new):
            self.set_tag(o, tag, grad)
        self.events.append((name, [tuple(o.shape) for o in outs], new))


class FlowMode(TorchFunctionMode):
    """TorchFunctionMode that reports every torch call to a :class:`FlowState`."""

    def __init__(self, state: FlowState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.state.passthrough:
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            self.state.on_error(func, args, kwargs, error)
            raise
        self.state.on_op(func, args, kwargs, out)
        return out
