"""Tensor parallelism for a model body held in one ``nn.Sequential``.

:func:`resolve_plan` finds which ``nn.Linear`` / ``nn.Embedding`` modules to shard (an automatic
analysis of the data flow plus the user's explicit entries); :meth:`TPPlan.styles_for` turns the
plan into ``parallelize_module`` arguments for one pipeline stage; :func:`describe_plan` prints it;
:func:`local_numel` says how much of each parameter one rank must hold.
"""

from lightning_3d.core.tensor_parallel.analyzer import example_input_for
from lightning_3d.core.tensor_parallel.describe import describe_plan
from lightning_3d.core.tensor_parallel.plan import (
    PlanEntry,
    TPPlan,
    local_numel,
    resolve_outer_plan,
    resolve_plan,
    split_explicit,
)
from lightning_3d.core.tensor_parallel.styles import STYLE_NAMES

__all__ = [
    "STYLE_NAMES",
    "PlanEntry",
    "TPPlan",
    "describe_plan",
    "example_input_for",
    "local_numel",
    "resolve_outer_plan",
    "resolve_plan",
    "split_explicit",
]
