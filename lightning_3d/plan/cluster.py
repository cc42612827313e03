"""What the planner knows about the machines: devices per node, nodes, FLOP/s, memory, links.

A cluster is a YAML file of ``conf/cluster/`` (the Hydra group ``cluster=``): ``cpu8`` (this machine's 8 CPU
processes, written by ``calibrate=true``), ``a100_80g``, ``h100_80g``, ``h200``. Every field is a plain number, so a
different machine is a copy with other numbers (``cluster.nodes=48 cluster.inter_bw_gbs=6.25``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "conf" / "cluster"


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links of a cluster (per device unless said otherwise).

    Attributes:
        name: label.
        gpus_per_node: devices (processes) per node; tensor parallelism stays within a node.
        nodes: nodes.
        peak_flops: peak matmul FLOP/s of one device in the compute dtype (dense bf16 for GPUs, fp32 on CPU).
        memory_gib: memory of one device (GiB).
        reserved_gib: memory not available to tensors (CUDA context, allocator slack, the Python process).
        intra_bw_gbs: achievable collective bandwidth within a node, GB/s per device (bus bandwidth).
        inter_bw_gbs: achievable bandwidth between nodes, GB/s per device.
        intra_latency_s: per-message latency within a node (seconds).
        inter_latency_s: per-message latency between nodes.
        mem_bw_gbs: device memory bandwidth (optimizer step, element-wise work), GB/s.
        matmul_eff_max: fraction of ``peak_flops`` large matmuls reach.
        matmul_half_size: the smallest matmul dimension at which the efficiency is half of ``matmul_eff_max``
            (efficiency ``eff_max * d / (d + half)``, ``d`` the smallest of the product's three sizes).
        op_overhead_s: fixed cost of one operator launch (kernel launch, Python and dispatch): counted per
            operator of a layer's forward and backward.
        tp_op_overhead_s: extra fixed cost per operator of a tensor-parallel layer (DTensor dispatch).
        step_overhead_s: fixed cost of a training step (Lightning loop, optimizer launch, logging).
        micro_batch_overhead_s: fixed cost of one micro-batch on one stage outside the blocks (the step function
            run per micro-batch, the schedule's bookkeeping, the loss).
        dp_overlap: fraction of the data-parallel gradient all-reduce hidden behind the last backward.
        precision: ``"bf16-mixed"`` (fp32 weights, bf16 activations) or ``"32-true"``.
        cores: compute cores the devices share (CPU processes on fewer cores than processes); ``None`` for
            dedicated devices (GPUs).
        background_load: runnable processes of other jobs on those cores (the load average before the job
            starts): the job's processes get ``cores * world / (world + background_load)`` of them.
        shared_latency_s: per-message latency when the job's processes outnumber the cores they share, by the size
            of the group that exchanges the message (``{2: ..., 4: ..., 8: ...}``): a message then waits for its
            receiver to be scheduled, which costs far more than the link itself, and more the larger the group
            (measured by calibration: every group of that size all-reducing 4 KiB at once, all the job's processes
            running); ``None``: not measured, the links' own latency.
    """

    name: str
    gpus_per_node: int
    nodes: int
    peak_flops: float
    memory_gib: float
    reserved_gib: float = 2.0
    intra_bw_gbs: float = 150.0
    inter_bw_gbs: float = 25.0
    intra_latency_s: float = 1e-5
    inter_latency_s: float = 2e-5
    mem_bw_gbs: float = 2000.0
    matmul_eff_max: float = 0.75
    matmul_half_size: float = 96.0
    op_overhead_s: float = 5e-6
    tp_op_overhead_s: float = 0.0
    step_overhead_s: float = 0.01
    micro_batch_overhead_s: float = 2e-4
    dp_overlap: float = 0.8
    precision: str = "bf16-mixed"
    cores: float | None = None
    background_load: float = 0.0
    shared_latency_s: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"cluster {self.name}: gpus_per_node and nodes must be >= 1.")
        if self.precision not in ("bf16-mixed", "32-true", "bf16-true"):
            raise ValueError(
                f"cluster {self.name}: precision {self.precision!r}; use bf16-mixed, bf16-true or 32-true."
            )

    @property
    def world(self) -> int:
        """Devices in all."""
        return self.gpus_per_node * self.nodes

    def cores_for(self, processes: int) -> float | None:
        """Cores a job of ``processes`` processes gets (None: dedicated devices)."""
        if self.cores is None:
            return None
        return self.cores * processes / (processes + max(0.0, self.background_load))

    def latency(self, link_latency: float, processes: int, group: int) -> float:
        """Per-message latency in a group of ``group`` ranks of a job of ``processes`` processes:
        ``shared_latency_s`` for that group size (the next measured size up, or the largest) when the processes
        outnumber the cores they get, else the link's own."""
        cores = self.cores_for(processes)
        if not self.shared_latency_s or cores is None or processes <= cores or group <= 1:
            return link_latency
        sizes = sorted(int(k) for k in self.shared_latency_s)
        size = next((k for k in sizes if k >= group), sizes[-1])
        table = {int(k): float(v) for k, v in self.shared_latency_s.items()}
        return max(link_latency, table[size])

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation element."""
        return 4 if self.precision == "32-true" else 2

    @property
    def state_bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, AdamW states) bytes per parameter: fp32 master weights under bf16-mixed."""
        if self.precision == "bf16-true":
            return 2, 2, 4
        return 4, 4, 8

    def matmul_efficiency(self, smallest_dim: float) -> float:
        """Fraction of peak a matmul whose smallest size is ``smallest_dim`` reaches."""
        d = max(1.0, float(smallest_dim))
        return self.matmul_eff_max * d / (d + self.matmul_half_size)

    def link(self, span: int, stride: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a group of ``span`` ranks ``stride`` apart (intra- or inter-node)."""
        inside = span <= 1 or (span - 1) * stride < self.gpus_per_node
        if inside:
            return self.intra_bw_gbs * 1e9, self.intra_latency_s
        return self.inter_bw_gbs * 1e9, self.inter_latency_s


def available_clusters(directory: Path = CLUSTER_DIR) -> list[str]:
    """Names of the cluster files."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def cluster_from_config(cfg: Mapping[str, Any]) -> ClusterSpec:
    """A :class:`ClusterSpec` from a mapping (a ``cluster=`` config); unknown keys are refused with the field list."""
    fields = {f.name for f in dataclasses.fields(ClusterSpec)}
    values = {k: v for k, v in dict(cfg).items() if not str(k).startswith("_")}
    if unknown := sorted(set(values) - fields):
        raise ValueError(f"cluster: unknown field(s) {unknown}; the fields are {sorted(fields)}.")
    # YAML 1.1 (PyYAML) reads ``312.0e12`` as a string: numbers are converted by the field's type.
    for f in dataclasses.fields(ClusterSpec):
        value = values.get(f.name)
        if isinstance(value, str) and f.type in ("float", "float | None", "int"):
            values[f.name] = int(value) if f.type == "int" else float(value)
    return ClusterSpec(**values)


def load_cluster(name: str, directory: Path = CLUSTER_DIR, **overrides: Any) -> ClusterSpec:
    """The cluster file ``directory/name.yaml``; an unknown name raises with the list of known ones.

    Args:
        name: file stem (``h100_80g``) or a path to a YAML file.
        directory: where the cluster files are.
        **overrides: fields to replace (``nodes=48``).

    Raises:
        ValueError: unknown cluster, naming the ones there are.
    """
    import yaml

    path = Path(name) if name.endswith((".yaml", ".yml")) else directory / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(
            f"plan: unknown cluster {name!r}; known clusters: {', '.join(available_clusters(directory))} "
            "(or write one: python -m lightning_3d.plan calibrate=true)."
        )
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("name", path.stem)
    data.update(overrides)
    return cluster_from_config(data)
