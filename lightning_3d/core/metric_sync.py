"""torchmetrics ``Metric`` objects under pipeline parallelism.

Only the last stage runs the user's step, so only its metrics are updated; yet Lightning computes logged
metrics on every rank (and rank 0, a first-stage rank, reports them). Three rules make every rank's
``compute()`` equal to single-device training:

* Each batch, the last stage runs its micro-batches against metrics reset to an empty state, so that what
  they hold afterwards is exactly this batch's state; it is merged back into the running state (torchmetrics'
  ``merge_state``). The batch states of all data-parallel replicas give the step value that single-device
  training of the global batch would log (``Metric.forward``'s result).
* The running state of every metric updated in the batch is copied from the last stage to the other stages
  of its pipeline, so all ranks of one data-parallel replica hold the same state.
* Metrics synchronise over the data-parallel group only (``metric.process_group``), so each sample is counted
  once, not once per tensor-parallel or pipeline copy.

Metrics whose state cannot be merged (``full_state_update=True``) are still copied across stages and
synchronised over data parallelism (epoch values stay exact); their step value is the last micro-batch's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

State = dict[str, Any]


def _mergeable(metric: Metric) -> bool:
    return not (metric.full_state_update or metric.full_state_update is None or metric.dist_sync_on_step)


def _detach(state: State) -> State:
    out: State = {}
    for name, value in state.items():
        if isinstance(value, Tensor):
            out[name] = value.detach().clone()
        else:
            out[name] = [v.detach().clone() for v in value]
    return out


def _set_state(metric: Metric, state: State, count: int) -> None:
    for name, value in state.items():
        if isinstance(value, Tensor):
            setattr(metric, name, value.to(metric.device))
        else:
            setattr(metric, name, [v.to(metric.device) for v in value])
    metric._update_count = count
    metric._computed = None


class BatchMetrics:
    """Per-batch bookkeeping of a LightningModule's metrics on the last stage."""

    def __init__(self, metrics: dict[str, Metric]) -> None:
        self.metrics = metrics
        self._saved: dict[str, tuple[State, int]] = {}

    def begin(self) -> None:
        """Remember every mergeable metric's running state and start it empty for this batch."""
        self._saved = {}
        for path, metric in self.metrics.items():
            if _mergeable(metric):
                self._saved[path] = (_detach(metric.metric_state), metric._update_count)
                metric.reset()

    def end(self) -> dict[str, State]:
        """Merge the batch back into the running state; returns the batch states of updated metrics."""
        batch: dict[str, State] = {}
        for path, (running, count) in self._saved.items():
            metric = self.metrics[path]
            if metric._update_count == 0:
                _set_state(metric, running, count)
                continue
            batch[path] = _detach(metric.metric_state)
            batch_count = metric._update_count
            forward_cache = metric._forward_cache
            if count:
                _set_state(metric, running, count)
                metric.merge_state(batch[path])
            metric._update_count = count + batch_count
            metric._computed = None
            metric._forward_cache = forward_cache
        self._saved = {}
        return batch


def _copy(metric: Metric) -> Metric:
    """An empty copy of a metric (process groups cannot be deep-copied: detach the group meanwhile)."""
    group = metric.process_group
    metric.process_group = None
    try:
        probe = copy.deepcopy(metric)
    finally:
        metric.process_group = group
    probe.reset()
    return probe


def step_values(metrics: dict[str, Metric], batch_states: list[dict[str, State]]) -> dict[str, Tensor]:
    """The value each metric has on the union of the replicas' batches (what ``forward`` gives on one device)."""
    values: dict[str, Tensor] = {}
    for path in {p for part in batch_states for p in part}:
        parts = [part[path] for part in batch_states if path in part]
        probe = _copy(metrics[path])
        probe.sync_on_compute = probe._to_sync = False  # a local computation: no collective
        _set_state(probe, parts[0], 1)
        for extra in parts[1:]:
            probe.merge_state(extra)
        probe._update_count = len(parts)
        values[path] = probe.compute()
    return values


def export_states(metrics: dict[str, Metric], paths: list[str]) -> dict[str, tuple[State, int, Any]]:
    """Running states (with update counts and step values) of the given metrics, for other stages."""
    out = {}
    for path in paths:
        metric = metrics[path]
        cache = metric._forward_cache
        cache = cache.detach().cpu() if isinstance(cache, Tensor) else cache
        state = {
            k: (v.cpu() if isinstance(v, Tensor) else [x.cpu() for x in v])
            for k, v in _detach(metric.metric_state).items()
        }
        out[path] = (state, metric._update_count, cache)
    return out


def import_states(metrics: dict[str, Metric], states: dict[str, tuple[State, int, Any]]) -> None:
    """Load states exported by the last stage (no-op for metrics already holding them)."""
    for path, (state, count, cache) in states.items():
        metric = metrics[path]
        _set_state(metric, state, count)
        metric._forward_cache = cache.to(metric.device) if isinstance(cache, Tensor) else cache


def use_group(metrics: dict[str, Metric], group: Any) -> None:
    """Synchronise every metric over ``group`` (the data-parallel group) when it computes."""
    for metric in metrics.values():
        metric.process_group = group


def set_step_values(metrics: dict[str, Metric], values: dict[str, Tensor]) -> None:
    for path, value in values.items():
        metrics[path]._forward_cache = value.to(metrics[path].device) if isinstance(value, torch.Tensor) else value
