"""Relaying ``self.log`` from the last pipeline stage to every rank.

Under pipeline parallelism only the last stage runs the user's step (once per micro-batch), but loggers,
the progress bar and callbacks read global rank 0, a first-stage rank. So the user's ``self.log`` calls are
recorded on the last stage, combined over micro-batches and data-parallel replicas into the value that
single-device training of the whole global batch would log, sent to every stage, and replayed there through
the real ``LightningModule.log`` inside the same hook. Every rank then logs the same keys in the same
order: no rank waits on a collective for a key another rank did not log.

How values combine follows the key's ``reduce_fx`` (the same convention Lightning uses across ranks):
``"mean"`` weights each micro-batch by its number of samples (or the ``batch_size`` given to ``self.log``),
``"sum"``, ``"max"`` and ``"min"`` do what they say. torchmetrics ``Metric`` objects are handled by state:
the last stage's metric state is copied to every stage after each step and metrics synchronise over the
data-parallel group only, so each ``compute()`` counts every sample once.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torchmetrics import Metric

_REDUCE_FX = {"mean", "sum", "max", "min"}
_DROPPED_KWARGS = {"sync_dist", "sync_dist_group", "batch_size"}


@dataclass
class _Entry:
    reduce_fx: str
    kwargs: dict[str, Any]
    dtype: torch.dtype | None
    total: float = 0.0  # weighted sum (mean), sum, or extreme
    weight: float = 0.0
    metric: str | None = None  # attribute path of a Metric, for metric entries


def _reduce_name(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str) and reduce_fx in _REDUCE_FX:
        return reduce_fx
    names = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}
    if reduce_fx in names:
        return names[reduce_fx]
    raise ValueError(
        f"self.log(reduce_fx={reduce_fx!r}) is not supported under ThreeDStrategy: use 'mean', 'sum', 'max' or 'min'."
    )


@dataclass
class StepLogs:
    """The ``self.log`` calls of one batch on the last stage, combined over its micro-batches."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    loss_total: float = 0.0
    loss_weight: float = 0.0
    loss_dtype: torch.dtype | None = None
    metric_batch: dict[str, Any] = field(default_factory=dict)  # batch states of updated metrics

    def add(self, name: str, value: Any, kwargs: dict[str, Any], samples: int, metric_path: str | None) -> None:
        reduce_fx = _reduce_name(kwargs.get("reduce_fx", "mean"))
        weight = float(kwargs.get("batch_size") or samples)
        clean = {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}
        if metric_path is not None:
            self.entries.setdefault(name, _Entry(reduce_fx, clean, None, metric=metric_path))
            self.entries[name].weight += weight
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars.")
            dtype, number = value.dtype, float(value.detach().double().item())
        else:
            dtype, number = None, float(value)
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(reduce_fx, clean, dtype)
            entry.total = number * weight if reduce_fx == "mean" else number
            entry.weight = weight
            return
        entry.weight += weight
        if reduce_fx == "mean":
            entry.total += number * weight
        elif reduce_fx == "sum":
            entry.total += number
        elif reduce_fx == "max":
            entry.total = max(entry.total, number)
        else:
            entry.total = min(entry.total, number)

    def add_loss(self, loss: torch.Tensor, samples: int) -> None:
        self.loss_total += float(loss.detach().double().item()) * samples
        self.loss_weight += samples
        self.loss_dtype = loss.dtype


def merge(parts: list[StepLogs]) -> StepLogs:
    """Combine the logs of several data-parallel replicas (in replica order)."""
    out = StepLogs()
    for part in parts:
        out.loss_total += part.loss_total
        out.loss_weight += part.loss_weight
        out.loss_dtype = out.loss_dtype or part.loss_dtype
        for name, entry in part.entries.items():
            mine = out.entries.get(name)
            if mine is None:
                out.entries[name] = copy.copy(entry)
                continue
            mine.weight += entry.weight
            if entry.reduce_fx in ("mean", "sum"):
                mine.total += entry.total
            elif entry.reduce_fx == "max":
                mine.total = max(mine.total, entry.total)
            else:
                mine.total = min(mine.total, entry.total)
    return out


class LogRecorder:
    """Captures a LightningModule's ``self.log`` calls (including through ``log_dict``) into ``StepLogs``."""

    def __init__(self, module: LightningModule, logs: StepLogs) -> None:
        self.module = module
        self.logs = logs
        self.samples = 0
        self._metric_paths = {id(m): n for n, m in module.named_modules() if isinstance(m, Metric)}

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        path = None
        if isinstance(value, Metric):
            path = kwargs.get("metric_attribute") or self._metric_paths.get(id(value))
            if path is None:
                raise ValueError(f"self.log({name!r}, metric): the Metric must be an attribute of the LightningModule.")
        self.logs.add(name, value, kwargs, self.samples, path)

    @contextlib.contextmanager
    def recording(self, samples: int) -> Iterator[None]:
        self.samples = samples
        self.module.__dict__["log"] = self._log
        try:
            yield
        finally:
            self.module.__dict__.pop("log", None)


@contextlib.contextmanager
def silenced(module: LightningModule) -> Iterator[None]:
    """Drop ``self.log`` calls (used while only the body's input is being captured)."""
    module.__dict__["log"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def relay(
    logs: StepLogs | None,
    *,
    dp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    last_stage_rank: int,
    finish: Callable[[list[StepLogs]], Any] | None = None,
) -> tuple[StepLogs, Any]:
    """Combine the last stage's logs over data parallelism and send them to every stage.

    Args:
        logs: this rank's logs (last stage) or ``None`` (other stages).
        dp_group: data-parallel group (``None`` when dp == 1); used only by last-stage ranks.
        pp_group: pipeline group (``None`` when pp == 1).
        last_stage_rank: global rank of the last stage in this rank's pipeline group.
        finish: called on the last stage with every replica's logs; what it returns is sent along.

    Returns:
        The combined logs and ``finish``'s result, identical on every rank of the pipeline.
    """
    extra = None
    if logs is not None:
        parts = [logs]
        if dp_group is not None:
            gathered: list[StepLogs | None] = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(gathered, logs, group=dp_group)
            parts = [p for p in gathered if p is not None]
        logs = merge(parts)
        extra = finish(parts) if finish is not None else None
    if pp_group is not None:
        payload = [(logs, extra)]
        dist.broadcast_object_list(payload, src=last_stage_rank, group=pp_group)
        logs, extra = payload[0]
    assert logs is not None
    return logs, extra


def replay(module: LightningModule, logs: StepLogs, metrics: dict[str, Metric]) -> None:
    """Log the combined values through the real ``LightningModule.log`` (no further syncing)."""
    for name, entry in logs.entries.items():
        kwargs = dict(entry.kwargs)
        kwargs["reduce_fx"] = entry.reduce_fx
        kwargs["sync_dist"] = False
        kwargs["batch_size"] = max(1, round(entry.weight))
        if entry.metric is not None:
            kwargs["metric_attribute"] = entry.metric
            LightningModule.log(module, name, metrics[entry.metric], **kwargs)
            continue
        value = entry.total / entry.weight if entry.reduce_fx == "mean" else entry.total
        if entry.dtype is None:
            LightningModule.log(module, name, value, **kwargs)
        else:
            LightningModule.log(module, name, torch.tensor(value, dtype=entry.dtype, device=module.device), **kwargs)
