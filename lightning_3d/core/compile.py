"""``torch.compile`` per block, as torchtitan does it.

Each block this rank holds (a block of the split container, or a layer of an ``nn.Sequential`` body) has its
``forward`` compiled in place, after tensor parallelism has sharded it and before data parallelism wraps the
stage. The choices, and why:

* **Blocks only.** The blocks of the split container, or for an ``nn.Sequential`` body its repeated layers of a
  class of the user's (:func:`sequential_blocks`); the embedding and the head stay eager, as in torchtitan.
* **The block's ``forward``, not the module.** ``torch.compile(block)`` would wrap the block in an
  ``OptimizedModule`` (its parameters renamed ``..._orig_mod...``: checkpoint keys would depend on the setting),
  and ``block.compile()`` would trace the block's own hooks too: the stage executor's hooks on a stage's first
  and last block (hand the received activation in, stop the step and send the output on) must stay plain
  Python. Compiling ``forward`` keeps the names, keeps those hooks eager, and still traces what runs inside
  (submodules and their hooks). Blocks of one class share one compiled graph (dynamo treats the parameters as
  inputs), so a model of N identical blocks compiles once per distinct call (training, shape inference under
  ``no_grad``, evaluation).
* **Lazily.** The blocks compile at their first call (the first training step, or sanity validation), with the
  shapes and dtypes of real micro-batches; no example input is needed. Rank 0 reports the seconds spent
  compiling after the first training step (dynamo's own timers: forward graphs and their backward).
* **The body's random streams keep working.** Compiled dropout draws from the device's default generator, which
  the stage stream is swapped into around the stage (outside the compiled code). The tensor-parallel region
  streams are swapped by hooks on submodules *inside* a block: dynamo cannot trace ``get_rng_state`` /
  ``set_rng_state``, so it breaks the graph there and runs the swap eagerly, and each piece draws from the
  right stream. With ``backend="aot_eager"`` compiled dropout draws the very masks eager dropout draws;
  inductor generates random numbers with its own kernels (seeded from the default generator, so from the
  swapped-in stream), so its masks differ from eager's while being just as deterministic for a given seed.
* **Inputs settled first.** torch's row-parallel styles all-reduce asynchronously: a vocabulary-parallel
  embedding (a Hugging Face Llama's own plan, or the automatic plan's ``"vocab"``) returns a tensor whose
  all-reduce is still pending, and a Llama hands it straight to its first decoder layer. Compiled code cannot
  take one (its backward breaks DTensor's), so each compiled forward waits for its tensor arguments' pending
  collectives first, eagerly (:func:`_settled_inputs`); an eager first use would wait at the same point.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import torch_compat
from .blocks import sequential_blocks  # noqa: F401  (kept importable from here; compile and checkpointing share it)

# The keyword arguments of ``torch.compile`` the setting accepts (``compile={"backend": ..., "mode": ...}``).
COMPILE_KWARGS = ("backend", "mode", "fullgraph", "dynamic", "options")


def compile_kwargs(setting: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments a ``compile`` setting asks for (``None``: do not compile).

    Args:
        setting: ``False`` (off), ``True`` (torch's defaults: inductor) or a mapping of ``torch.compile`` keyword
            arguments (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``).

    Returns:
        A plain dict (nested mappings copied to dicts), or ``None`` when compiling is off.

    Raises:
        ValueError: the setting is neither a bool nor a mapping of known keyword arguments.
    """
    if isinstance(setting, bool):
        return {} if setting else None
    if not isinstance(setting, Mapping):
        raise ValueError(
            f"ThreeDStrategy: compile must be True, False or a mapping of torch.compile arguments "
            f"({', '.join(COMPILE_KWARGS)}), got {setting!r}."
        )
    unknown = sorted(set(setting) - set(COMPILE_KWARGS))
    if unknown:
        raise ValueError(
            f"ThreeDStrategy: compile={dict(setting)!r} has arguments torch.compile does not take here: "
            f"{', '.join(map(str, unknown))}. Use {', '.join(COMPILE_KWARGS)}."
        )
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in setting.items()}


def describe_kwargs(kwargs: Mapping[str, Any]) -> str:
    """``torch.compile(backend='inductor', mode=...)`` as the report prints it."""
    shown = {"backend": "inductor", **kwargs}
    return "torch.compile(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


@dataclass
class CompiledBlocks:
    """The blocks this rank compiled, and the compile time once the first training step has run.

    Attributes:
        names: fully qualified names of the compiled blocks.
        kwargs: the ``torch.compile`` keyword arguments used.
        start_seconds: dynamo's compile-time total when the blocks were wrapped (the process may have compiled
            other code before).
        step_started: wall time at which the first training step began (set by ``step_began``).
        reported: whether the report after the first training step was made.
    """

    names: list[str]
    kwargs: dict[str, Any]
    start_seconds: float = 0.0
    step_started: float | None = None
    reported: bool = field(default=False)

    def describe(self) -> str:
        """The setup line rank 0 prints after the layout."""
        if not self.names:
            return "compile: no blocks to compile on this rank (no block container, or no repeated block); eager"
        count = f"{len(self.names)} block{'s' if len(self.names) > 1 else ''}"
        return (
            f"compile: {count} on this rank with {describe_kwargs(self.kwargs)} "
            f"({self.names[0]}, ...); compiled lazily at their first call, time reported after the first step"
        )

    def compile_seconds(self) -> float:
        """Seconds dynamo and the backend spent compiling since the blocks were wrapped, on this rank."""
        return max(0.0, torch_compat.compile_seconds() - self.start_seconds)

    def step_began(self) -> None:
        """Mark the start of the first training step (later calls do nothing)."""
        if self.step_started is None:
            self.step_started = time.perf_counter()

    def first_step_report(self) -> str | None:
        """After the first training step: the seconds spent compiling since setup (sanity validation included)
        and the step's wall time; once (then ``None``)."""
        if self.reported or not self.names:
            return None
        self.reported = True
        wall = ""
        if self.step_started is not None:
            wall = f"; first training step {time.perf_counter() - self.step_started:.1f} s"
        return f"compile: {self.compile_seconds():.1f} s compiling since setup (rank 0){wall}"


def compile_blocks(blocks: Sequence[tuple[str, nn.Module]], kwargs: Mapping[str, Any]) -> CompiledBlocks:
    """Compile each block's ``forward`` in place (names, parameters and the block's own hooks unchanged).

    Args:
        blocks: ``(fully qualified name, module)`` of the blocks this rank holds, already tensor-parallel.
        kwargs: ``torch.compile`` keyword arguments (see :func:`compile_kwargs`).

    Returns:
        What was compiled, for the setup report and the compile time after the first step.
    """
    start = torch_compat.compile_seconds()
    for _, block in blocks:
        # An instance attribute shadows the class's forward; nn.Module.__call__ runs hooks, then this.
        block.forward = _settled_inputs(torch.compile(block.forward, **kwargs))  # type: ignore[method-assign]
    return CompiledBlocks([name for name, _ in blocks], dict(kwargs), start)


def _settled_inputs(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, called with its tensor arguments' pending asynchronous collectives waited for, eagerly.

    A row-parallel module just before a block (a vocabulary-parallel embedding, under a Hugging Face model's own
    plan or the automatic one) hands the block a tensor whose all-reduce is still pending; compiled code cannot
    take one (``torch_compat.settle_async_collective``)."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(torch_compat.settle_async_collective(a) for a in args)
        kwargs = {k: torch_compat.settle_async_collective(v) for k, v in kwargs.items()}
        return compiled(*args, **kwargs)

    return forward


def for_split_backward(splits_backward: bool) -> Callable[[], None]:
    """Make compiled code runnable under a schedule whose backward is two passes; returns the undo.

    A zero-bubble schedule's input-gradient pass keeps the graph (``retain_graph=True``) for its weight-gradient
    pass, and torch refuses to run a compiled backward whose forward donated its saved buffers while the graph is
    kept (the first step would fail). Under such a schedule donated buffers are turned off process-wide (the
    compiled blocks, and any code of the user's compiled on the backward's path) until the undo runs.
    """
    if not splits_backward:
        return lambda: None
    previous = torch_compat.set_donated_buffers(False)

    def undo() -> None:
        torch_compat.set_donated_buffers(previous)

    return undo


def is_compiled(block: nn.Module) -> bool:
    """Whether ``compile_blocks`` compiled this block's forward."""
    return "forward" in block.__dict__
