"""The zero-bubble schedules' weight-gradient pass, kept to the matrix products of the ``nn.Linear`` layers.

The zero-bubble schedules (``interleavedzerobubble``, ``zbvzerobubble``, ``dualpipev``, CSV lists with ``I``/``W``
actions) split each micro-batch's backward: ``I`` computes the gradient of the stage's input (the previous stage
waits for it) and ``W``, scheduled later into what would be the bubble, the weights' gradients. torch splits any
graph (``torch.distributed.pipelining._backward``): ``I`` walks the micro-batch's autograd graph in Python to group
the parameters, hooks the nodes where their paths leave the input's and keeps the whole graph; ``W`` runs one
``autograd.grad`` per parameter group from those nodes. That walk and those calls are host work on every
micro-batch (benchmark S1: ``I + W`` = 1.1-1.25 x one whole backward on the benchmark GPT's stages, CPU; this
module's split 1.04-1.06 x).

Almost all of a transformer's weight-gradient arithmetic is its linear layers' ``dW = dY^T X``, and torch's stage
takes a ``dw_builder`` for exactly this case: ``I`` then runs the stage's ordinary whole backward and ``W`` runs what
the builder returned. :func:`defer_linear_weight_grads` makes each plain ``nn.Linear`` of the stage run through
:class:`_DeferrableLinear`, whose backward, while :func:`deferring` is active, returns the input's (and bias')
gradient at once and keeps ``(weight, X, dY)`` for later; :class:`WeightGradStage` runs ``I`` that way and hands
torch a ``W`` that does the kept products (the same ``mm`` autograd would have run, accumulated into ``weight.grad``
as autograd accumulates). Every other parameter (norms, embeddings, biases) gets its gradient in ``I``.

A tensor-parallel layer (DTensor weight and input, as torch's column- and row-wise styles call it) keeps its
products too: the function's arithmetic runs on DTensors, so ``dW`` comes out laid out as the weight (a column-
parallel layer's from its sharded ``dY``, a row-parallel layer's from its sharded ``X``), as autograd's would.

A linear layer takes torch's ordinary ``F.linear`` (nothing kept, its weight's gradient computed in ``I``) when its
weight is not a leaf tensor needing a gradient at that call (a weight computed from another), when its input and
weight are not both plain tensors or both DTensors, when a hook waits for the weight's gradient
(``register_hook``, ``register_post_accumulate_grad_hook``: autograd would never call it), when gradients are off,
or inside ``torch.compile``. Under autocast it casts as autocast would (the input, weight and bias to autocast's
dtype, the gradients back to their tensors' dtypes). A micro-batch whose forward deferred no layer keeps torch's
split, and so does the first stage.

``ThreeDStrategy(split_backward="autograd")`` keeps torch's split everywhere (the default is ``"linear"``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from . import torch_compat

#: ``split_backward`` values: defer the linear layers' weight gradients, or torch's graph split.
SPLIT_BACKWARDS = ("linear", "autograd")

_PATCHED = "_lightning_3d_deferrable"


class _State:
    """What the layers read: where a deferred product goes, and how many calls could defer.

    Process-wide, not per thread: on a GPU autograd runs a backward on its device thread while the calling thread
    waits, and a process runs one stage's backward at a time.
    """

    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    counted: list[int] | None = None
    passes = 0  # W passes run from kept products in this process (tests and benchmarks read it)


_state = _State()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of rows (every leading dimension folded into one)."""
    return t.reshape(-1, t.shape[-1])


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``dW = dY^T X`` over all rows (what ``F.linear``'s backward computes for its weight)."""
    return _flat(grad_out).t().mm(_flat(x))


def _accumulate(weight: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor) -> None:
    """Add ``dY^T X`` to ``weight.grad`` as autograd's accumulation does (in its dtype; set when there is none).

    Into an existing plain gradient of the products' dtype the product is added by ``addmm_`` (one pass over
    ``weight.grad`` instead of a product and a sum)."""
    grad = weight.grad
    if grad is not None and type(grad) is torch.Tensor and type(x) is torch.Tensor and grad.dtype == x.dtype:
        grad.addmm_(_flat(grad_out).t(), _flat(x))
        return
    product = _weight_grad(x, grad_out).to(weight.dtype)
    if grad is None:
        weight.grad = product
    else:
        grad += product


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient waits for the ``W`` pass while :func:`deferring` is on.

    ``cast``: autocast's dtype when the call ran under autocast (the operands were cast to it, as autocast casts
    ``F.linear``'s), else ``None``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: torch.dtype | None
    ) -> torch.Tensor:
        ctx.weight = weight
        if cast is None:  # the common case, kept short: this runs for every layer of every micro-batch
            ctx.save_for_backward(x, weight)
            ctx.dtypes = None
            return F.linear(x, weight, bias)
        xc = x.to(cast) if x.is_floating_point() else x
        wc, bc = weight.to(cast), None if bias is None else bias.to(cast)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        # ``x`` and ``grad_out`` are matrices of rows (``_linear_forward`` hands the function rows)
        xc, wc = ctx.saved_tensors
        dtypes = ctx.dtypes
        if dtypes is not None:
            grad_out = grad_out.to(wc.dtype)
        needs_x, needs_w, needs_b, _ = ctx.needs_input_grad
        grad_x = grad_out.mm(wc) if needs_x else None
        grad_b = grad_out.sum(0) if needs_b else None
        if dtypes is not None:
            grad_x = None if grad_x is None else grad_x.to(dtypes[0])
            grad_b = None if grad_b is None else grad_b.to(dtypes[1])
        grad_w = None
        if needs_w:
            kept = _state.kept
            if kept is not None:  # detached: the input must not keep the graph (and its activations) alive
                kept.append((ctx.weight, xc.detach(), grad_out.detach()))
            else:
                grad_w = _weight_grad(xc, grad_out).to(ctx.weight.dtype)
        return grad_x, grad_w, grad_b, None


def _can_defer(weight: torch.Tensor) -> bool:
    """Whether this call may keep the weight's gradient for later: a leaf tensor (plain or DTensor) needing one,
    with no hook waiting for its gradient, gradients on (weights computed from others, hooked weights:
    ``F.linear``)."""
    return (
        type(weight) in (nn.Parameter, torch.Tensor, DTensor)
        and weight.is_leaf
        and weight.requires_grad
        and torch.is_grad_enabled()
        and not torch_compat.has_grad_hooks(weight)
    )


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``: through :class:`_DeferrableLinear` inside a stage's forward or backward
    (:func:`stage_pass`) where the weight may defer (:func:`_can_defer`), else ``F.linear`` as the class does."""
    weight = self.weight
    # ``is_compiling`` first: compiled code must not read (and so guard on) the pass state, which changes each pass
    if torch.compiler.is_compiling() or _state.counted is None or not _can_defer(weight):
        return F.linear(x, weight, self.bias)
    if type(x) is not (DTensor if type(weight) is DTensor else torch.Tensor):  # a tensor-parallel layer: both DTensor
        return F.linear(x, weight, self.bias)
    _state.counted[0] += 1
    kind = x.device.type
    cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    # the function sees rows and returns a fresh matrix: F.linear's output with a bias is a view of one, and a view
    # made inside a custom function cannot be modified in place later (a caller's ``+=``); a view of its output can
    out = _DeferrableLinear.apply(x.reshape(-1, x.shape[-1]), weight, self.bias, cast)
    return out.view(*x.shape[:-1], out.shape[-1])


def deferrable_layers(module: nn.Module) -> list[nn.Linear]:
    """The layers :func:`defer_linear_weight_grads` would change: every ``nn.Linear`` (or a class that keeps its
    ``forward``, as FSDP's wrapped classes do) that no module at or above it (within ``module``) has its ``forward``
    replaced on the instance: a compiled block (``compile_blocks``) runs its layers as compiled code, where they would
    take ``F.linear`` anyway, and is left exactly as compiled."""
    replaced = [name for name, m in module.named_modules() if "forward" in m.__dict__]

    def inside_replaced(name: str) -> bool:
        return any(name == r or r == "" or name.startswith(r + ".") for r in replaced)

    return [
        m
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and not inside_replaced(name)
    ]


_ROUTED: dict[type, type] = {}  # a layer's class -> its subclass whose forward is ``_linear_forward``


def _routed_class(cls: type) -> type:
    """``cls`` with :func:`_linear_forward` as its ``forward`` (one subclass per class, made once). The instance's
    class is swapped, as FSDP2 swaps a wrapped module's, so nothing is set on the instance: ``forward`` in an
    instance's ``__dict__`` means a compiled block to the rest of the strategy."""
    routed = _ROUTED.get(cls)
    if routed is None:
        routed = type(cls.__name__, (cls,), {"forward": _linear_forward, _PATCHED: True, "__module__": cls.__module__})
        _ROUTED[cls] = routed
    return routed


def defer_linear_weight_grads(modules: Iterable[nn.Module], enabled: bool = True) -> Callable[[], None]:
    """Route the plain ``nn.Linear`` layers of ``modules`` through :class:`_DeferrableLinear`; returns the undo.

    The layers then compute what ``nn.Linear`` computes, and while :func:`deferring` is on keep their weights'
    gradients for a later pass. Nothing changes when ``enabled`` is false.
    """
    layers = [(m, type(m)) for module in modules for m in deferrable_layers(module)] if enabled else []
    for layer, cls in layers:
        layer.__class__ = _routed_class(cls)

    def undo() -> None:
        for layer, cls in layers:
            if type(layer) is _ROUTED.get(cls):
                layer.__class__ = cls

    return undo


def deferred_passes() -> int:
    """How many ``W`` passes this process has run from kept products (:func:`run_kept` calls) so far."""
    return _state.passes


def is_deferrable(module: nn.Module) -> bool:
    """Whether some layer of ``module`` runs through :class:`_DeferrableLinear`."""
    return any(getattr(type(m), _PATCHED, False) for m in module.modules())


@contextlib.contextmanager
def stage_pass() -> Iterator[list[int]]:
    """A stage's forward or backward: inside, the routed layers run through :class:`_DeferrableLinear` where they
    may defer, and count those calls (the list's one item, read after the block). Outside (1F1B stages over the same
    layers, a user's own call of the model), they run ``F.linear``. A backward is a pass too: an activation
    checkpoint's recomputation must take the path its forward took (the saved tensors must match)."""
    previous, _state.counted = _state.counted, [0]
    counted = _state.counted
    try:
        yield counted
    finally:
        _state.counted = previous


@contextlib.contextmanager
def deferring(
    into: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """While inside, the backward of the deferrable layers keeps ``(weight, input, output gradient)`` in the list
    yielded (``into``, else a new one) instead of computing the weight's gradient (:func:`run_kept` computes them).
    A list of one's own sees each entry as it is kept (benchmark B3 counts the bytes held that way)."""
    previous, _state.kept = _state.kept, [] if into is None else into
    kept = _state.kept
    try:
        yield kept
    finally:
        _state.kept = previous


def run_kept(kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Compute and accumulate the weight gradients ``deferring`` kept, in the order their backward reached them,
    releasing each layer's input and output gradient as it goes."""
    _state.passes += 1
    with torch.no_grad():  # as autograd computes gradients: no graph of their own
        kept.reverse()  # popped from the end: in order, each entry released as soon as its product is in
        while kept:
            _accumulate(*kept.pop())


class WeightGradStage(torch_compat.PipelineStageWithShapeInferenceHook):
    """A ``PipelineStage`` whose split backward defers only the linear layers' weight gradients.

    A micro-batch whose forward ran a deferrable layer (:func:`defer_linear_weight_grads`) runs its ``I`` action as
    the whole backward under :func:`deferring`, and its ``W`` action as :func:`run_kept` (through torch's
    ``dw_builder``, set only around those two calls); any other micro-batch keeps torch's split, and so does the
    first stage (whose ``I`` torch skips: nothing waits for it). Whole-backward actions (``B``) are unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # torch's split already suits the first stage: no stage waits for its input's gradient, so its ``I`` does
        # nothing and its ``W`` is one whole backward, without the graph walk
        self._defers = is_deferrable(self.submod) and not self.is_first
        self._deferrable_chunks: set[int] = set()  # forwards that ran a deferrable layer
        self._deferred_chunks: set[int] = set()  # ``I`` done under ``deferring``, ``W`` to come

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not self._defers:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        with stage_pass() as counted:
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if counted[0]:
            self._deferrable_chunks.add(fwd_chunk_id)
        else:
            self._deferrable_chunks.discard(fwd_chunk_id)
        return out

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        if not self._defers:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward or bwd_chunk_id not in self._deferrable_chunks:
            with stage_pass():
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        with stage_pass(), deferring() as kept:
            self.dw_builder = lambda: functools.partial(run_kept, kept)
            try:
                super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            finally:
                self.dw_builder = None
        self._deferred_chunks.add(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        if bwd_chunk_id not in self._deferred_chunks:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._deferred_chunks.discard(bwd_chunk_id)
        self.dw_builder = lambda: run_kept  # any builder: torch then runs the runner the ``I`` action stored
        try:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        finally:
            self.dw_builder = None
