"""Lightning's model summary shows the whole model, as on one device.

Lightning's ``ModelSummary`` callback (on by default, ``RichModelSummary`` when ``rich`` is installed) prints, on
rank 0 at the start of a fit, a table of the LightningModule's top-level layers with their parameter counts, the
totals, the estimated size, how many modules are in train and in eval mode, and, when the module has an
``example_input_array``, each layer's input and output sizes and the model's FLOPs. Under pipeline parallelism
rank 0 holds only the first stage: the table counted that stage's parameters (half of them at pp = 2), listed the
other stages' layers as the stand-ins in their place (``Elsewhere``, 0 parameters), and the strategy had hidden the
example input from it (a forward on rank 0 alone would wait for the other stages, or for the tensor-parallel
collectives).

:func:`whole_model_summary` hands the summary callbacks a copy of the unsplit model instead: the structure-only
copy the strategy keeps (``boundary_check.make_skeleton``, parameters on the meta device), with this rank's current
``requires_grad`` and train / eval flags where it holds the module. Its counts are one device's (tensor- and
data-parallel shards are DTensors, whose ``numel`` is the whole tensor's anyway; tied weights counted once). With an
example input the summary's forward runs on fake tensors of the model's device (shapes, no data: no compute or
memory), so each layer's sizes and FLOPs are one device's too, down to the kernels chosen for that device
(attention on a CPU runs a fused kernel whose FLOPs torch's counter does not count: on meta tensors it would). A
forward that cannot run on fake tensors (``.item()``, a custom kernel) leaves the sizes and FLOPs out, as the strategy
did before. The flags of modules held by other pipeline ranks are the ones they had when the strategy set up (the
copy was taken then); a change made to them in between does not show on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelSummary
from torch import nn

from . import torch_compat
from .boundary_check import fake_like, make_skeleton
from .patches import Undo


def summary_view(skeleton: nn.Module, module: nn.Module, example: Any = None) -> LightningModule | None:
    """What the summary callbacks are given in place of ``module``: a copy of ``skeleton`` (the unsplit model on the
    meta device) with ``module``'s ``requires_grad`` and train / eval flags wherever ``module`` holds the same
    parameter or module, and ``example`` as its ``example_input_array``; None when no copy can be made. With an
    ``example``, call it inside :func:`torch_compat.fake_tensor_mode`: its parameters, buffers and example are fake
    tensors on the model's device."""
    view = make_skeleton(skeleton)
    if not isinstance(view, LightningModule):
        return None
    held = dict(module.named_parameters())
    for name, param in view.named_parameters():
        if name in held:
            param.requires_grad_(held[name].requires_grad)
    modules = dict(module.named_modules())
    for name, sub in view.named_modules():
        real = modules.get(name)
        if real is not None and type(real) is type(sub):  # not a stand-in for another stage's module
            sub.training = real.training
    view.example_input_array = None  # (the skeleton may share the module's, a real tensor)
    if example is not None:
        _fake_tensors(view, view.device)
        view.example_input_array = fake_like(example, view.device)
    return view


def _fake_tensors(view: nn.Module, device: torch.device) -> None:
    """Swap the view's parameters and buffers (meta tensors) for fakes on ``device`` (inside a fake mode), a weight
    shared by several modules for one fake."""
    made: dict[int, torch.Tensor] = {}
    for sub in view.modules():
        for name, param in list(torch_compat.own_parameters(sub).items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(fake_like(param, device), param.requires_grad)
                setattr(sub, name, made[id(param)])
        for name, buffer, _ in torch_compat.own_buffers(sub):
            if buffer is not None:
                setattr(sub, name, made.setdefault(id(buffer), fake_like(buffer, device)))


def whole_model_summary(
    callbacks: Sequence[Any], module: nn.Module, skeleton: nn.Module | str | None, example: Any
) -> Undo | None:
    """Make each ``ModelSummary`` callback summarise the unsplit model (:func:`summary_view`) when the fit starts.

    Args:
        callbacks: the trainer's callbacks.
        module: the (split, sharded) LightningModule being fitted.
        skeleton: the structure-only copy of the unsplit model the strategy keeps, or why none could be made (the
            callbacks are then left as they are).
        example: the module's ``example_input_array``, which the strategy holds while it fits (or None).

    Returns:
        The undo (``None``: nothing changed).
    """
    summaries = [c for c in callbacks if isinstance(c, ModelSummary)]
    if not summaries or not isinstance(skeleton, nn.Module):
        return None
    for callback in summaries:
        callback.on_fit_start = _on_fit_start(callback, module, skeleton, example)  # type: ignore[method-assign]

    def undo() -> None:
        for callback in summaries:
            callback.__dict__.pop("on_fit_start", None)

    return undo


def _runs(view: nn.Module, example: Any) -> bool:
    """Whether ``view``'s forward runs on ``example`` (fake tensors) as Lightning's summary calls it: eval mode, no
    gradients; the modes are put back."""
    modes = [(sub, sub.training) for sub in view.modules()]
    view.eval()
    try:
        with torch.no_grad():
            if isinstance(example, (list, tuple)):
                view(*example)
            elif isinstance(example, dict):
                view(**example)
            else:
                view(example)
    except Exception:  # .item(), a custom kernel, ...: the table without sizes and FLOPs
        return False
    finally:
        for sub, mode in modes:
            sub.training = mode
    return True


def _on_fit_start(callback: ModelSummary, module: nn.Module, skeleton: nn.Module, example: Any) -> Any:
    summarise = type(callback).on_fit_start

    def on_fit_start(trainer: Any, pl_module: LightningModule) -> None:
        if example is not None:
            with torch_compat.fake_tensor_mode(), torch.random.fork_rng(devices=[]):
                view = summary_view(skeleton, module, example)
                if view is not None and _runs(view, view.example_input_array):
                    summarise(callback, trainer, view)
                    return
        view = summary_view(skeleton, module)  # no example, or a forward that cannot run on fake tensors
        summarise(callback, trainer, view if view is not None else pl_module)

    return on_fit_start
