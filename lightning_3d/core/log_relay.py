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
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torchmetrics import Metric

_REDUCE_FX = {"mean", "sum", "max", "min"}
_DROPPED_KWARGS = {"sync_dist", "sync_dist_group", "batch_size"}


Number = float | torch.Tensor  # a logged value: a Python number, or a float64 scalar tensor on the step's device


@dataclass
class _Entry:
    reduce_fx: str
    kwargs: dict[str, Any]
    dtype: torch.dtype | None
    total: Number = 0.0  # weighted sum (mean), sum, or extreme; a device tensor for tensor values (never read here)
    weight: float = 0.0
    metric: str | None = None  # attribute path of a Metric, for metric entries
    value_of: str | None = None  # a tensor that Metric's forward returned: logged as its value over the batch


def _combine(reduce_fx: str, a: Number, b: Number) -> Number:
    """``a`` and ``b`` combined by ``reduce_fx`` (``"mean"`` adds weighted sums), without reading a tensor."""
    if reduce_fx in ("mean", "sum"):
        return a + b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        like = a if isinstance(a, torch.Tensor) else b
        assert isinstance(like, torch.Tensor)
        ta, tb = (torch.as_tensor(v, dtype=torch.float64, device=like.device) for v in (a, b))
        return torch.maximum(ta, tb) if reduce_fx == "max" else torch.minimum(ta, tb)
    return max(a, b) if reduce_fx == "max" else min(a, b)


def _weighted(number: Number, weight: torch.Tensor) -> torch.Tensor:
    """``number * weight``, 0 where ``weight`` is 0 (a mean over no label tokens is NaN, and counts for nothing)."""
    weight = weight.to(torch.float64)
    return torch.where(weight != 0, number * weight, torch.zeros_like(weight))


def _host(value: Number) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


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
    loss_total: Number = 0.0  # sum of the micro-batches' losses times their samples (a device tensor once recorded)
    loss_weight: float = 0.0
    loss_dtype: torch.dtype | None = None
    metric_batch: dict[str, Any] = field(default_factory=dict)  # batch states of updated metrics
    stop: bool = False  # the step set ``trainer.should_stop`` (code after the model call runs on the last stage only)

    def add(
        self,
        name: str,
        value: Any,
        kwargs: dict[str, Any],
        samples: int,
        metric_path: str | None,
        value_of: str | None = None,
        count_as: torch.Tensor | None = None,
    ) -> None:
        """Record one ``self.log`` call of one micro-batch (``samples`` samples).

        A tensor value stays a tensor on its device (a float64 scalar): combining it with earlier micro-batches
        is tensor arithmetic, so recording never waits for the device. ``value_of``: the tensor is what that
        Metric's ``forward`` returned for the micro-batch (its value over the whole batch replaces the combination
        when the metric's batch state is known, see :func:`replay`). ``count_as``: a mean's weight in this
        micro-batch's place in the combination (its label tokens' share, ``core/loss_weights.py``; 0 drops a NaN
        of a micro-batch without labels); ``weight``, the samples Lightning averages batches by, stays.
        """
        reduce_fx = _reduce_name(kwargs.get("reduce_fx", "mean"))
        weight = float(kwargs.get("batch_size") or samples)
        clean = {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}
        if metric_path is not None:
            self.entries.setdefault(name, _Entry(reduce_fx, clean, None, metric=metric_path))
            self.entries[name].weight += weight
            return
        number: Number
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars.")
            dtype, number = value.dtype, value.detach().reshape(()).to(torch.float64)
        else:
            dtype, number = None, float(value)
        if reduce_fx == "mean":
            number = number * weight if count_as is None else _weighted(number, count_as)
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = _Entry(reduce_fx, clean, dtype, number, weight, value_of=value_of)
            return
        entry.weight += weight
        entry.total = _combine(reduce_fx, entry.total, number)
        if entry.value_of != value_of:  # not the same metric's output in every micro-batch
            entry.value_of = None

    def add_loss(self, loss: torch.Tensor, samples: int, count_as: torch.Tensor | None = None) -> None:
        """Record one micro-batch's loss (weighted by its samples, or by ``count_as`` in their place: its label
        tokens' share, ``core/loss_weights.py``; kept on the device)."""
        number = loss.detach().reshape(()).to(torch.float64)
        self.loss_total = self.loss_total + (number * samples if count_as is None else _weighted(number, count_as))
        self.loss_weight += samples
        self.loss_dtype = loss.dtype

    def loss(self, device: torch.device) -> torch.Tensor:
        """The batch's mean loss as a tensor on ``device`` in the loss's dtype (no host synchronisation)."""
        dtype = self.loss_dtype or torch.get_default_dtype()
        mean = self.loss_total / max(self.loss_weight, 1.0)
        if isinstance(mean, torch.Tensor):
            return mean.to(device=device, dtype=dtype)
        return torch.tensor(mean, dtype=dtype, device=device)

    def to_host(self) -> StepLogs:
        """A copy with every value a Python number (for the object relay: pickled tensors would keep their device)."""
        entries = {n: dataclasses.replace(e, total=_host(e.total)) for n, e in self.entries.items()}
        return dataclasses.replace(self, entries=entries, loss_total=_host(self.loss_total))


def merge(parts: list[StepLogs]) -> StepLogs:
    """Combine the logs of several data-parallel replicas (in replica order)."""
    out = StepLogs()
    for part in parts:
        out.loss_total = out.loss_total + part.loss_total
        out.loss_weight += part.loss_weight
        out.loss_dtype = out.loss_dtype or part.loss_dtype
        out.stop = out.stop or part.stop
        for name, entry in part.entries.items():
            mine = out.entries.get(name)
            if mine is None:
                out.entries[name] = copy.copy(entry)
                continue
            mine.weight += entry.weight
            mine.total = _combine(entry.reduce_fx, mine.total, entry.total)
    return out


class LogRecorder:
    """Captures a LightningModule's ``self.log`` calls (including through ``log_dict``) into ``StepLogs``."""

    def __init__(self, module: LightningModule, logs: StepLogs) -> None:
        self.module = module
        self.logs = logs
        self.samples = 0
        self._metrics = {n: m for n, m in module.named_modules() if isinstance(m, Metric)}
        self._metric_paths = {id(m): n for n, m in self._metrics.items()}
        self._outputs: dict[int, str] = {}  # id of a tensor a Metric's forward returned -> the metric's path
        self.count_as: torch.Tensor | None = None  # the micro-batch's label-token weight (see StepLogs.add)

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        path = None
        if isinstance(value, Metric):
            path = kwargs.get("metric_attribute") or self._metric_paths.get(id(value))
            if path is None:
                raise ValueError(f"self.log({name!r}, metric): the Metric must be an attribute of the LightningModule.")
        value_of = self._outputs.get(id(value)) if isinstance(value, torch.Tensor) else None
        count_as = self.count_as if kwargs.get("batch_size") is None else None  # a batch_size given: as it says
        self.logs.add(name, value, kwargs, self.samples, path, value_of=value_of, count_as=count_as)

    def _remember(self, metric: Metric, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self._outputs[id(output)] = self._metric_paths[id(metric)]

    @contextlib.contextmanager
    def recording(self, samples: int, count_as: torch.Tensor | None = None) -> Iterator[None]:
        """Record the module's ``self.log`` calls of one micro-batch of ``samples`` samples; a tensor its metrics'
        ``forward`` returned (``self.log("f1", self.f1(preds, y))``, ``self.log_dict(collection(preds, y))``) is
        remembered as that metric's, whose value over the batch is then logged (a macro F1 is not the mean of the
        micro-batches' F1s). ``count_as``: under label-token weighting, what the means logged without a
        ``batch_size`` count for in the batch's (a token mean, as the loss's)."""
        self.samples, self.count_as = samples, count_as
        self.module.__dict__["log"] = self._log
        handles = [metric.register_forward_hook(self._remember) for metric in self._metrics.values()]
        try:
            yield
        finally:
            self.module.__dict__.pop("log", None)
            for handle in handles:
                handle.remove()
            self._outputs.clear()


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


# ---------------------------------------------------------------------------------------------- tensor relay
@dataclass(frozen=True)
class Schema:
    """Everything about one replica's logs of a batch except the values: keys, their settings and weights.

    While it stays the same from batch to batch (the usual case: the same ``self.log`` calls every step), the
    values alone cross ranks, as one tensor (``pack`` / ``unpack``).
    """

    entries: tuple[tuple[str, str, tuple[tuple[str, Any], ...], torch.dtype | None, float], ...]
    loss_weight: float
    loss_dtype: torch.dtype | None

    @property
    def width(self) -> int:
        """Values per replica: the loss, then one per entry."""
        return 1 + len(self.entries)


def schema_of(logs: StepLogs) -> Schema | None:
    """The schema of one replica's logs (``None`` when metrics were logged: those go by state, not value)."""
    if any(e.metric is not None for e in logs.entries.values()):
        return None
    return Schema(
        tuple((n, e.reduce_fx, tuple(e.kwargs.items()), e.dtype, e.weight) for n, e in logs.entries.items()),
        logs.loss_weight,
        logs.loss_dtype,
    )


def pack(logs: StepLogs, device: torch.device) -> torch.Tensor:
    """The values of ``logs`` as one float64 vector on ``device`` (loss first, then the entries in order)."""
    values = [logs.loss_total, *(e.total for e in logs.entries.values())]
    out = torch.empty(len(values), dtype=torch.float64, device=device)
    for i, value in enumerate(values):
        # a tensor: a device-side copy; a Python number: a fill (never a host-to-device copy, which waits on CUDA)
        out[i] = value.to(device) if isinstance(value, torch.Tensor) else value
    return out


def unpack(rows: torch.Tensor, schema: Schema) -> StepLogs:
    """The logs of every replica combined, from their packed values (``rows``: one row per replica)."""
    replicas = rows.shape[0]
    # every column summed in one kernel (one replica: its row as it is); max / min columns reduced on their own
    totals = (rows[0] if replicas == 1 else rows.sum(0)).unbind(0)
    out = StepLogs(loss_total=totals[0], loss_weight=schema.loss_weight * replicas, loss_dtype=schema.loss_dtype)
    for i, (name, reduce_fx, kwargs, dtype, weight) in enumerate(schema.entries, start=1):
        total = totals[i]
        if reduce_fx not in ("mean", "sum") and replicas > 1:
            total = rows[:, i].amax() if reduce_fx == "max" else rows[:, i].amin()
        out.entries[name] = _Entry(reduce_fx, dict(kwargs), dtype, total, weight * replicas)
    return out


@dataclass
class PackedRelay:
    """``self.log`` values (and a few flags) to every rank with ONE all-reduce per batch and one read of its head.

    Every rank contributes a vector ``[changed, stop, flags..., replica 0's values, replica 1's values, ...]`` to a
    SUM all-reduce over all ranks: one rank per data-parallel replica (the last stage's tensor-parallel rank 0)
    writes its replica's values in its row, every other entry is zero, so the sum is a gather. The layout of a
    row is the schema cached from an earlier batch (``schemas``, the same on every rank); a contributor whose logs
    do not fit it sets ``changed`` and the caller falls back to the object relay for that batch (``relay``), then
    caches the new schema. ``stop`` (the step set ``trainer.should_stop``: ``StepLogs.stop``) and the flags (e.g.
    per-stage non-finite gradients) are summed over every rank.

    Reading ``[changed, stop, flags...]`` is the batch's one host synchronisation; the values stay on the device.
    """

    schemas: dict[str, Schema | None] = field(default_factory=dict)

    def exchange(
        self,
        key: str,
        logs: StepLogs | None,
        flags: torch.Tensor | None,
        *,
        contributor: bool,
        replica: int,
        replicas: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        n_flags: int,
    ) -> tuple[StepLogs | None, list[float]]:
        """One batch's exchange.

        Args:
            key: which cached schema to use (the hook's name).
            logs: this rank's logs (last stage) or ``None``.
            flags: this rank's ``n_flags`` flags (summed over ranks) or ``None`` (zeros).
            contributor: whether this rank writes its replica's values.
            replica: this rank's data-parallel index; replicas: the data-parallel size.
            group: the group of every rank (``None``: this rank alone, no communication).
            device: where the vector lives (the group's device).
            n_flags: number of flags (the same on every rank).

        Returns:
            The combined logs (``None`` when the schema changed: use the object relay and ``remember``) with
            ``stop`` set when any rank's step set it, and the summed flags, read on the host.
        """
        schema = self.schemas.get(key)
        width = schema.width if schema is not None else 0
        head = 2 + n_flags
        vector = torch.zeros(head + replicas * width, dtype=torch.float64, device=device)
        if logs is not None and logs.stop:
            vector[1] = 1.0
        if flags is not None:
            vector[2:head] = flags.to(device=device, dtype=torch.float64)
        if contributor:
            assert logs is not None
            if schema is not None and schema_of(logs) == schema:
                start = head + replica * width
                vector[start : start + width] = pack(logs, device)
            else:
                vector[0] = 1.0
        if group is not None:
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
        head_values = vector[:head].tolist()  # the one host synchronisation of the batch
        if head_values[0] or schema is None:
            return None, head_values[2:]
        combined = unpack(vector[head:].view(replicas, width), schema)
        combined.stop = head_values[1] > 0
        return combined, head_values[2:]

    def remember(self, key: str, parts_schema: Schema | None) -> None:
        """After an object relay: the schema every replica had (``None``: they differed, or metrics)."""
        self.schemas[key] = parts_schema


def common_schema(parts: list[StepLogs]) -> Schema | None:
    """The schema all replicas' logs share, or ``None``."""
    first = schema_of(parts[0]) if parts else None
    return first if all(schema_of(p) == first for p in parts[1:]) else None  # compared, never hashed


def replay(
    module: LightningModule, logs: StepLogs, metrics: dict[str, Metric], values: Mapping[str, Any] | None = None
) -> None:
    """Log the combined values through the real ``LightningModule.log`` (no further syncing; tensors stay on
    the device until Lightning reads them). ``values``: the metrics' values over the batch (all replicas), which
    replace the combination of a logged tensor their ``forward`` returned."""
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
        batch_value = None if values is None or entry.value_of is None else values.get(entry.value_of)
        if isinstance(batch_value, torch.Tensor) and batch_value.numel() == 1:
            value = batch_value.reshape(())
        if isinstance(value, torch.Tensor):
            dtype = entry.dtype or torch.get_default_dtype()
            LightningModule.log(module, name, value.to(device=module.device, dtype=dtype), **kwargs)
        elif entry.dtype is None:
            LightningModule.log(module, name, value, **kwargs)
        else:
            LightningModule.log(module, name, torch.tensor(value, dtype=entry.dtype, device=module.device), **kwargs)
