"""Running the user's unchanged ``training_step`` (and evaluation steps) through the pipeline.

The user's step calls ``self(x)`` once and computes a loss. Under pipeline parallelism the body runs
stage by stage, so the step is run in two places:

* On the rank holding stage 0, once per batch, with the body replaced by a stub that stops the step as
  soon as the body is called: whatever ``forward`` computed before the body (usually just ``x``) is the
  pipeline's input. ``self.log`` is silenced there.
* On the rank holding the last stage, once per micro-batch, as the schedule's loss function: the step
  gets that micro-batch's slice of the batch, and the body is replaced by a stub that returns the
  pipeline's output for it. The user's loss, post-processing and ``self.log`` calls run unchanged; the
  loss is weighted by the micro-batch's share of the batch (and 1 / accumulate_grad_batches), so the
  summed gradients equal those of the whole batch's mean loss.

The schedule's metadata inference also calls the loss function once, on dummy data, before the first
real micro-batch of a new schedule; that call never reaches the user's code.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from . import torch_compat
from .log_relay import LogRecorder, StepLogs, silenced
from .loss_weights import MicroBatchWeights
from .partition import CONTRACT, BodyRef


class _BodyCalled(Exception):
    """Raised by the capture stub to stop the user's step once the body's input is known."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("body input captured")
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def body_replaced(body: BodyRef, stub: Callable[..., Any]) -> Iterator[None]:
    """Make ``parent.<attr>`` resolve to ``stub`` (the real Sequential stays registered underneath)."""
    body.parent.__dict__[body.attr] = stub
    try:
        yield
    finally:
        body.parent.__dict__.pop(body.attr, None)


def capture_body_input(
    module: LightningModule, body: BodyRef, step_fn: Callable[..., Any], step_args: Sequence[Any], hook: str
) -> torch.Tensor:
    """Run the user's step until it calls the body; return the body's input for the whole batch."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise _BodyCalled(args, kwargs)

    with body_replaced(body, stub), silenced(module):
        try:
            step_fn(*step_args)
        except _BodyCalled as called:
            if len(called.args) != 1 or called.kwargs or not isinstance(called.args[0], torch.Tensor):
                raise ValueError(
                    f"{hook} called the body {body.fqn!r} with {len(called.args)} positional and "
                    f"{sorted(called.kwargs)} keyword arguments; a pipeline body takes exactly one tensor. {CONTRACT}"
                ) from None
            return called.args[0]
    raise ValueError(
        f"{type(module).__name__}.{hook} returned without calling the body {body.fqn!r} (self(x) or "
        f"self.{body.fqn}(x)); under ThreeDStrategy every {hook} must run the body once. {CONTRACT}"
    )


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: dim 0 of its first tensor."""
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("ThreeDStrategy could not find a tensor with a batch dimension in the batch.")


def shape_key(batch: Any) -> tuple:
    """Shapes and dtypes of the batch's tensors: a new key means the pipeline's buffers change."""
    return tuple((tuple(t.shape), t.dtype) for t in _leaves(batch) if isinstance(t, torch.Tensor))


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj


def slice_batch(batch: Any, start: int, length: int, total: int) -> Any:
    """Samples ``[start, start + length)`` of a batch whose sample dimension (dim 0) has size ``total``.

    Tensors with ``total`` rows are narrowed (views); lists of ``total`` non-tensor items (e.g. strings) are
    sliced; containers are walked; everything else is passed unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, start, length) if batch.dim() > 0 and batch.shape[0] == total else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, length, total) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        if (
            len(batch) == total
            and batch
            and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in batch)
        ):
            return batch[start : start + length]
        items = [slice_batch(v, start, length, total) for v in batch]
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*items)
        return type(batch)(items)
    return batch


def extract_loss(output: Any, hook: str) -> torch.Tensor | None:
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    raise ValueError(f"{hook} must return the loss tensor or a dict with a 'loss' key, got {type(output).__name__}.")


RANDOM_BEFORE_BODY = (
    "lightning_3d: {hook} drew random numbers ({sources}) before calling the body. Under ThreeDStrategy the "
    "body's input is computed once per batch on the first pipeline stage, and {hook} runs again per micro-batch "
    "on the last stage with other random numbers: what the step computes from such draws besides the body's "
    "input (e.g. a random mask that the loss also uses) does not match what the body saw. Random noise on the "
    "input alone is fine; randomness that both the input and the loss depend on belongs in the data pipeline "
    "(Dataset, collate_fn or on_after_batch_transfer). This warning is shown once."
)


def _random_states(device: torch.device | None) -> dict[str, Any]:
    """Fingerprints of the generators user code commonly draws from (torch CPU/CUDA, random, numpy)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if device is not None and device.type == "cuda":
        states["torch.cuda"] = torch.cuda.get_rng_state(device)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        _, keys, pos, *_ = numpy.random.get_state()
        states["numpy"] = (keys.tobytes(), pos)
    return states


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for name, old in before.items():
        new = after[name]
        same = torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new
        if not same:
            changed.append(name)
    return changed


class MicroBatchLoss:
    """What the two steppers (``StepAdapter``, ``StageExecutor``) share: the batch's settings, set by their ``begin``,
    and the loss the schedule gets from one micro-batch's step."""

    recorder: LogRecorder
    outputs: list[Any]
    _hook: str
    _train: bool
    _total: int
    _scale: float | torch.Tensor
    _weights: MicroBatchWeights | None

    def _loss_of(self, result: Any, chunk: int, length: int) -> torch.Tensor | None:
        """:func:`step_micro_batch_loss` of micro-batch ``chunk`` (``length`` samples) of the current batch."""
        return step_micro_batch_loss(
            result,
            self.recorder,
            hook=self._hook,
            train=self._train,
            outputs=self.outputs,
            chunk=chunk,
            length=length,
            total=self._total,
            scale=self._scale,
            weights=self._weights,
        )


class StepAdapter(MicroBatchLoss):
    """The schedule's loss function: the user's step on one micro-batch, on the last stage.

    ``begin`` sets up one batch; the pipeline then calls the adapter once per micro-batch with the
    stage's output and an index tensor naming the micro-batch's samples.
    """

    def __init__(
        self,
        module: LightningModule,
        body: BodyRef,
        is_initialised: Callable[[], bool],
        report_random: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.module = module
        self.body = body
        self.is_initialised = is_initialised
        # Whether this rank may warn that the step draws random numbers before the body (once per run).
        self._watch_random = report_random
        self._watched = 0
        self._device = device
        self.logs = StepLogs()
        self.outputs: list[Any] = []
        self.recorder = LogRecorder(module, self.logs)
        self._step_fn: Callable[..., Any] | None = None
        self._step_args: tuple[Any, ...] = ()
        self._batch: Any = None
        self._total = 0
        self._scale: float | torch.Tensor = 1.0
        self._weights: MicroBatchWeights | None = None
        self._train = True
        self._hook = "training_step"
        self.index: torch.Tensor | None = None  # the batch's sample index (``BatchRunner.run`` sets it)

    def begin(
        self,
        hook: str,
        step_fn: Callable[..., Any],
        batch: Any,
        rest: tuple[Any, ...],
        total: int,
        n_micro: int,
        scale: float | torch.Tensor,
        train: bool,
        weights: MicroBatchWeights | None = None,
    ) -> None:
        """Set up one batch (``n_micro`` is implied by the sample index the schedule hands each call);
        ``weights``: the micro-batches' label-token weights (``None``: by samples)."""
        self._hook, self._step_fn, self._batch, self._step_args = hook, step_fn, batch, rest
        self._total, self._scale, self._train, self._weights = total, scale, train, weights
        self.logs = StepLogs()
        self.recorder.logs = self.logs
        self.outputs = []

    def finish(self) -> tuple[StepLogs, list[Any]]:
        """The batch's logs and per-micro-batch outputs, and forget the batch."""
        logs, outputs = self.logs, self.outputs
        self._batch, self._step_fn = None, None
        return logs, outputs

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function. ``target`` is the micro-batch's slice of the batch's sample index (see
        ``BatchRunner.run``): its first entry and length say which samples of the batch this micro-batch is."""
        if self._train and not self.is_initialised():
            # torch's shape inference for a new schedule: a loss that depends on the output, nothing else.
            return torch.stack([o.float().sum() * 0.0 for o in _as_tuple(output)]).sum()
        assert self._step_fn is not None
        start, length = self._start_of(target), int(target.numel())
        micro_batch = slice_batch(self._batch, start, length, self._total)
        called = []
        watch = self._watch_random and self._train and self._watched < 16  # draws show up in the first steps
        self._watched += watch
        before = _random_states(self._device) if watch else None

        def stub(*args: Any, **kwargs: Any) -> Any:
            called.append(True)
            if before is not None:
                sources = _changed(before, _random_states(self._device))
                if sources:
                    self._watch_random = False
                    warnings.warn(RANDOM_BEFORE_BODY.format(hook=self._hook, sources=", ".join(sources)), stacklevel=1)
            # A copy if the output is a view: the user's loss code may modify it in place (logits /= t), which on
            # a view would bypass the data-parallel wrapper's backward hook.
            return output.clone() if isinstance(output, torch.Tensor) and torch_compat.is_view(output) else output

        with body_replaced(self.body, stub), self.recorder.recording(length, count_of(self._weights, start // length)):
            result = self._step_fn(micro_batch, *self._step_args)
        if not called:
            raise ValueError(f"{self._hook} did not call the body {self.body.fqn!r}. {CONTRACT}")
        loss = self._loss_of(result, start // length, length)
        return torch.zeros(()) if loss is None else loss

    def _start_of(self, target: torch.Tensor) -> int:
        """The first sample of the micro-batch whose slice of the sample index is ``target``.

        The schedule splits the index into views, so the offset into its storage says it without reading the
        device (``int(target[0])`` would wait for the device once per micro-batch); a copy is read instead.
        """
        index = self.index
        if (
            index is not None
            and target.dim() == 1
            and (target.numel() <= 1 or target.stride(0) == 1)
            and target.untyped_storage().data_ptr() == index.untyped_storage().data_ptr()
        ):
            return target.storage_offset() - index.storage_offset()
        return int(target[0])


def micro_batch_loss(
    result: Any,
    hook: str,
    train: bool,
    logs: StepLogs,
    outputs: list[Any],
    samples: int,
    weight: float | torch.Tensor,
    count_as: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """What the schedule takes from the user's step on one micro-batch.

    In evaluation the step's output is kept in ``outputs`` (and a scalar loss among it recorded in ``logs``) and
    ``None`` is returned; in training the loss is checked, recorded and returned times ``weight`` (the
    micro-batch's share of the batch, over ``accumulate_grad_batches``; a tensor under label-token weighting,
    ``core/loss_weights.py``, where 0 makes the loss of a micro-batch without labels, NaN, count for nothing).
    ``count_as``: what the loss counts for in the batch's mean loss in place of ``samples`` (label tokens).
    """
    if not train:
        outputs.append(result)
        loss = extract_loss(result, hook) if isinstance(result, (torch.Tensor, Mapping)) else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            logs.add_loss(loss, samples, count_as)
        return None
    loss = extract_loss(result, hook)
    if loss is None:
        raise ValueError(
            f"{hook} returned None: skipping a batch is not supported under pipeline parallelism "
            "(every stage has already run it)."
        )
    if loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(
            f"{hook} must return a scalar loss computed from the model's output (got shape "
            f"{tuple(loss.shape)}, requires_grad={loss.requires_grad})."
        )
    logs.add_loss(loss, samples, count_as)
    if not isinstance(weight, torch.Tensor):
        return loss * weight
    weight = weight.to(loss.dtype)
    return torch.where(weight != 0, loss * weight, torch.zeros_like(loss))


def count_of(weights: MicroBatchWeights | None, chunk: int) -> torch.Tensor | None:
    """What micro-batch ``chunk``'s logged means count for in the batch's (``None``: its samples)."""
    return None if weights is None else weights.log[chunk]


def step_micro_batch_loss(
    result: Any,
    recorder: LogRecorder,
    *,
    hook: str,
    train: bool,
    outputs: list[Any],
    chunk: int,
    length: int,
    total: int,
    scale: float | torch.Tensor,
    weights: MicroBatchWeights | None,
) -> torch.Tensor | None:
    """``micro_batch_loss`` for micro-batch ``chunk`` (``length`` of the batch's ``total`` samples) of a batch
    weighted by samples (``weights=None``) or by label tokens (the recorder's ``count_as`` was set for the step's
    logs: ``count_of``)."""
    if weights is None:
        return micro_batch_loss(result, hook, train, recorder.logs, outputs, length, length / total * scale)
    grad, log = weights.grad[chunk] * scale, weights.log[chunk]
    return micro_batch_loss(result, hook, train, recorder.logs, outputs, length, grad, log)


def merge_outputs(outputs: list[Any], sizes: Sequence[int] | None = None) -> Any:
    """Join per-micro-batch step outputs into one batch output, as the whole batch's step would have returned it.

    Tensors (and the tensors inside dicts, lists and tuples) are concatenated on dim 0; a list of plain items
    with one item per sample (decoded strings, ids: its length is the micro-batch's sample count, the rule
    ``slice_batch`` uses to split such lists) is joined; anything else becomes a list with one item per
    micro-batch.

    Args:
        outputs: the step's output of each micro-batch, in order.
        sizes: the micro-batches' sample counts (needed to recognise per-sample lists).
    """
    if not outputs:
        return None
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return list(outputs)
        return torch.cat(outputs, dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: merge_outputs([o[k] for o in outputs], sizes) for k in first})  # type: ignore[call-arg]
    if isinstance(first, list) and sizes is not None and _per_sample(outputs, sizes):
        return [item for o in outputs for item in o]
    if isinstance(first, (list, tuple)) and all(isinstance(o, type(first)) and len(o) == len(first) for o in outputs):
        items = [merge_outputs([o[i] for o in outputs], sizes) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return list(outputs)


def _per_sample(outputs: Sequence[Any], sizes: Sequence[int]) -> bool:
    """Lists of plain items, one per sample of each micro-batch."""
    return len(outputs) == len(sizes) and all(
        isinstance(o, list) and len(o) == n and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in o)
        for o, n in zip(outputs, sizes, strict=True)
    )


def _as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def take_grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    """Detach the parameters' gradients and return them (the parameters are left with ``grad = None``)."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


def drop_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Set the parameters' gradients to ``None``, freeing them (what ``Optimizer.zero_grad()`` does by default)."""
    for p in params:
        p.grad = None


def put_grads(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Set the parameters' gradients to ``grads`` (as returned by :func:`take_grads`)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def previous_grads_discarded(trainer: Any, memo: ZeroGradHooks | None = None) -> bool:
    """Whether Lightning zeroes the parameters' gradients right after this ``training_step`` with nothing able to
    read or keep them first, so that the previous optimizer step's gradients need not be held through the schedule.

    Lightning's closure runs ``training_step``, then (on the first batch of an accumulation window) ``zero_grad``,
    then ``backward``; the schedule runs forward and backward inside ``training_step``, so the gradients found there
    are the previous step's (or, later in a window, the window's so far). True on the first batch of a window,
    with automatic optimization and backward not skipped, when neither the LightningModule (``on_before_zero_grad``,
    ``optimizer_zero_grad``) nor a callback (``on_before_zero_grad``) nor an optimizer class (``zero_grad``)
    replaces Lightning's or torch's own: dropping them then changes no number and nothing any hook sees, and spares
    holding a second set of gradients (a whole gradient share) while the schedule computes the new ones.

    Args:
        trainer: the running Trainer.
        memo: remembers the hook checks across steps (the strategy keeps one); ``None``: checked afresh.
    """
    module = trainer.lightning_module
    loop = trainer.fit_loop.epoch_loop
    if not module.automatic_optimization or loop.automatic_optimization._skip_backward:
        return False
    if loop.batch_idx % trainer.accumulate_grad_batches != 0:
        return False
    return (memo or ZeroGradHooks()).untouched(module, trainer.callbacks, trainer.optimizers)


class ZeroGradHooks:
    """Whether ``zero_grad`` is Lightning's and torch's own (no hook or optimizer class replaces it), remembered for
    the last (module, callbacks, optimizers) it was asked about: the same objects every step of a fit, so the
    override checks (``is_overridden`` inspects each hook's code) run once instead of every step."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._answer = False

    def untouched(self, module: LightningModule, callbacks: Sequence[Any], optimizers: Sequence[Any]) -> bool:
        """``True`` when neither ``module`` nor a callback observes or replaces ``zero_grad``, nor an optimizer
        class overrides it."""
        key = (module, *callbacks, None, *optimizers)  # the objects themselves, compared by identity
        last = self._key
        if last is not None and len(last) == len(key) and all(a is b for a, b in zip(last, key, strict=True)):
            return self._answer
        self._key, self._answer = key, _zero_grad_untouched(module, callbacks, optimizers)
        return self._answer


def _zero_grad_untouched(module: LightningModule, callbacks: Sequence[Any], optimizers: Sequence[Any]) -> bool:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if any(is_overridden(hook, module, LightningModule) for hook in ("on_before_zero_grad", "optimizer_zero_grad")):
        return False
    if any(is_overridden("on_before_zero_grad", callback, Callback) for callback in callbacks):
        return False
    return all(type(opt).zero_grad is torch.optim.Optimizer.zero_grad for opt in optimizers)


@dataclass
class HeldGrads:
    """A batch's gradients held away from the parameters.

    Lightning's ``zero_grad`` runs after ``training_step``, i.e. after the schedule has already run backward; it
    would wipe them. ``restore`` adds them back in the strategy's ``backward``, after that ``zero_grad``.
    """

    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor | None]

    def restore(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g
