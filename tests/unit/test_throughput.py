"""ThroughputMonitor's figures for a job of data-parallel replicas that each span several devices."""

from __future__ import annotations

import pytest
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_3d.core.throughput import ReplicaThroughput, count_by_replica


def _feed(counter: Throughput, steps: int = 3) -> dict[str, float]:
    for i in range(1, steps + 1):  # one batch of 8 samples (64 tokens) per second, 100 model FLOPs per batch
        counter.update(time=float(i), batches=i, samples=8 * i, lengths=64 * i, flops=100)
    return counter.compute()


def test_eight_devices_in_two_replicas_count_each_replica_once() -> None:
    """dp2 x (tp2 x pp2): the job reads 2 batches a second (16 samples), computes 200 FLOPs a second, 25 per
    device. Lightning's own counter (world size 8, as under DDP) says 64 samples, 800 FLOPs, 100 per device."""
    got = _feed(ReplicaThroughput(world_size=8, data_parallel=2, window_size=3, available_flops=50.0))
    assert got["device/samples_per_sec"] == pytest.approx(8.0)  # each device reads its replica's batch
    assert got["samples_per_sec"] == pytest.approx(16.0)
    assert got["batches_per_sec"] == pytest.approx(2.0)
    assert got["items_per_sec"] == pytest.approx(128.0)
    assert got["flops_per_sec"] == pytest.approx(200.0)
    assert got["device/flops_per_sec"] == pytest.approx(25.0)
    assert got["device/mfu"] == pytest.approx(0.5)
    lightning = _feed(Throughput(world_size=8, window_size=3, available_flops=50.0))
    assert lightning["samples_per_sec"] == pytest.approx(64.0) and lightning["device/mfu"] == pytest.approx(2.0)


def test_one_device_per_replica_is_lightnings_own() -> None:
    ours = _feed(ReplicaThroughput(world_size=4, data_parallel=4, window_size=3, available_flops=50.0))
    assert ours == _feed(Throughput(world_size=4, window_size=3, available_flops=50.0))


def test_monitors_get_replica_counters_after_their_setup() -> None:
    monitor = ThroughputMonitor(batch_size_fn=len, window_size=5)
    monitor._throughputs = {"train": Throughput(world_size=8, window_size=5)}  # what its setup made
    assert count_by_replica([monitor, object()], world_size=8, data_parallel=8) == []  # DDP: unchanged
    assert count_by_replica([monitor, object()], world_size=8, data_parallel=2) == [monitor]
    counter = monitor._throughputs["train"]
    assert isinstance(counter, ReplicaThroughput) and counter.data_parallel == 2 and counter.world_size == 8
    assert counter._time.maxlen == 5  # the monitor's own arguments kept
