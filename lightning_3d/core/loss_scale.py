"""fp16 loss scaling (``precision="16-mixed"``) with the pipeline's own backward.

Lightning's ``MixedPrecision`` plugin scales the loss before ``loss.backward()`` and lets its ``GradScaler`` unscale,
check and step. Under ThreeDStrategy the pipeline schedule runs backward itself, once per micro-batch, and the
gradients are spread over stages, tensor-parallel shards and data-parallel replicas, so a local inf/NaN check (what
``GradScaler.unscale_`` does) could skip the step on some ranks and not on others. :class:`LossScaler` drives the
plugin's own ``GradScaler`` (its scale, growth and back-off, its state dict) from an AGREED overflow instead:

* scale: the last stage multiplies each micro-batch's loss by the current scale (a device tensor: no host
  synchronisation). What the user's step returns and logs stays unscaled.
* overflow: the batch's non-finite flags (``Reliability.local_flags``: one per stage and one for the loss, summed
  over every rank in the training step's one exchange, read once per batch) say whether any gradient anywhere holds
  an inf or NaN; over an accumulation window the flags are ORed (:meth:`LossScaler.observe`).
* step: every rank multiplies its local gradients by 1 / scale (``GradScaler``'s own kernel), then Lightning's
  ``on_before_optimizer_step`` and gradient clipping run on the unscaled gradients, then ``optimizer.step()``. With
  overflow the hooks still run (clipping is skipped by the strategy) but ``optimizer.step()`` is not called:
  parameters and optimizer state stay untouched, as ``GradScaler.step`` skips. The global step and LR schedulers
  advance, as under single-device ``16-mixed``.
* update: the agreed flag is recorded as the optimizer's found-inf and ``GradScaler.update()`` backs off or grows the
  scale (``growth_interval`` good steps in a row), so the scale is the same on every rank.
* state: the scaler is the precision plugin's, so Lightning saves its ``state_dict`` in the checkpoint (under
  ``"MixedPrecision"``, in the distributed checkpoint's ``meta.pt``) and restores it on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.tensor import DTensor

from . import torch_compat


def scaler_of(precision: Any) -> torch.amp.GradScaler | None:
    """The precision plugin's enabled ``torch.amp.GradScaler`` (``precision="16-mixed"``), else ``None``.

    Raises:
        ValueError: the plugin holds a loss scaler that is not a ``torch.amp.GradScaler`` (its unscale and step
            logic cannot be driven from the pipeline's agreed overflow).
    """
    scaler = getattr(precision, "scaler", None)
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(
            f"ThreeDStrategy drives fp16 loss scaling through torch.amp.GradScaler; {type(precision).__name__} "
            f"holds a {type(scaler).__name__}. Use MixedPrecision('16-mixed', device, "
            "scaler=torch.amp.GradScaler(...))."
        )
    return scaler if scaler.is_enabled() else None


class LossScaler:
    """The precision plugin's ``GradScaler`` driven by the pipeline's agreed overflow (see the module docstring).

    Args:
        scaler: the plugin's ``torch.amp.GradScaler`` (its state is the one Lightning checkpoints).
        device: this rank's device (where the scale lives).
    """

    def __init__(self, scaler: torch.amp.GradScaler, device: torch.device) -> None:
        self.scaler = scaler
        self.device = device
        self.overflow = False  # a non-finite gradient (or loss) in the current accumulation window, on any rank
        self.step_skipped = False  # the last optimizer step was skipped for an overflow
        self.skipped_steps: list[int] = []  # global steps skipped for an overflow

    def current_scale(self) -> torch.Tensor:
        """The current scale as a 0-dim float32 device tensor (no host synchronisation)."""
        return self.scaler.scale(torch.ones((), dtype=torch.float32, device=self.device))

    def loss_weight(self, weight: float) -> torch.Tensor:
        """What the last stage multiplies each micro-batch's loss by besides its share: ``weight`` x the scale."""
        return self.current_scale() * weight

    def observe(self, flags: Sequence[float]) -> list[float]:
        """Take one batch's agreed non-finite flags (``[grads of stage 0, ..., of stage n-1, loss]``, summed over
        every rank): any of them marks the accumulation window as overflowed.

        Returns:
            The flags with the gradient entries cleared: a non-finite gradient under fp16 loss scaling is an overflow
            this scaler handles, never an ``on_nonfinite`` error; the loss entry is kept (a non-finite loss is not
            something a lower scale can fix, so ``on_nonfinite`` still applies to it).
        """
        values = [float(f) for f in flags]
        if any(values):
            self.overflow = True
        return [0.0] * (len(values) - 1) + values[-1:]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's local gradients of ``optimizer``'s parameters by the scale, in place.

        The local pieces of DTensor gradients are unscaled directly: ``GradScaler.unscale_`` on DTensors would
        all-reduce a found-inf flag over each gradient's mesh (a different set of collectives per stage); the
        overflow is already agreed.
        """
        inv_scale = self.current_scale().double().reciprocal().float()  # as GradScaler.unscale_ computes it
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                if grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")  # GradScaler's own refusal
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():
            for (device, _), grads in groups.items():
                torch_compat.unscale_grads_(grads, inv_scale.to(device))

    def update(self, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
        """Record the agreed ``overflow`` as the optimizer's found-inf and let ``GradScaler.update`` back off
        (overflow) or count a good step (and grow the scale every ``growth_interval`` good steps)."""
        self.current_scale()  # the scale exists (a rank that never scaled a loss initialises it lazily here)
        found_inf = torch.full((), float(overflow), dtype=torch.float32, device=self.device)
        torch_compat.record_scaler_found_inf(self.scaler, optimizer, found_inf)
        self.scaler.update()

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        after_closure: Callable[[], None],
        global_step: int,
        **kwargs: Any,
    ) -> Any:
        """One optimizer step of ``MixedPrecision.optimizer_step``'s shape, on the agreed overflow.

        Args:
            optimizer: the (unwrapped) optimizer.
            closure: Lightning's closure (training step and backward of the window's last batch).
            after_closure: ``on_before_optimizer_step`` and gradient clipping (the precision plugin's
                ``_after_closure``).
            global_step: the trainer's global step (recorded when skipped).
            kwargs: passed to ``optimizer.step``.

        Returns:
            ``optimizer.step``'s result, or ``None`` when the step was skipped.
        """
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure()
        overflow, self.overflow = self.overflow, False
        self.step_skipped = overflow
        self.unscale_(optimizer)  # before the hooks and clipping (they see what they see under one device)
        after_closure()
        output = None
        if overflow:
            self.skipped_steps.append(global_step)
        else:
            output = optimizer.step(**kwargs)
        self.update(optimizer, overflow)
        return output
