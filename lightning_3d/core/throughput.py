"""Lightning's ``ThroughputMonitor`` counted as a 3D-parallel job's throughput.

The monitor's ``Throughput`` takes ``trainer.world_size`` for "how many devices share the work", as under DDP,
where each device is a whole replica: global samples per second are a device's times the world size, and the
module's ``flops_per_batch`` (the model's FLOPs on one device's batch) is what each device computes. Under pipeline
and tensor parallelism a replica spans ``tp * pp`` devices, which all read the replica's batch and share its FLOPs:
Lightning's figures counted samples ``tp * pp`` times over and put a whole replica's FLOPs on each device, so its
MFU read ``tp * pp`` times too high. :class:`ReplicaThroughput` counts samples over the replicas and gives each
device its share of the FLOPs; :func:`count_by_replica` swaps it into the monitors after their ``setup``.

This module reads the monitor's private ``_throughputs`` and ``kwargs`` (Lightning 2.6's names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor

_GLOBAL_RATES = ("batches_per_sec", "samples_per_sec", "items_per_sec")  # a device's rate times the devices


class ReplicaThroughput(Throughput):
    """Lightning's ``Throughput`` for ``world_size`` devices in ``data_parallel`` replicas.

    ``samples`` / ``batches`` / ``lengths`` are a device's, which are its replica's; ``flops`` is the model's on
    the replica's batch (``flops_per_batch``), split evenly over the replica's devices.
    """

    def __init__(self, *, world_size: int, data_parallel: int, **kwargs: Any) -> None:
        super().__init__(world_size=world_size, **kwargs)
        self.data_parallel = data_parallel

    def update(self, *, flops: int | float | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        """As ``Throughput.update``, with ``flops`` the replica's (shared by its ``world_size / dp`` devices)."""
        share = None if flops is None else flops * self.data_parallel / self.world_size
        super().update(flops=share, **kwargs)  # type: ignore[arg-type]

    def compute(self) -> dict[str, int | float]:
        """As ``Throughput.compute``; the job's sample rates count each replica once."""
        metrics = dict(super().compute())
        for key in _GLOBAL_RATES:
            if key in metrics:
                metrics[key] = metrics[key] * self.data_parallel / self.world_size
        return metrics


def count_by_replica(callbacks: Sequence[Any], world_size: int, data_parallel: int) -> list[Any]:
    """Give each ``ThroughputMonitor`` among ``callbacks`` :class:`ReplicaThroughput` counters (call after the
    callbacks' ``setup``, before the first batch; the counters it made there are still empty).

    Returns:
        The monitors changed (none when each device is a whole replica).
    """
    if world_size == data_parallel:
        return []
    monitors = [c for c in callbacks if isinstance(c, ThroughputMonitor)]
    for monitor in monitors:
        monitor._throughputs = {
            stage: old
            if isinstance(old, ReplicaThroughput)
            else ReplicaThroughput(
                available_flops=old.available_flops,
                world_size=world_size,
                data_parallel=data_parallel,
                **monitor.kwargs,
            )
            for stage, old in monitor._throughputs.items()
        }
    return monitors
