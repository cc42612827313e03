"""The optimizer's implementation for DTensor parameters: torch's multi-tensor (``foreach``) one where torch's own
default would fall back to a Python loop over tensors.

Under ``replicate``, FSDP and tensor parallelism every parameter is a ``DTensor``. Left to choose
(``foreach=None``, the default), torch picks the multi-tensor implementation for DTensors on GPUs (it lists
``DTensor`` among its foreach types) but the per-tensor loop on every other device (``_default_to_fused_or_foreach``
only knows GPU-like devices). That loop sends each of its ~10 element-wise operations per parameter through
DTensor's Python dispatch: on CPU, AdamW over a 7.4M-parameter GPT's ~100 DTensor parameters takes about 2.4x as
long as over plain tensors (B7's largest gap), against about 1x with ``foreach=True`` (one dispatch per operation
for all parameters of a group).

So, where the user left the choice to torch, the strategy makes the GPU's choice on every device, but only for the
optimizers whose multi-tensor implementation gives bitwise the same parameters as their per-tensor loop
(:data:`BITWISE_FOREACH`, checked by ``tests/unit/test_optim.py`` in float32 and float64): the numbers are unchanged,
only the dispatch is. ``NAdam``, ``RAdam`` and ``ASGD`` round differently in their multi-tensor form, ``Rprop``'s has
no DTensor rule, and subclasses may override ``step``: all of those are left as they are. A group whose ``foreach``
(or ``fused``, ``differentiable``, ``capturable``) the user set is never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import torch_compat

BITWISE_FOREACH: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
)
"""Optimizer classes (exactly these, not subclasses) whose ``foreach=True`` step equals their loop's bitwise."""

_USER_CHOICES = ("fused", "differentiable", "capturable")


@contextlib.contextmanager
def foreach_for_dtensors(optimizer: Any) -> Iterator[int]:
    """While inside, ``optimizer``'s param groups that left ``foreach`` to torch (``None``) and hold only DTensor
    parameters run with ``foreach=True``, when torch's default would not already pick it and the class is in
    :data:`BITWISE_FOREACH`; on leaving they are ``None`` again, so the user's settings (and checkpoints, which save
    the param groups' hyperparameters) never show the choice.

    Wrap the optimizer's ``step`` (with Lightning, the strategy's ``optimizer_step``, which runs the closure inside
    the step). Cheap: a walk over the param groups.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (anything else is left alone).

    Yields:
        How many param groups were switched.
    """
    groups = _switchable(optimizer)
    for group in groups:
        group["foreach"] = True
    try:
        yield len(groups)
    finally:
        for group in groups:
            group["foreach"] = None


def _switchable(optimizer: Any) -> list[dict[str, Any]]:
    if type(optimizer) not in BITWISE_FOREACH:
        return []
    chosen = []
    for group in optimizer.param_groups:
        if "foreach" not in group or group["foreach"] is not None or any(group.get(k) for k in _USER_CHOICES):
            continue
        params = group["params"]
        if not params or not all(isinstance(p, DTensor) for p in params):
            continue  # plain tensors: torch's loop costs nothing extra; a mix: DTensor's foreach ops refuse it
        if all(p.device.type in torch_compat.foreach_default_devices() for p in params):
            continue  # torch picks foreach here itself (GPUs)
        chosen.append(group)
    return chosen
