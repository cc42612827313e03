"""torchmetrics under pipeline parallelism: batch states merged into running states, step values over replicas,
state export / import between stages."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MaxMetric, MeanMetric, Metric, SumMetric
from torchmetrics.classification import BinaryAccuracy

from lightning_3d.core.metric_sync import (
    BatchMetrics,
    export_states,
    import_states,
    set_step_values,
    step_values,
    use_group,
)


class LastValue(Metric):
    """A metric whose state cannot be merged (full_state_update=True)."""

    full_state_update = True

    def __init__(self) -> None:
        super().__init__()
        self.add_state("last", torch.tensor(0.0), dist_reduce_fx="max")

    def update(self, x: torch.Tensor) -> None:
        self.last = x[-1].float()

    def compute(self) -> torch.Tensor:
        return self.last


def test_batch_state_is_merged_into_the_running_state() -> None:
    mean, total = MeanMetric(), SumMetric()
    mean.update(torch.tensor([1.0, 2.0]))
    total.update(torch.tensor([1.0, 2.0]))
    batch = BatchMetrics({"mean": mean, "total": total})
    batch.begin()
    assert mean._update_count == 0  # this batch starts empty
    for micro in (torch.tensor([3.0]), torch.tensor([4.0, 5.0])):
        mean.update(micro)
        total.update(micro)
    states = batch.end()
    assert float(mean.compute()) == 3.0  # (1 + 2 + 3 + 4 + 5) / 5
    assert float(total.compute()) == 15.0
    assert mean._update_count == 3
    assert float(states["mean"]["mean_value"]) == 12.0 and float(states["mean"]["weight"]) == 3.0


def test_first_batch_has_no_running_state_to_merge() -> None:
    mean = MeanMetric()
    batch = BatchMetrics({"mean": mean})
    batch.begin()
    mean.update(torch.tensor([2.0, 4.0]))
    batch.end()
    assert float(mean.compute()) == 3.0 and mean._update_count == 1


def test_metric_not_updated_in_the_batch_keeps_its_running_state() -> None:
    idle = MeanMetric()
    idle.update(torch.tensor([10.0, 20.0]))
    batch = BatchMetrics({"idle": idle})
    batch.begin()
    states = batch.end()
    assert states == {}
    assert float(idle.compute()) == 15.0 and idle._update_count == 1


def test_forward_value_of_the_batch_survives_the_merge() -> None:
    mean = MeanMetric()
    mean.update(torch.tensor([100.0]))
    batch = BatchMetrics({"mean": mean})
    batch.begin()
    step_value = mean(torch.tensor([1.0, 3.0]))  # forward: this batch's value, cached for logging
    batch.end()
    assert float(step_value) == 2.0
    assert float(mean._forward_cache) == 2.0
    assert float(mean.compute()) == pytest.approx((100.0 + 1.0 + 3.0) / 3)


def test_unmergeable_metrics_are_left_alone() -> None:
    last = LastValue()
    last.update(torch.tensor([1.0, 7.0]))
    batch = BatchMetrics({"last": last})
    batch.begin()
    assert last._update_count == 1  # not reset
    last.update(torch.tensor([9.0]))
    assert batch.end() == {}
    assert float(last.compute()) == 9.0


def test_step_values_cover_the_union_of_the_replicas_batches() -> None:
    acc = BinaryAccuracy()
    mean = MeanMetric()
    replicas = [
        (torch.tensor([1, 1, 0]), torch.tensor([1, 0, 0]), torch.tensor([1.0, 2.0])),
        (torch.tensor([1]), torch.tensor([1]), torch.tensor([6.0])),
    ]
    batch_states = []
    for preds, target, values in replicas:
        running = BatchMetrics({"acc": acc, "mean": mean})
        running.begin()
        acc.update(preds, target)
        mean.update(values)
        batch_states.append(running.end())
        acc.reset()
        mean.reset()
    values = step_values({"acc": acc, "mean": mean}, batch_states)
    assert float(values["acc"]) == 0.75  # 3 of 4 predictions right over both replicas
    assert float(values["mean"]) == 3.0  # (1 + 2 + 6) / 3
    assert acc._update_count == 0  # computed on a copy


def test_step_values_with_a_metric_updated_on_one_replica_only() -> None:
    mean = MeanMetric()
    states = [{}, {"mean": {"mean_value": torch.tensor(8.0), "weight": torch.tensor(2.0)}}]
    assert float(step_values({"mean": mean}, states)["mean"]) == 4.0


def test_export_and_import_make_another_stage_hold_the_same_state() -> None:
    last_stage = {"mean": MeanMetric(), "max": MaxMetric()}
    for metric in last_stage.values():
        metric(torch.tensor([1.0, 5.0]))
        metric(torch.tensor([3.0]))
    exported = export_states(last_stage, ["mean", "max"])
    other_stage = {"mean": MeanMetric(), "max": MaxMetric()}
    import_states(other_stage, exported)
    assert float(other_stage["mean"].compute()) == 3.0
    assert float(other_stage["max"].compute()) == 5.0
    assert other_stage["mean"]._update_count == 2
    assert float(other_stage["mean"]._forward_cache) == 3.0  # the last step's value
    other_stage["mean"].update(torch.tensor([7.0]))  # and it keeps accumulating from there
    assert float(other_stage["mean"].compute()) == 4.0


def test_exported_states_are_detached_copies() -> None:
    mean = MeanMetric()
    mean.update(torch.tensor([2.0]))
    exported = export_states({"m": mean}, ["m"])
    mean.update(torch.tensor([4.0]))
    assert float(exported["m"][0]["mean_value"]) == 2.0


def test_use_group_and_set_step_values() -> None:
    metrics = {"a": MeanMetric(), "b": SumMetric()}
    group = object()
    use_group(metrics, group)
    assert all(m.process_group is group for m in metrics.values())
    set_step_values(metrics, {"a": torch.tensor(1.25)})
    assert float(metrics["a"]._forward_cache) == 1.25
