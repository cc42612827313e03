"""Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``, a user's gradual unfreezing) on DTensor
parameters.

``BaseFinetuning.unfreeze_and_add_param_group`` leaves out the parameters "already in the optimizer", found by
``torch.equal`` of each parameter with each of the optimizer's: a comparison of values. On DTensor parameters
(dp or tp > 1) each comparison is a collective (DTensor's ``equal`` all-reduces its local answer), and comparing a
DTensor with a plain tensor (tensor parallelism leaves some parameters plain) raises: the unfreezing epoch hung at
pp2 x dp2 and died at tp2 x pp2. While ``ThreeDStrategy`` runs, the filter compares by identity, as its docstring
says it does ("exclude any parameter which already exists in this optimizer"). The two differ only for a
parameter whose values equal those of another one already optimized (a fresh LayerNorm's ones): Lightning would
leave it out of the new group, and so untrained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning.pytorch.callbacks import BaseFinetuning
from torch.optim import Optimizer


def filter_by_identity(optimizer: Optimizer, params: Iterable[Any]) -> list[Any]:
    """The parameters of ``params`` that none of ``optimizer``'s groups holds (the same tensor object)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [p for p in params if id(p) not in held]


def filter_by_identity_while_running(callbacks: Sequence[Any]) -> Callable[[], None]:
    """Make ``BaseFinetuning.filter_on_optimizer`` compare by identity when ``callbacks`` hold a ``BaseFinetuning``
    (process-wide: the callback calls it through the class); returns the undo."""
    if not any(isinstance(c, BaseFinetuning) for c in callbacks):
        return lambda: None
    previous = BaseFinetuning.__dict__["filter_on_optimizer"]
    BaseFinetuning.filter_on_optimizer = staticmethod(filter_by_identity)  # type: ignore[method-assign,assignment]

    def undo() -> None:
        BaseFinetuning.filter_on_optimizer = previous  # type: ignore[method-assign]

    return undo
