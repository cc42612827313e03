"""``self.log`` in the gradient hooks and the epoch-end hooks under a pipeline: what one device would log, on every
rank (the epoch-end hooks: :func:`relay_epoch_end`).

On one device ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step`` and
``configure_gradient_clipping`` see the whole model. A pipeline rank holds one stage, so the values these hooks
log from parameters or gradients (Lightning's own recipe: ``self.log_dict(grad_norm(self, norm_type=2))``) are the
stage's: rank 0, the one that logs, would show the first stage's parameters only and a total over them, and a
``sync_dist=True`` on keys that differ between stages would pair different keys in one collective.

So under pp > 1, when the module or a callback overrides one of those hooks, the ``self.log`` calls made while
they run (module and callbacks alike: both call ``LightningModule.log``) are recorded instead of logged
(:class:`Recorder`). After the hooks, every rank of the pipeline group shares what it recorded (one
``all_gather_object``), and every rank logs the same merge (:func:`merge`), in the same order:

* a key one stage logged: that stage's value (a parameter's gradient norm comes from the stage holding it);
* a key several stages logged with the same value (a learning rate, a constant): that value;
* Lightning's ``grad_{p}_norm_total`` with different values: the p-norm of the stages' totals, which is the norm
  over all their parameters (the max for ``inf``);
* any other key with different values per stage: the first stage's value, and a warning once (no rule can know
  how a value computed from one stage's parameters combines).

Values cross ranks as Python numbers, so the exchange reads them on the host (a synchronisation on GPUs) once per
batch per overridden window; without such hooks, or at pp = 1, nothing is recorded or exchanged. torchmetrics
objects logged there go to Lightning at once (their state is the same on every stage, ``metric_sync``).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

WINDOWS: dict[str, tuple[str, ...]] = {
    "backward": ("on_before_backward", "on_after_backward"),
    "optimizer_step": ("on_before_optimizer_step", "configure_gradient_clipping"),
}
_TOTAL = re.compile(r"^grad_(?P<p>inf|[0-9]+(?:\.[0-9]*)?)_norm_total$")


@dataclass(frozen=True)
class Logged:
    """One recorded ``self.log`` call: the hook it was made in (``fx``, Lightning's ``_current_fx_name``: it decides
    ``on_step`` / ``on_epoch``), and the value as a Python number (with the tensor's dtype, if it was one)."""

    fx: str | None
    name: str
    value: float
    dtype: torch.dtype | None
    kwargs: dict[str, Any]


def _number(value: Any) -> tuple[float, torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"self.log got a tensor of shape {tuple(value.shape)}; log scalars.")
        local = value.full_tensor() if isinstance(value, DTensor) else value  # a DTensor norm: its whole value
        return float(local.detach().reshape(()).item()), value.dtype
    return float(value), None


def merge(stages: Sequence[Sequence[Logged]]) -> tuple[list[Logged], list[str]]:
    """The logs of every pipeline stage (in stage order) merged into what one device logs (see the module's rules).

    Returns:
        The merged calls in order of first appearance (stage by stage), and the names whose values differed
        between stages with no rule to combine them (the first stage's value was kept).
    """
    values: dict[tuple[str | None, str], list[Logged]] = {}
    for logs in stages:
        for call in logs:
            values.setdefault((call.fx, call.name), []).append(call)
    merged: list[Logged] = []
    ambiguous: list[str] = []
    for (_, name), calls in values.items():
        first = calls[0]
        distinct = {c.value for c in calls}
        if len(distinct) == 1 or all(math.isnan(v) for v in distinct):
            merged.append(first)
            continue
        total = _TOTAL.match(name)
        if total is None:
            ambiguous.append(name)
            merged.append(first)
            continue
        p = math.inf if total["p"] == "inf" else float(total["p"])
        parts = [c.value for c in calls]
        combined = max(parts) if math.isinf(p) else math.fsum(v**p for v in parts) ** (1.0 / p)
        merged.append(Logged(first.fx, name, combined, first.dtype, first.kwargs))
    return merged, ambiguous


class Recorder:
    """Captures a module's ``self.log`` calls (also through ``log_dict`` and from callbacks) as :class:`Logged`."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self.calls: list[Logged] = []

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        if isinstance(value, Metric):  # its state is every stage's: Lightning logs it as on one device
            LightningModule.log(self.module, name, value, **kwargs)
            return
        number, dtype = _number(value)
        self.calls.append(Logged(self.module._current_fx_name, name, number, dtype, kwargs))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Logged]]:
        """Record while inside; yields the list the calls go to (restores whatever ``log`` was before)."""
        previous = self.module.__dict__.get("log")
        self.module.__dict__["log"] = self._log
        try:
            yield self.calls
        finally:
            if previous is None:
                self.module.__dict__.pop("log", None)
            else:
                self.module.__dict__["log"] = previous


def replay(module: LightningModule, calls: Sequence[Logged]) -> None:
    """Log ``calls`` through the real ``LightningModule.log``, each as made in its own hook (a tensor value again a
    tensor of its dtype)."""
    previous = module._current_fx_name
    try:
        for call in calls:
            value: Any = call.value
            if call.dtype is not None:
                value = torch.tensor(call.value, dtype=call.dtype, device=module.device)
            module._current_fx_name = call.fx
            LightningModule.log(module, call.name, value, **call.kwargs)
    finally:
        module._current_fx_name = previous


@dataclass
class HookLogs:
    """Which gradient-hook windows exchange their logs over the pipeline group, and the exchange itself.

    ``window(name, ...)`` is a context manager around the hooks of one window (``WINDOWS``); it records and exchanges
    only when ``pp_group`` is set and the module or a callback overrides one of the window's hooks (decided from
    the same code on every rank, so every rank of the group takes part or none does).
    """

    pp_group: dist.ProcessGroup | None
    warned: set[str] = field(default_factory=set)
    _key: tuple[Any, ...] | None = None
    _active: frozenset[str] = frozenset()

    def active(self, module: LightningModule, callbacks: Sequence[Any]) -> frozenset[str]:
        """The windows whose hooks ``module`` or a callback overrides (remembered for the same objects)."""
        key = (module, *callbacks)
        last = self._key
        if last is not None and len(last) == len(key) and all(a is b for a, b in zip(last, key, strict=True)):
            return self._active
        from lightning.pytorch.utilities.model_helpers import is_overridden

        def overridden(hook: str) -> bool:
            if is_overridden(hook, module, LightningModule):
                return True
            return any(hasattr(Callback, hook) and is_overridden(hook, c, Callback) for c in callbacks)

        self._key = key
        self._active = frozenset(w for w, hooks in WINDOWS.items() if any(overridden(h) for h in hooks))
        return self._active

    @contextlib.contextmanager
    def window(self, name: str, module: LightningModule, callbacks: Sequence[Any]) -> Iterator[None]:
        """Around one window's hooks: record, then exchange over the pipeline group and log the merge."""
        if self.pp_group is None or name not in self.active(module, callbacks):
            yield
            return
        recorder = Recorder(module)
        with recorder.recording():
            yield
        gathered: list[list[Logged] | None] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, recorder.calls, group=self.pp_group)
        merged, ambiguous = merge([g or [] for g in gathered])
        replay(module, merged)
        new = [n for n in ambiguous if n not in self.warned]
        if new:
            self.warned.update(new)
            if dist.get_rank() == 0:
                warnings.warn(
                    f"ThreeDStrategy: {', '.join(repr(n) for n in new)} logged in a gradient hook "
                    "has a different value on each pipeline stage (computed from the stage's own parameters?); "
                    "the first stage's value is logged. Log it per stage under its own names, or for the "
                    "gradient norm use Lightning's grad_norm (its total is combined over the stages) or "
                    "trainer.strategy.grad_norm().",
                    stacklevel=2,
                )


# ------------------------------------------------------------------------------------------ epoch-end hooks
EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


@dataclass(frozen=True)
class EpochEnd:
    """What one pipeline rank's epoch-end hook did: whether the rank holds the last stage, its recorded
    ``self.log`` calls, and the error it raised (``"Type: message"``, or ``None``)."""

    last: bool
    calls: list[Logged]
    error: str | None


def merge_epoch_end(outcomes: Sequence[EpochEnd]) -> list[Logged]:
    """The calls every rank logs after an epoch-end hook: the last stage's, then keys only other stages logged
    (in rank order). The step's code after the model call runs on the last stage only, so what the hook reads
    from the step's state (a list of losses, a running sum) is the last stage's; a value computed elsewhere from
    the same state would be computed from nothing."""
    merged = [call for outcome in outcomes if outcome.last for call in outcome.calls]
    seen = {(call.fx, call.name) for call in merged}
    for outcome in outcomes:
        for call in outcome.calls:
            if (call.fx, call.name) not in seen:
                seen.add((call.fx, call.name))
                merged.append(call)
    return merged


def _is_users(callback: Any) -> bool:
    """A callback of the user's (Lightning's own read the relayed metrics and agree over ranks themselves)."""
    return not type(callback).__module__.startswith(("lightning.", "pytorch_lightning."))


def relay_epoch_end(
    module: LightningModule, holds_last: bool, pp_group: dist.ProcessGroup, callbacks: Sequence[Any] = ()
) -> Callable[[], None]:
    """Under pp > 1: the epoch-end hooks that the LightningModule or a callback of the user's overrides log on every
    rank what the last stage's run of the hook logged, and an error raised only where the last stage is not held is
    not fatal.

    Lightning's documented recipe for an epoch-end value appends each step's loss to a list and stacks it in
    ``on_validation_epoch_end``. The step's code after the model call runs on the last stage only, so on the other
    stages' ranks (rank 0, which logs, among them) the list was empty and the hook died (*"stack expects a
    non-empty TensorList"*), or logged a mean of nothing (NaN); so did a callback reading that list. Each hook now
    runs on every rank as before, with its ``self.log`` / ``pl_module.log`` calls recorded; the pipeline group
    shares the outcomes (one ``all_gather_object`` per hook call, once per epoch), and every rank logs
    :func:`merge_epoch_end`. An error on a rank without the last stage is reported once per hook (by global rank 0)
    and dropped when the last stage's hook succeeded; an error on the last stage is raised there, and on the other
    ranks of its pipeline as a ``RuntimeError`` that quotes it. torchmetrics objects logged there go to Lightning at
    once, as before. Lightning's own callbacks are left as they are.

    Returns:
        The undo (the hooks unwrapped), for teardown.
    """
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    reported: set[str] = set()  # hooks whose error off the last stage was reported
    owners: list[tuple[Any, type]] = [(module, LightningModule)]
    owners += [(callback, Callback) for callback in callbacks if _is_users(callback)]
    wrapped: list[tuple[Any, str]] = []
    for owner, base in owners:
        for name in EPOCH_END_HOOKS:
            if is_overridden(name, owner, base):
                what = f"{type(owner).__name__}.{name}"
                setattr(owner, name, _relayed(getattr(owner, name), what, module, holds_last, pp_group, reported))
                wrapped.append((owner, name))

    def undo() -> None:
        for owner, name in wrapped:
            owner.__dict__.pop(name, None)

    return undo


def _relayed(
    hook: Callable[..., Any],
    what: str,
    module: LightningModule,
    holds_last: bool,
    pp_group: dist.ProcessGroup,
    reported: set[str],
) -> Callable[..., Any]:
    """``hook`` (``what``, in messages) run with ``module``'s logs recorded and relayed (``relay_epoch_end``)."""

    def relayed(*args: Any, **kwargs: Any) -> Any:
        recorder = Recorder(module)
        error: Exception | None = None
        result = None
        with recorder.recording():
            try:
                result = hook(*args, **kwargs)
            except Exception as err:
                error = err
        mine = EpochEnd(holds_last, recorder.calls, None if error is None else f"{type(error).__name__}: {error}")
        gathered: list[EpochEnd | None] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, mine, group=pp_group)
        outcomes = [g for g in gathered if g is not None]
        failed_last = next((o.error for o in outcomes if o.last and o.error is not None), None)
        if error is not None and holds_last:
            raise error
        if failed_last is not None:
            raise RuntimeError(f"lightning_3d: {what} failed on the last pipeline stage: {failed_last}") from error
        replay(module, merge_epoch_end(outcomes))
        if error is not None and what not in reported and dist.get_rank() == 0:
            reported.add(what)
            warnings.warn(
                f"lightning_3d: {what} raised {mine.error} on a rank without the last pipeline stage. Your step's "
                "code after the model call runs on the last stage only, so state it keeps on the module (a list "
                "that validation_step appends to) is empty on the other stages; the values the last stage's run "
                "of the hook logged are logged on every rank instead.",
                stacklevel=2,
            )
        return result

    return relayed
