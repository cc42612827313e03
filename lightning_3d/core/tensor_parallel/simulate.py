"""Re-run the body with the local shapes of one tensor-parallel rank and compare with the full run.

The data-flow analysis (``flow.py``) decides which Linears can be sharded, assuming the model code
computes sizes from the tensors it gets (``view(B, T, -1, head_dim)``). Code that hard-codes a
full size (``view(B, T, n_head, -1)``) runs under tensor parallelism without an error and gives
wrong numbers. This module catches that: column-wise Linears return only their first
``out_features / tp`` outputs, row-wise Linears check that they get ``in_features / tp`` inputs, and
every torch call must produce exactly the full run's shapes with the sharded dimension divided by
``tp``. The first difference names the Linears involved, which are then left replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_3d.core.tensor_parallel.flow import FlowMode, FlowState, user_location
from lightning_3d.core.tensor_parallel.rules import Tag, op_name, tensors_in


class SimFailure(Exception):
    """The simulated rank diverged from the full run; ``srcs`` are the Linears to blame."""

    def __init__(self, srcs: frozenset[str], message: str) -> None:
        super().__init__(message)
        self.srcs = srcs


class SimState(FlowState):
    """Replays the events of a full run (``ref``) and checks the local shapes of each call."""

    def __init__(
        self, ref: list[tuple[str, list[tuple[int, ...]], list[Tag | None]]], tp: int, simulated: frozenset[str]
    ) -> None:
        super().__init__()
        self.ref, self.tp, self.simulated, self.k = ref, tp, simulated, 0

    def blame(self, tensors: list[torch.Tensor], extra: list[Tag | None] | None = None) -> frozenset[str]:
        """Simulated Linears whose sharding reaches ``tensors`` (all of them when none does)."""
        tags = [self.tag_of(t) for t in tensors] + list(extra or [])
        srcs = frozenset().union(*(t.srcs for t in tags if t is not None)) & self.simulated
        return srcs or self.simulated

    def check(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Compare the outputs of the next call with the full run's; tag them like the full run."""
        k, self.k = self.k, self.k + 1
        if k >= len(self.ref) or self.ref[k][0] != name:
            expected = self.ref[k][0] if k < len(self.ref) else "the end of the forward pass"
            raise SimFailure(
                self.blame(ins),
                f"with sharded sizes the forward pass runs `{name}` at "
                f"{user_location()} where the full model ran `{expected}` (shape-dependent code)",
            )
        _, shapes, tags = self.ref[k]
        for out, shape, tag in zip(outs, shapes, tags):
            expected_shape = list(shape)
            if tag is not None and tag.srcs & self.simulated:
                expected_shape[tag.dim] //= self.tp
            if list(out.shape) != expected_shape:
                raise SimFailure(
                    self.blame(ins, tags),
                    (
                        f"with sharded weights `{name}` at {user_location()} gives shape {tuple(out.shape)} where "
                        f"{tuple(expected_shape)} is needed: the code computes a size from the full model (e.g. a "
                        "hard-coded number of heads in view/reshape); use -1 or the head size instead"
                    ),
                )
            self.set_tag(out, tag, False)

    def on_op(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Check one torch call of the simulated pass."""
        outs = tensors_in(out)
        if outs:
            self.check(op_name(func)[0], tensors_in((args, kwargs)), outs)

    def on_error(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception
    ) -> None:
        """A torch call failed with sharded shapes: blame the Linears whose sharding reached it."""
        raise SimFailure(
            self.blame(tensors_in((args, kwargs))),
            f"with sharded weights `{op_name(func)[0]}` at {user_location()} fails: {error}",
        ) from error


def simulate(
    run: Callable[[], Any], ref: FlowState, tp: int, modules: dict[str, nn.Module], colwise: set[str], rowwise: set[str]
) -> SimFailure | None:
    """Run ``run()`` (which calls the body) with the local shapes of one rank.

    Args:
        run: calls the body on the example input inside the caller's no-grad/eval context.
        ref: the state of the full run (its ``events`` are replayed).
        tp: tensor-parallel size.
        modules: the Linears and Embeddings the full run hooked, by body-relative name (they get
            temporary hooks, removed afterwards).
        colwise: Linears simulated as column-wise (their output is cut to ``out_features / tp``).
        rowwise: Linears simulated as row-wise (they expect ``in_features / tp`` inputs).

    Returns:
        None when every shape matched, else the first :class:`SimFailure`.
    """
    st = SimState(ref.events, tp, frozenset(colwise | rowwise))
    handles = []

    def pre(fqn: str, mod: nn.Module) -> Callable[..., Any]:
        def hook(_m: nn.Module, inputs: tuple[Any, ...]) -> Any:
            st.passthrough += 1
            if fqn not in rowwise or not inputs:
                return None
            x = inputs[0]
            local = int(mod.in_features) // tp
            if x.shape[-1] != local:
                st.passthrough -= 1
                raise SimFailure(
                    st.blame([x]) | {fqn},
                    f"row-wise {fqn} gets {x.shape[-1]} input features on "
                    f"a tp rank where {local} (= {mod.in_features} / tp) are needed",
                )
            pad = x.new_zeros((*x.shape[:-1], int(mod.in_features) - local))
            return (torch.cat([x, pad], dim=-1), *inputs[1:])

        return hook

    def post(fqn: str, mod: nn.Module) -> Callable[..., Any]:
        def hook(_m: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> Any:
            if fqn in colwise:
                out = out.narrow(-1, 0, int(mod.out_features) // tp)
            st.check(f"module:{fqn}", list(inputs[:1]), [out])
            st.passthrough -= 1
            return out

        return hook

    try:
        for fqn, mod in modules.items():
            handles.append(mod.register_forward_pre_hook(pre(fqn, mod)))
            handles.append(mod.register_forward_hook(post(fqn, mod)))
        with FlowMode(st):
            run()
    except SimFailure as failure:
        return failure
    except Exception as error:  # a Python-level failure (e.g. an assert on a local size)
        return SimFailure(st.simulated, f"with sharded weights the forward pass fails: {error!r}")
    finally:
        for h in handles:
            h.remove()
    return None
