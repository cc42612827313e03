"""What a model's forward hands each of its blocks besides the hidden states, for the tensor-parallel analysis.

The automatic tensor-parallel plan of a model split at its block container is found by running the blocks one
after the other on a hidden-state tensor (``tensor_parallel.analyzer``). Blocks that take more than that (a
torchtitan or litgpt block's rotary tables, ``block(x, freqs_cis)``; a mask; a Hugging Face decoder layer's
``position_embeddings=`` and ``attention_mask=``) cannot be called that way, and the analysis used to give up:
every block stayed replicated under ``tp > 1``, with a warning.

:func:`block_calls` runs the unsplit model's ``forward`` once on the LightningModule's ``example_input_array``
under a ``FakeTensorMode`` (shapes only: no data, no compute, the random state untouched) and records how the
forward calls each block: the hidden states (the first positional argument) and every other argument.
:class:`BlocksWithArguments` then calls the blocks in order with those other arguments, each tensor among them
replaced by zeros of its shape and dtype on the blocks' device (the analysis follows shapes and data flow, not
values), so the analysis sees the blocks as the model runs them.

:func:`first_calls` uses the same kind of forward to tell, for each module with parameters outside the
blocks, whether the forward calls it before or after them, so the pipeline stages hold what they run even when a
model registers a module in another order than it calls it (OPT's decoder registers ``final_layer_norm`` and
``project_out`` before its ``layers``). It runs on the LightningModule's ``example_input_array``, else on a Hugging
Face model's own ``dummy_inputs`` (the model that holds the blocks), else not at all (registration order).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.func import functional_call

from . import torch_compat
from .boundary_check import fake_like


@dataclass(frozen=True)
class ArgSpec:
    """Shape and dtype of a tensor seen on fake tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def zeros(self, device: torch.device) -> torch.Tensor:
        """Zeros of this shape and dtype on ``device``."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)


@dataclass
class BlockCall:
    """How the model's forward called one block.

    Attributes:
        hidden: the first positional argument (the hidden states).
        args: the other positional arguments, tensors as :class:`ArgSpec`.
        kwargs: the keyword arguments, tensors as :class:`ArgSpec`.
    """

    hidden: ArgSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def takes_more(self) -> bool:
        """Whether the block is called with anything besides the hidden states."""
        return bool(self.args or self.kwargs)


def _spec(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: ArgSpec(tuple(t.shape), t.dtype))


def _real(value: Any, device: torch.device) -> Any:
    return apply_to_collection(value, ArgSpec, lambda s: s.zeros(device))


def _arguments(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_input, tuple):
        return example_input, {}
    if isinstance(example_input, dict):
        return (), example_input
    return (example_input,), {}


def block_calls(module: nn.Module, blocks: Sequence[nn.Module], example_input: Any) -> list[BlockCall] | str:
    """Each block's call in one forward of ``module`` on fake tensors of ``example_input``'s shapes.

    Args:
        module: the unsplit model (parameters real or on the meta device; they are not touched).
        blocks: its blocks, in order.
        example_input: Lightning's ``example_input_array``: a tensor, a tuple of positional arguments or a dict of
            keyword arguments.

    Returns:
        One :class:`BlockCall` per block (the first call of each), or why none could be made: the forward does not
        run on fake tensors, does not call every block, or calls one without a tensor as its first positional
        argument.
    """
    calls: list[BlockCall | None] = [None] * len(blocks)
    problems: list[str] = []

    def recorder(index: int) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if calls[index] is not None:
                return
            if not args or not isinstance(args[0], torch.Tensor):
                problems.append(f"block {index} is called without the hidden states as its first positional argument")
                return
            calls[index] = BlockCall(_spec(args[0]), _spec(tuple(args[1:])), _spec(dict(kwargs)))

        return hook

    handles = [b.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        _run_on_fake(module, example_input)
    except Exception as err:  # the forward does not run on fake tensors: the analysis runs the blocks alone
        return f"forward(example_input_array) did not run on fake tensors ({type(err).__name__}: {err})"
    finally:
        for handle in handles:
            handle.remove()
    if problems:
        return problems[0]
    missing = [i for i, call in enumerate(calls) if call is None]
    if missing:
        return f"forward(example_input_array) did not call block {missing[0]}"
    return calls  # type: ignore[return-value]


def trace_input(module: nn.Module, container_fqn: str, example_input: Any) -> tuple[str, Any] | None:
    """What :func:`first_calls` can run: ``("", example_input)`` (the whole module's forward), else the
    name of the outermost Hugging Face model on the path to the blocks and its ``dummy_inputs``, else ``None``."""
    if example_input is not None:
        return "", example_input
    parts = container_fqn.split(".")
    for depth in range(len(parts)):
        name = ".".join(parts[:depth])
        sub = module.get_submodule(name)
        if hasattr(sub, "base_model_prefix") and hasattr(sub, "config"):  # a transformers PreTrainedModel
            try:
                dummy = sub.dummy_inputs
            except Exception:  # a model whose dummy inputs need more than its config: registration order
                return None
            if isinstance(dummy, dict) and dummy:
                return name, dict(dummy)
    return None


def first_calls(
    module: nn.Module, container_fqn: str, outside: Sequence[str], example_input: Any
) -> tuple[set[str], set[str]]:
    """The modules among ``outside`` one forward on fake tensors first calls before its first block, and after it.

    BART's decoder registers ``layernorm_embedding`` after its layers and runs it before them; OPT registers its
    final norm before its layers and runs it after them.

    Args:
        module: the unsplit LightningModule (parameters real or on the meta device; they are not touched).
        container_fqn: the block container's name in ``module``.
        outside: names (in ``module``) of the modules with parameters outside the blocks.
        example_input: the module's ``example_input_array`` or ``None`` (see :func:`trace_input`).

    Returns:
        ``(called before, called after)``; both empty when nothing could be run (no input, or the forward does not
        run on fake tensors): the caller then keeps registration order, and the stage boundary check, at setup or at
        the first step, names any module a stage runs without holding it.
    """
    found = trace_input(module, container_fqn, example_input)
    if found is None:
        return set(), set()
    root_name, inputs = found
    root = module.get_submodule(root_name)
    prefix = f"{root_name}." if root_name else ""
    relative = {name[len(prefix) :]: name for name in outside if name.startswith(prefix)}
    first_block = next(iter(module.get_submodule(container_fqn).children()), None)
    started, before, after = [False], set(), set()

    def seen(name: str) -> Any:
        def hook(*_: Any) -> None:
            if not started[0]:
                before.add(name)
            elif name not in before:
                after.add(name)

        return hook

    def start(*_: Any) -> None:
        started[0] = True

    handles = [first_block.register_forward_pre_hook(start)] if first_block is not None else []
    handles += [root.get_submodule(rel).register_forward_pre_hook(seen(full)) for rel, full in relative.items()]
    try:
        _run_on_fake(root, inputs)
    except Exception:  # the forward does not run on fake tensors: registration order, checked later
        return set(), set()
    finally:
        for handle in handles:
            handle.remove()
    return before, after


def _run_on_fake(module: nn.Module, inputs: Any) -> None:
    """``module(inputs)`` (a tensor, a tuple of positional arguments or a dict of keyword arguments) in eval mode
    on fake tensors of the parameters', buffers' and inputs' shapes: no data, no compute, the random state kept."""

    cpu = torch.device("cpu")
    with torch_compat.fake_tensor_mode(), torch.random.fork_rng(devices=[]), torch.no_grad():
        state = {name: fake_like(t, cpu) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        args, kwargs = _arguments(fake_like(inputs, cpu))
        with _eval(module):
            functional_call(module, state, args, kwargs)


@contextlib.contextmanager
def _eval(module: nn.Module) -> Any:
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


class BlocksWithArguments(nn.Sequential):
    """The blocks in order (under the container's names), each called as the model's forward calls it.

    Args:
        blocks: ``name -> block`` in order (the block container's children).
        calls: how the model called each block (:func:`block_calls`).
        device: where the zeros standing in for the other tensor arguments are made (the blocks' device).
    """

    def __init__(self, blocks: OrderedDict[str, nn.Module], calls: Sequence[BlockCall], device: torch.device) -> None:
        super().__init__(blocks)
        self._calls = [(_real(c.args, device), _real(c.kwargs, device)) for c in calls]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block, (args, kwargs) in zip(self, self._calls):
            out = block(hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, (tuple, list)) else out
        return hidden


__all__ = ["ArgSpec", "BlockCall", "BlocksWithArguments", "block_calls"]
