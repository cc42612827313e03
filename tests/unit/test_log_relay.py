"""Combining ``self.log`` values over micro-batches and data-parallel replicas, recording and replaying them."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torchmetrics import MaxMetric, MeanMetric

from lightning_3d.core.log_relay import LogRecorder, StepLogs, merge, relay, replay, silenced


def logs_of(calls: list[tuple[str, Any, dict[str, Any], int]]) -> StepLogs:
    """Logs of one rank: ``(name, value, kwargs, samples)`` per self.log call, in micro-batch order."""
    logs = StepLogs()
    for name, value, kwargs, samples in calls:
        logs.add(name, value, kwargs, samples, None)
    return logs


def value(logs: StepLogs, name: str) -> float:
    entry = logs.entries[name]
    return entry.total / entry.weight if entry.reduce_fx == "mean" else entry.total


# ------------------------------------------------------------------------------------ one rank, micro-batches
def test_mean_is_weighted_by_micro_batch_samples() -> None:
    logs = logs_of([("acc", torch.tensor(1.0), {}, 3), ("acc", torch.tensor(5.0), {}, 1)])
    assert value(logs, "acc") == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)  # 2.0, not the plain mean 3.0
    assert logs.entries["acc"].weight == 4


def test_batch_size_given_to_log_overrides_the_sample_count() -> None:
    logs = logs_of([("tok", 2.0, {"batch_size": 10}, 2), ("tok", 4.0, {"batch_size": 30}, 2)])
    assert value(logs, "tok") == pytest.approx((10 * 2.0 + 30 * 4.0) / 40)
    assert logs.entries["tok"].weight == 40


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [("sum", 9.0), ("max", 5.0), ("min", 1.0), (torch.sum, 9.0), (torch.max, 5.0), (torch.min, 1.0)],
)
def test_sum_max_min_over_micro_batches(reduce_fx: object, expected: float) -> None:
    calls = [("x", v, {"reduce_fx": reduce_fx}, n) for v, n in ((3.0, 2), (5.0, 1), (1.0, 4))]
    assert value(logs_of(calls), "x") == expected


def test_torch_mean_is_mean() -> None:
    logs = logs_of([("x", 1.0, {"reduce_fx": torch.mean}, 1), ("x", 4.0, {"reduce_fx": torch.mean}, 2)])
    assert logs.entries["x"].reduce_fx == "mean"
    assert value(logs, "x") == pytest.approx(3.0)


def test_unsupported_reduce_fx() -> None:
    with pytest.raises(ValueError, match=r"reduce_fx=.*is not supported under ThreeDStrategy"):
        StepLogs().add("x", 1.0, {"reduce_fx": "median"}, 1, None)


def test_non_scalar_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"self.log\('x', ...\) got a tensor of shape \(2,\); log scalars"):
        StepLogs().add("x", torch.zeros(2), {}, 1, None)


def test_dtype_kept_for_tensors_and_none_for_numbers() -> None:
    logs = logs_of([("t", torch.tensor(1.0, dtype=torch.float64), {}, 1), ("n", 3, {}, 1)])
    assert logs.entries["t"].dtype == torch.float64
    assert logs.entries["n"].dtype is None


def test_sync_and_batch_size_kwargs_are_dropped_the_rest_kept() -> None:
    kwargs = {"prog_bar": True, "on_step": True, "sync_dist": True, "sync_dist_group": None, "batch_size": 4}
    logs = logs_of([("x", 1.0, kwargs, 4)])
    assert logs.entries["x"].kwargs == {"prog_bar": True, "on_step": True}


def test_loss_is_weighted_by_samples() -> None:
    logs = StepLogs()
    logs.add_loss(torch.tensor(2.0, dtype=torch.bfloat16), 3)
    logs.add_loss(torch.tensor(6.0, dtype=torch.bfloat16), 1)
    assert logs.loss_total / logs.loss_weight == pytest.approx(3.0)
    assert logs.loss_dtype == torch.bfloat16


# ------------------------------------------------------------------------------------ replicas
def test_merge_over_replicas_equals_one_rank_seeing_every_micro_batch() -> None:
    calls_a = [("m", 1.0, {}, 2), ("s", 1.0, {"reduce_fx": "sum"}, 2), ("hi", 7.0, {"reduce_fx": "max"}, 2)]
    calls_b = [("m", 4.0, {}, 1), ("s", 2.5, {"reduce_fx": "sum"}, 1), ("hi", 9.0, {"reduce_fx": "max"}, 1)]
    calls_c = [("m", 0.0, {}, 3), ("s", 0.5, {"reduce_fx": "sum"}, 3), ("hi", 8.0, {"reduce_fx": "max"}, 3)]
    merged = merge([logs_of(calls_a), logs_of(calls_b), logs_of(calls_c)])
    assert value(merged, "m") == pytest.approx((2 * 1.0 + 1 * 4.0 + 3 * 0.0) / 6)
    assert value(merged, "s") == pytest.approx(4.0)
    assert value(merged, "hi") == 9.0
    assert merged.entries["m"].weight == 6
    single = logs_of(calls_a + calls_b + calls_c)
    for name in ("m", "s", "hi"):
        assert value(merged, name) == pytest.approx(value(single, name))


def test_merge_min_and_loss() -> None:
    a, b = logs_of([("lo", 3.0, {"reduce_fx": "min"}, 1)]), logs_of([("lo", -2.0, {"reduce_fx": "min"}, 1)])
    a.add_loss(torch.tensor(1.0), 2)
    b.add_loss(torch.tensor(4.0), 2)
    merged = merge([a, b])
    assert value(merged, "lo") == -2.0
    assert merged.loss_total / merged.loss_weight == pytest.approx(2.5)
    assert merged.loss_dtype == torch.float32


def test_merge_keeps_keys_logged_on_one_replica_only() -> None:
    merged = merge([logs_of([("a", 1.0, {}, 1)]), logs_of([("b", 2.0, {}, 1)])])
    assert list(merged.entries) == ["a", "b"]


def test_merge_stops_when_any_replica_asked() -> None:
    """``trainer.should_stop`` set by one replica's step stops every rank (``StepLogs.stop``)."""
    asked = dataclasses.replace(logs_of([("a", 1.0, {}, 1)]), stop=True)
    assert merge([logs_of([("a", 1.0, {}, 1)]), asked]).stop
    assert not merge([logs_of([("a", 1.0, {}, 1)]), logs_of([("a", 2.0, {}, 1)])]).stop
    assert asked.to_host().stop  # and it survives the object relay's copy


def test_merge_does_not_modify_its_inputs() -> None:
    a, b = logs_of([("m", 1.0, {}, 2)]), logs_of([("m", 3.0, {}, 2)])
    before = copy.deepcopy((a.entries["m"], b.entries["m"]))
    merge([a, b])
    assert (a.entries["m"], b.entries["m"]) == before


# ------------------------------------------------------------------------------------ recording
class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.metric = MeanMetric()

    def step(self, x: torch.Tensor) -> None:
        self.log("mean_x", x.mean())
        self.log_dict({"first": x[0], "count": float(len(x))}, reduce_fx="sum")
        self.metric.update(x)
        self.log("metric", self.metric)


def test_recorder_captures_log_and_log_dict_then_restores_log() -> None:
    module = Module()
    logs = StepLogs()
    recorder = LogRecorder(module, logs)
    with recorder.recording(3):
        module.step(torch.tensor([1.0, 2.0, 3.0]))
    with recorder.recording(1):
        module.step(torch.tensor([7.0]))
    assert "log" not in module.__dict__  # the real LightningModule.log is back
    assert list(logs.entries) == ["mean_x", "first", "count", "metric"]
    assert value(logs, "mean_x") == pytest.approx((3 * 2.0 + 1 * 7.0) / 4)  # the mean over the 4 samples
    assert value(logs, "first") == 8.0 and value(logs, "count") == 4.0
    metric = logs.entries["metric"]
    assert metric.metric == "metric" and metric.weight == 4


def test_recorder_refuses_a_metric_that_is_not_an_attribute() -> None:
    module = Module()
    recorder = LogRecorder(module, StepLogs())
    with recorder.recording(1), pytest.raises(ValueError, match="the Metric must be an attribute"):
        module.log("loose", MeanMetric())


def test_silenced_drops_logs() -> None:
    module = Module()
    logs = StepLogs()
    recorder = LogRecorder(module, logs)
    with silenced(module), warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's log warns when the module has no trainer: it must not run
        module.log("x", 1.0)
    assert "log" not in module.__dict__
    with recorder.recording(1):
        module.log("y", 1.0)
    assert list(logs.entries) == ["y"]


# ------------------------------------------------------------------------------------ relay and replay
def test_relay_without_groups_merges_and_finishes() -> None:
    logs = logs_of([("m", 2.0, {}, 2)])
    seen: list[list[StepLogs]] = []

    def finish(parts: list[StepLogs]) -> str:
        seen.append(parts)
        return "extra"

    out, extra = relay(logs, dp_group=None, pp_group=None, last_stage_rank=0, finish=finish)
    assert extra == "extra" and seen == [[logs]]
    assert value(out, "m") == 2.0 and out is not logs


def test_relay_through_single_rank_groups(gloo_world: dist.ProcessGroup) -> None:
    logs = logs_of([("m", 2.0, {"prog_bar": True}, 2), ("s", 1.0, {"reduce_fx": "sum"}, 2)])
    logs.add_loss(torch.tensor(0.5), 2)
    out, extra = relay(logs, dp_group=gloo_world, pp_group=gloo_world, last_stage_rank=0, finish=len)
    assert extra == 1
    assert out.entries == logs.entries and out.loss_total == logs.loss_total


def test_replay_logs_the_combined_values(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any, dict[str, Any]]] = []
    monkeypatch.setattr(LightningModule, "log", lambda self, name, v, **kw: calls.append((name, v, kw)))
    module = Module()
    logs = merge(
        [
            logs_of([("m", torch.tensor(1.0, dtype=torch.float64), {"prog_bar": True}, 3), ("n", 2, {}, 3)]),
            logs_of([("m", torch.tensor(3.0, dtype=torch.float64), {"prog_bar": True}, 1), ("n", 6, {}, 1)]),
        ]
    )
    logs.add("metric", module.metric, {"on_epoch": True}, 4, "metric")
    replay(module, logs, {"metric": module.metric})
    assert [c[0] for c in calls] == ["m", "n", "metric"]
    _, v, kw = calls[0]
    assert isinstance(v, torch.Tensor) and v.dtype == torch.float64 and float(v) == pytest.approx(1.5)
    assert kw == {"prog_bar": True, "reduce_fx": "mean", "sync_dist": False, "batch_size": 4}
    assert calls[1][1] == pytest.approx(3.0) and not isinstance(calls[1][1], torch.Tensor)
    _, v, kw = calls[2]
    assert v is module.metric and kw["metric_attribute"] == "metric" and kw["batch_size"] == 4


class ForwardLogging(LightningModule):
    """Logs what its metric's forward returns (a micro-batch's max), and a tensor derived from it."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = MaxMetric()

    def step(self, x: torch.Tensor) -> None:
        value = self.peak(x)
        self.log("peak", value)
        self.log("peak_x2", value * 2)


def test_a_tensor_a_metrics_forward_returned_is_logged_as_the_metrics_batch_value(monkeypatch) -> None:
    """The micro-batches' maxima 3 and 9 average to 6; the batch's max, 9, is what one device logs."""
    module = ForwardLogging()
    logs = StepLogs()
    recorder = LogRecorder(module, logs)
    for x in (torch.tensor([1.0, 3.0]), torch.tensor([9.0, 2.0])):
        with recorder.recording(2):
            module.step(x)
    assert not module.peak._forward_hooks  # removed after each micro-batch
    assert logs.entries["peak"].value_of == "peak" and logs.entries["peak_x2"].value_of is None
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(LightningModule, "log", lambda self, name, v, **kw: calls.append((name, float(v))))
    replay(module, logs, {}, {"peak": torch.tensor(9.0)})
    assert calls == [("peak", 9.0), ("peak_x2", 12.0)]  # the derived tensor keeps the micro-batches' mean
    calls.clear()
    replay(module, logs, {}, None)  # no batch value known (a metric whose state does not merge): the mean
    assert calls == [("peak", 6.0), ("peak_x2", 12.0)]


# ------------------------------------------------------------------------------------ device tensors, packed relay
def test_tensor_values_stay_tensors_without_a_host_read() -> None:
    from benchmarks.b8_sync import SyncCounter

    logs = StepLogs()
    counter = SyncCounter()
    with counter:
        counter.begin()
        for v, n in ((1.0, 3), (5.0, 1)):
            logs.add("m", torch.tensor(v), {}, n, None)
            logs.add("hi", torch.tensor(v), {"reduce_fx": "max"}, n, None)
            logs.add_loss(torch.tensor(v, requires_grad=True) * 1.0, n)
        counter.end()
    assert counter.per_step() == [0]
    assert isinstance(logs.entries["m"].total, torch.Tensor) and isinstance(logs.loss_total, torch.Tensor)
    assert float(logs.entries["m"].total / logs.entries["m"].weight) == pytest.approx(2.0)
    assert float(logs.entries["hi"].total) == 5.0
    assert float(logs.loss(torch.device("cpu"))) == pytest.approx(2.0) and not logs.loss_total.requires_grad


@pytest.mark.parametrize("replicas", [1, 3])
def test_pack_unpack_equals_merge_over_replicas(replicas: int) -> None:
    from lightning_3d.core.log_relay import pack, schema_of, unpack

    def replica(a: float, b: float, hi: float) -> StepLogs:
        logs = logs_of([("m", torch.tensor(a), {"prog_bar": True}, 2), ("n", b, {"reduce_fx": "sum"}, 2)])
        logs.add("hi", torch.tensor(hi), {"reduce_fx": "max"}, 2, None)
        logs.add("lo", torch.tensor(-hi), {"reduce_fx": "min"}, 2, None)
        logs.add_loss(torch.tensor(a + b), 2)
        return logs

    parts = [replica(1.0, 2.0, 7.0), replica(3.0, 0.5, 9.0), replica(-1.0, 1.0, 8.0)][:replicas]
    schema = schema_of(parts[0])
    assert schema is not None and all(schema_of(p) == schema for p in parts)
    rows = torch.stack([pack(p, torch.device("cpu")) for p in parts])
    out, reference = unpack(rows, schema), merge(parts)
    assert list(out.entries) == list(reference.entries)
    for name in out.entries:
        assert float(value(out, name)) == pytest.approx(float(value(reference, name)))
        assert out.entries[name].weight == reference.entries[name].weight
        assert out.entries[name].kwargs == reference.entries[name].kwargs
    assert float(out.loss_total) == pytest.approx(float(reference.loss_total))
    assert out.loss_weight == reference.loss_weight == 2 * replicas


def test_schema_changes_with_keys_and_weights_and_not_with_values() -> None:
    from lightning_3d.core.log_relay import schema_of

    a = logs_of([("m", torch.tensor(1.0), {}, 2)])
    assert schema_of(a) == schema_of(logs_of([("m", torch.tensor(5.0), {}, 2)]))
    assert schema_of(a) != schema_of(logs_of([("m", torch.tensor(1.0), {}, 3)]))
    assert schema_of(a) != schema_of(logs_of([("x", torch.tensor(1.0), {}, 2)]))
    metric = StepLogs()
    metric.add("metric", None, {}, 1, "metric")
    assert schema_of(metric) is None  # metrics go by state, through the object relay


def test_packed_exchange_alone_and_on_a_schema_change(gloo_world: dist.ProcessGroup) -> None:
    from lightning_3d.core.log_relay import PackedRelay, schema_of

    relay_ = PackedRelay()
    logs = logs_of([("m", torch.tensor(2.0), {}, 2)])
    kwargs = {"replica": 0, "replicas": 1, "group": gloo_world, "device": torch.device("cpu"), "n_flags": 2}
    flags = torch.tensor([0.0, 1.0])
    out, got = relay_.exchange("training_step", logs, flags, contributor=True, **kwargs)
    assert out is None and got == [0.0, 1.0]  # nothing cached yet: the object relay, and the flags came through
    relay_.remember("training_step", schema_of(logs))
    out, got = relay_.exchange("training_step", logs, None, contributor=True, **kwargs)
    assert out is not None and float(value(out, "m")) == pytest.approx(2.0) and got == [0.0, 0.0]
    other = logs_of([("m", torch.tensor(2.0), {}, 2), ("new", 1.0, {}, 2)])
    out, _ = relay_.exchange("training_step", other, None, contributor=True, **kwargs)
    assert out is None  # a new key: the object relay for this batch
    assert not relay_.exchange("training_step", logs, None, contributor=True, **kwargs)[0].stop
    stopping = dataclasses.replace(logs, stop=True)
    out, got = relay_.exchange("training_step", stopping, flags, contributor=False, **kwargs)
    assert out is not None and out.stop and got == [0.0, 1.0]  # a non-contributing last-stage rank (tp > 0) asks too


def test_common_schema_of_replicas() -> None:
    from lightning_3d.core.log_relay import common_schema, schema_of

    a, b = logs_of([("m", torch.tensor(1.0), {"x": [1]}, 2)]), logs_of([("m", torch.tensor(3.0), {"x": [1]}, 2)])
    assert common_schema([a, b]) == schema_of(a)  # unhashable keyword values are fine
    assert common_schema([a, logs_of([("m", torch.tensor(1.0), {"x": [1]}, 1)])]) is None
