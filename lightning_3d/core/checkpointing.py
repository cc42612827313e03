"""Activation checkpointing per block, as torchtitan applies it.

``activation_checkpointing="full"`` recomputes every block's forward in the backward instead of keeping its
intermediate activations; ``N`` (an integer) does so for every N-th block of the model (blocks ``N-1, 2N-1, ...``
counted from 0 over the whole model, so the same blocks are checkpointed whatever the pipeline layout);
``"selective"`` keeps the outputs of the matrix multiplications (and of tensor-parallel collectives, so the
recomputation communicates nothing) and recomputes the rest (torch's selective activation checkpointing, as
torchtitan's op-level SAC). The choices, and why:

* **Blocks only**, the same blocks ``compile`` picks (:func:`lightning_3d.core.blocks.sequential_blocks` for an
  ``nn.Sequential`` body, the block container's blocks otherwise): the embedding and the head run once per
  micro-batch and their activations are small next to the blocks'.
* **The block's ``forward``, in place** (``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``),
  not torch's ``checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module.`` into every parameter name:
  parameter names and checkpoint keys stay those of the unwrapped model, and the block's own hooks (the stage
  executor's hand-in and stop hooks on a stage's first and last block) stay outside the recomputation.
* **After tensor parallelism and compile, before data parallelism**: the recomputation runs the sharded block,
  and data parallelism's hooks see each parameter's gradient once. Under ``compile`` the checkpoint wraps the
  compiled ``forward`` (torchtitan compiles the checkpointed block instead; inside compiled code dynamo takes no
  recompute context but two ``TorchDispatchMode`` objects, and the stream replay below is not one), so the
  backward runs the compiled forward again. ``"selective"`` is refused there (``ThreeDSettings``): its policy
  picks among the aten operations it sees, and compiled code runs them out of its sight.
* **The same dropout masks on recomputation.** torch restores the default generator's state (the CPU one, and
  that of each CUDA device among the inputs) before recomputing: the stage stream (``rng.py``) is swapped into
  that generator around the whole stage, so that is the right state. The tensor-parallel region streams are
  swapped in by hooks *inside* the block, from states :class:`~lightning_3d.core.rng.BodyRandomness` keeps
  (they advance as the forward draws): each checkpointed forward snapshots those states, and the recomputation
  runs on a copy of the snapshot (:meth:`BodyRandomness.replaying`), so it draws the masks the forward drew and
  leaves the streams where the forward left them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointFunction,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from . import torch_compat
from .rng import BodyRandomness

MODES = ("full", "selective")


def inside_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``'s forward (torch's
    default variant when ``use_reentrant`` is not given): a module called there runs without gradients, and the
    checkpoint's output gets its gradient function from the checkpoint's inputs alone."""
    if torch.is_grad_enabled():  # that forward runs under no_grad: most calls stop here
        return False
    code = CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def reentrant_checkpoint_message(block: str, stage: int, where: str) -> str:
    """Why a forward that calls a block at a pipeline stage boundary through a reentrant checkpoint is refused."""
    return (
        f"lightning_3d: the model's forward calls {block}, the {where} block of pipeline stage {stage}, through "
        "torch.utils.checkpoint.checkpoint with use_reentrant=True (torch's default when it is not given). That "
        "variant runs the block without gradients and gives its output a gradient towards the checkpoint's inputs "
        "only, so under pipeline parallelism the activation crossing the stage boundary there would get no "
        "gradient. Pass use_reentrant=False (the variant torch recommends: the stages then recompute as one device "
        "does), or call the blocks directly and set ThreeDStrategy(activation_checkpointing='full'), which "
        "checkpoints every block the same way."
    )


def checkpoint_every(setting: Any) -> int | str | None:
    """Normalise an ``activation_checkpointing`` setting.

    Args:
        setting: ``None`` or ``False`` (off), ``"full"``, ``"selective"`` or a positive integer N (every N-th block).

    Returns:
        ``None`` (off), ``"full"``, ``"selective"`` or N (``1`` is returned as ``"full"``).

    Raises:
        ValueError: anything else, naming what works.
    """
    if setting is None or setting is False:
        return None
    if isinstance(setting, str) and setting in MODES:
        return setting
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return "full" if setting == 1 else setting
    raise ValueError(
        f"ThreeDStrategy: activation_checkpointing must be None (off), 'full', 'selective' or a positive integer N "
        f"(every N-th block), got {setting!r}."
    )


def chosen_blocks(all_blocks: Sequence[str], mode: int | str) -> list[str]:
    """The blocks a mode checkpoints, out of the model's blocks in order (the whole model, not one rank's)."""
    if isinstance(mode, int):
        return [name for i, name in enumerate(all_blocks) if (i + 1) % mode == 0]
    return list(all_blocks)


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the outputs of matrix multiplications, attention and tensor-parallel collectives; recompute the rest."""
    if func in saved_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SAVED: frozenset[Any] | None = None


def saved_ops() -> frozenset[Any]:
    """The aten operations whose outputs selective checkpointing keeps (matmuls, attention, collectives)."""
    global _SAVED
    if _SAVED is None:
        aten = torch.ops.aten
        ops = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default]
        _SAVED = frozenset(ops + torch_compat.saved_attention_and_collective_ops())
    return _SAVED


@dataclass
class CheckpointedBlocks:
    """The blocks this rank checkpoints, and the random streams their recomputation replays.

    Attributes:
        names: fully qualified names of the checkpointed blocks.
        mode: ``"full"``, ``"selective"`` or N (every N-th block).
        randomness: the body's random streams, once the strategy has made them (``None``: only the default
            generator, which torch restores itself).
    """

    names: list[str]
    mode: int | str
    randomness: BodyRandomness | None = field(default=None)

    def describe(self) -> str:
        """The setup line rank 0 prints after the layout."""
        named = {"full": "full", "selective": "selective: matmul outputs kept"}
        what = named.get(str(self.mode), f"1 block in {self.mode}")
        if not self.names:
            return f"activation checkpointing ({what}): no block on this rank"
        count = f"{len(self.names)} block{'s' if len(self.names) > 1 else ''}"
        return f"activation checkpointing ({what}): {count} on this rank ({self.names[0]}, ...)"

    def _contexts(self) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        """torch's ``context_fn``: called at each checkpointed forward; the second context wraps the recompute."""
        forward: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        recompute: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.mode == "selective":
            forward, recompute = create_selective_checkpoint_contexts(selective_policy)
        if self.randomness is None:
            return forward, recompute
        randomness, snapshot = self.randomness, self.randomness.state_dict()
        return forward, _EachEntry(lambda: _both(randomness.replaying(snapshot), recompute))


class _EachEntry(contextlib.AbstractContextManager):
    """A context made afresh each time it is entered. torch enters a block's recompute context once per backward
    pass that reads the block's activations, and a zero-bubble schedule's backward is two passes (input, then
    weight gradients); a generator-based context can be entered only once."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self._make = make
        self._open: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        context = self._make()
        context.__enter__()
        self._open.append(context)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.pop().__exit__(*exc)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[Any], second: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with first, second:
        yield


def checkpoint_blocks(blocks: Sequence[tuple[str, nn.Module]], mode: int | str) -> CheckpointedBlocks:
    """Checkpoint each block's ``forward`` in place (names, parameters and the block's own hooks unchanged).

    Args:
        blocks: ``(fully qualified name, module)`` of the blocks to checkpoint (see :func:`chosen_blocks`), already
            tensor-parallel and not yet compiled.
        mode: ``"full"``, ``"selective"`` or N (only for the description; ``blocks`` is already the choice).

    Returns:
        What was checkpointed; set its ``randomness`` once the body's streams exist.
    """
    result = CheckpointedBlocks([name for name, _ in blocks], mode)
    for _, block in blocks:
        # An instance attribute shadows the class's forward; nn.Module.__call__ runs hooks, then this.
        block.forward = _checkpointed(block.forward, result._contexts)  # type: ignore[method-assign]
    return result


def _checkpointed(forward: Callable[..., Any], contexts: Callable[[], Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, shape inference: nothing to keep, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run
