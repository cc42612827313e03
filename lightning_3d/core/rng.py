"""Random-number streams of the body: per pipeline stage, and per tensor-parallel rank inside sharded regions.

Under 3D parallelism a dropout mask is drawn on whichever rank runs the layer. Left on the process's default
generator (seeded alike on every rank by ``seed_everything``), two things go wrong:

* every pipeline stage starts from the same state, so layers on different stages draw the same masks
  (correlated across depth, which single-device training never is);
* inside a tensor-parallel region (between a column-parallel Linear and its row-parallel partner, where each
  rank holds a slice of the features or heads) every tp rank draws the same mask for its own slice, so
  head ``h`` and head ``h + n_head / tp`` are always dropped together.

Megatron-LM solves both with seeds offset by the pipeline rank and a "model-parallel" generator inside
tensor-parallel regions. :class:`BodyRandomness` does the same for plain modules, with hooks and no change to
the user's code:

* a **stage stream** per pipeline stage, seeded from the run seed and the stage index; swapped in for the
  stage module's forward (the same on every tp rank of the stage, so replicated activations stay identical);
* a **region stream** per (stage, tp rank), swapped in from the output of a column-parallel module (local
  shards) to the input of the row-parallel module that consumes them.

The default generator is left to the user's own code (``training_step``, data). Streams are saved in
checkpoints with the other RNG states (``resume.rng_state``) and restored at the same layout, so resumes stay
bitwise; torch's schedule shape inference runs with the streams frozen, so it draws nothing from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from .tensor_parallel.styles import inner_style

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads nearby (seed, index) pairs apart


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from the run seed and integer keys (stage index, tp rank), stable across runs."""
    value = seed & (2**64 - 1)
    for key in keys:
        value = ((value ^ (key + 1)) * _MIX) & (2**64 - 1)
        value ^= value >> 29
    return value & (2**63 - 1)


class BodyRandomness:
    """This rank's stage and region streams, swapped into the device's default generator around forwards.

    Args:
        seed: the run seed (the same on every rank).
        stages: indices of the pipeline stages this rank holds.
        tp_rank: this rank's tensor-parallel coordinate.
        device: the device whose default generator dropout draws from (CPU or a CUDA device).
    """

    def __init__(self, seed: int, stages: list[int], tp_rank: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        for s in stages:
            self.states[stage_stream(s)] = self._fresh(stream_seed(seed, 1, s))
            self.states[region_stream(s)] = self._fresh(stream_seed(seed, 2, s, tp_rank))
        self._stack: list[tuple[str, torch.Tensor]] = []  # (stream swapped in, the state it replaced)
        self._frozen = 0

    # ---------------------------------------------------------------- the device's default generator
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _fresh(self, seed: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator.get_state()

    # ---------------------------------------------------------------- swapping
    @property
    def current(self) -> str | None:
        """The stream swapped in now (None: the default generator's own)."""
        return self._stack[-1][0] if self._stack else None

    def enter(self, name: str) -> None:
        """Swap ``name``'s state into the default generator (nested swaps restore in order)."""
        self._stack.append((name, self._get()))
        self._set(self.states[name])

    def exit(self) -> None:
        """Keep the state the current stream reached (unless frozen) and put back what it replaced."""
        name, outer = self._stack.pop()
        if not self._frozen:
            self.states[name] = self._get()
        self._set(outer)

    def exit_through(self, name: str) -> None:
        """Exit swaps until ``name`` is no longer swapped in (no-op when it is not)."""
        while any(n == name for n, _ in self._stack):
            self.exit()

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Streams swapped in during this block do not advance (torch's shape inference runs a real forward)."""
        self._frozen += 1
        try:
            yield
        finally:
            self._frozen -= 1

    @contextlib.contextmanager
    def replaying(self, snapshot: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Run on a copy of ``snapshot`` (states taken by ``state_dict`` at a checkpointed block's forward), then
        put the streams back as they were: an activation-checkpointing recomputation draws the masks the forward
        drew and leaves the streams where the forward left them (``checkpointing.py``)."""
        kept, depth = self.states, len(self._stack)
        self.states = {k: v.clone() for k, v in snapshot.items()}
        try:
            yield
        finally:
            while len(self._stack) > depth:  # a region the block's own end hook would have closed
                self.exit()
            self.states = kept

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def load_state_dict(self, states: Mapping[str, torch.Tensor]) -> None:
        """Take the saved states of the streams this rank has (others keep their fresh seeds)."""
        for name, state in states.items():
            if name in self.states and state.shape == self.states[name].shape:
                self.states[name] = state.clone()

    # ---------------------------------------------------------------- hooks
    def install_stage(self, module: nn.Module, index: int) -> None:
        """Run ``module``'s forward (a whole stage) on the stage stream."""
        name = stage_stream(index)

        def pre(mod: nn.Module, args: Any) -> None:
            self.enter(name)

        def post(mod: nn.Module, args: Any, output: Any) -> None:
            self.exit_through(name)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post, always_call=True)

    def install_regions(self, layer: nn.Module, styles: Mapping[str, ParallelStyle | None], index: int) -> int:
        """Use the region stream from each column-parallel output to the row-parallel input that reads it.

        Args:
            layer: one body layer, already tensor-parallel.
            styles: its plan (submodule path -> style), as given to ``parallelize_module``.
            index: the stage index the layer belongs to.

        Returns:
            the number of modules that open a region.
        """
        name = region_stream(index)
        opened = 0

        def open_region(mod: nn.Module, args: Any, output: Any) -> None:
            if self.current != name:
                self.enter(name)

        def close_region(mod: nn.Module, args: Any) -> None:
            self.exit_through(name)

        def close_at_end(mod: nn.Module, args: Any, output: Any) -> None:
            self.exit_through(name)

        for path, style in styles.items():
            sub = layer.get_submodule(path) if path else layer
            if opens_region(style):
                sub.register_forward_hook(open_region)
                opened += 1
            elif closes_region(style):
                sub.register_forward_pre_hook(close_region)
        if opened:
            layer.register_forward_hook(close_at_end, always_call=True)  # a region never outlives its layer
        return opened


def stage_stream(index: int) -> str:
    return f"stage{index}"


def region_stream(index: int) -> str:
    return f"stage{index}.tp"


def opens_region(style: ParallelStyle | None) -> bool:
    """A column-parallel style whose output stays a local shard (features or heads split over tp ranks)."""
    style = inner_style(style)
    return (
        isinstance(style, ColwiseParallel)
        and bool(style.use_local_output)
        and tuple(style.output_layouts) == (Shard(-1),)
    )


def closes_region(style: ParallelStyle | None) -> bool:
    """A row-parallel style reading a feature-sharded input (the partner of a column-parallel module)."""
    style = inner_style(style)
    return isinstance(style, RowwiseParallel) and tuple(style.input_layouts) == (Shard(-1),)
