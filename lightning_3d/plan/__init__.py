"""The planner: which (tp, pp, dp, micro-batches, schedule, sharding, recompute) to train a model with on a cluster.

``python -m lightning_3d.plan model=... cluster=... global_batch_size=...`` (see :mod:`lightning_3d.plan.app`).
Pure Python: no process group, no device; the memory model (:mod:`.memory`) drops the layouts that do not fit and
the time model (:mod:`.timing`) ranks the rest.
"""

from __future__ import annotations

from .cluster import ClusterSpec, available_clusters, cluster_from_config, load_cluster
from .layouts import Layout, Search, enumerate_layouts
from .memory import Memory, layout_memory
from .model import ModelSpec, model_from_config
from .planner import Entry, NoLayout, Plan, evaluate, plan
from .timing import StepTime, step_time

__all__ = [
    "ClusterSpec",
    "Entry",
    "Layout",
    "Memory",
    "ModelSpec",
    "NoLayout",
    "Plan",
    "Search",
    "StepTime",
    "available_clusters",
    "cluster_from_config",
    "enumerate_layouts",
    "evaluate",
    "layout_memory",
    "load_cluster",
    "model_from_config",
    "plan",
    "step_time",
]
