"""Predicted time of one training step of a layout.

Per pipeline rank and micro-batch: each matmul's FLOPs at an efficiency set by its smallest size (the tokens of a
micro-batch, the reduction size, the output features left after tensor-parallel sharding: ``eff_max * d / (d +
half)``), attention's score and value products likewise (sizes: sequence and head dimension), backward twice the
forward, one more forward under full activation checkpointing; element-wise work as memory traffic; a fixed cost
per operator (launch and dispatch, more for DTensor layers). Tensor parallelism adds 2 all-reduces of the block's
activations per block in the forward and 2 in the backward (Megatron's f/g), plus the vocabulary-parallel
embedding's all-reduce and the gathered logits.

The pipeline runs ``m`` micro-batches over ``pp`` ranks: ``(m - 1) * slowest + sum of all ranks`` per micro-batch
slot for GPipe and 1F1B (``(m + pp - 1) t`` when balanced: a bubble of ``(pp - 1) / m``), the fill and drain divided
by ``v`` for interleaved 1F1B, and about a third of 1F1B's bubble (the forward part) for the zero-bubble schedules
(Qi et al. 2023). Each micro-batch slot adds a send and a receive of the boundary activation. Data parallelism
all-reduces the fp32 gradients once per step, hidden behind the last backward up to ``cluster.dp_overlap``; FSDP
without a pipeline gathers the parameters per micro-batch (forward and backward) and reduce-scatters gradients,
overlapped with compute likewise; under a pipeline it gathers once per step and keeps them (one all-gather and one
reduce-scatter a step). The optimizer step is memory traffic (36 bytes per local parameter). Ring collectives cost
``2 (n - 1) / n * bytes / bandwidth + 2 (n - 1) * latency`` on the slowest link the group spans.

When the devices share fewer cores than there are processes (``cluster.cores``: CPU), a rank waiting in the
bubble frees its core for another: the step takes at least the whole job's busy time (compute, communication,
optimizer and the fixed per-step cost, all CPU work there) divided by the cores the job gets (fewer when other
jobs run: ``cluster.background_load``). There, too, every message (collective hop, pipeline send) waits for
its receiver to be scheduled: ``cluster.shared_latency_s`` per message, measured by calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import ClusterSpec
from .layouts import ZERO_BUBBLE, Layout
from .memory import RankShape, rank_params, rank_shapes
from .model import ModelSpec

OPS_PER_LAYER = 24  # forward operators of a block (norms, projections, views, attention, activation, adds)
ELEMENTWISE_PASSES = 6  # reads + writes of a block's saved activations by its element-wise ops, forward


def allreduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce time of ``nbytes`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def gather_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather (or reduce-scatter) time of a ``nbytes`` result over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


@dataclass(frozen=True)
class StageTime:
    """One pipeline rank's forward and backward time per micro-batch (seconds), and its parts."""

    forward: float
    backward: float
    tp_comm: float  # included in forward + backward
    compute: float  # matmuls + element-wise + operator overhead, forward + backward (+ recompute)


def matmul_s(cluster: ClusterSpec, m: float, k: float, n: float, count: float = 1.0) -> float:
    """Time of ``count`` products ``(m x k) @ (k x n)``."""
    flops = 2.0 * m * k * n * count
    return flops / (cluster.peak_flops * cluster.matmul_efficiency(min(m, k, n)))


def layer_forward_s(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> tuple[float, float]:
    """(compute seconds, of which operator overhead) of one block's forward on one micro-batch."""
    t = layout.tp
    tokens = layout.micro_batch_size * model.seq_len
    total = 0.0
    for mm in model.layer_matmuls():
        k, n = (mm.k, mm.n / t) if mm.shard == "n" else (mm.k / t, mm.n)
        total += matmul_s(cluster, tokens, k, n)
    heads = layout.micro_batch_size * model.n_head / t
    total += 2 * matmul_s(cluster, model.seq_len, model.head_dim, model.seq_len, heads)  # q k^T, p v
    act_bytes = tokens * (4 * model.hidden + (2 * model.hidden + 2 * model.kv_dim + 2 * model.ffn) / t)
    total += ELEMENTWISE_PASSES * act_bytes * cluster.act_bytes / (cluster.mem_bw_gbs * 1e9)
    overhead = OPS_PER_LAYER * (cluster.op_overhead_s + (cluster.tp_op_overhead_s if t > 1 else 0.0))
    return total + overhead, overhead


def stage_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout, shape: RankShape) -> StageTime:
    """Forward and backward of one micro-batch on pipeline rank ``shape``."""
    t = layout.tp
    tokens = layout.micro_batch_size * model.seq_len
    layer_f, layer_overhead = layer_forward_s(model, cluster, layout)
    # Backward: twice the forward's FLOPs, as many operators again and then some.
    layer_b = 2 * (layer_f - layer_overhead) + 2 * layer_overhead
    recompute = layer_f if layout.activation_checkpointing == "full" else 0.0
    fwd = shape.layers * layer_f
    bwd = shape.layers * (layer_b + recompute)
    extra = cluster.micro_batch_overhead_s * layout.stages_per_rank
    if shape.head:
        head = matmul_s(cluster, tokens, model.hidden, model.vocab / t)
        fwd, bwd = fwd + head, bwd + 2 * head
    compute = fwd + bwd + extra
    bw, lat = cluster.link(t, 1)
    lat = cluster.latency(lat, layout.world, t)
    boundary = tokens * model.hidden * cluster.act_bytes
    tp_comm = shape.layers * 4 * allreduce_s(boundary, t, bw, lat)
    if shape.embedding:
        tp_comm += allreduce_s(boundary, t, bw, lat)
    if shape.head:
        tp_comm += 2 * gather_s(tokens * model.vocab * cluster.act_bytes, t, bw, lat)
    return StageTime(fwd + extra / 2 + tp_comm / 2, bwd + extra / 2 + tp_comm / 2, tp_comm, compute)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step and its parts (the parts are on the critical path; they sum to ``total``)."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    overhead: float
    shared_cores_wait: float

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.bubble
            + self.tp_comm
            + self.pp_comm
            + self.dp_comm
            + self.optimizer
            + self.overhead
            + self.shared_cores_wait
        )

    def as_dict(self) -> dict[str, float]:
        keys = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer", "overhead", "shared_cores_wait")
        return {k: getattr(self, k) for k in keys} | {"total": self.total}


def step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> StepTime:
    """Predicted time of one optimizer step of ``layout`` (every replica in parallel)."""
    m, pp, v = layout.micro_batches, layout.pp, layout.stages_per_rank
    shapes = rank_shapes(model, layout)
    stages = [stage_time(model, cluster, layout, s) for s in shapes]
    per_mb = [s.forward + s.backward for s in stages]
    slowest = max(range(pp), key=lambda r: per_mb[r])
    # Pipeline send + receive of the boundary activation (forward) and its gradient (backward) per micro-batch.
    tokens = layout.micro_batch_size * model.seq_len
    pbw, plat = cluster.link(pp, layout.tp)
    plat = cluster.latency(plat, layout.world, pp)
    p2p = 0.0 if pp == 1 else 2 * (plat + tokens * model.hidden * cluster.act_bytes / pbw)
    p2p_per_mb = p2p * v
    busy = m * per_mb[slowest]
    # Fill and drain: every other rank's share of one micro-batch slot, shortened by interleaving.
    fill = sum(per_mb) - per_mb[slowest]
    if layout.schedule in ZERO_BUBBLE:
        fill = sum(s.forward for s in stages) - stages[slowest].forward
    fill /= v if layout.schedule != "zbvzerobubble" else 2
    tp_share = stages[slowest].tp_comm / per_mb[slowest] if per_mb[slowest] else 0.0
    compute = busy * (1 - tp_share)
    tp_comm = busy * tp_share
    pp_comm = (m + (pp - 1) / v) * p2p_per_mb if pp > 1 else 0.0
    # Data parallelism.
    grad_params = rank_params(model, layout, shapes[slowest])
    max_params = max(rank_params(model, layout, s) for s in shapes)
    dbw, dlat = cluster.link(layout.dp, layout.tp * layout.pp)
    dlat = cluster.latency(dlat, layout.world, layout.dp)
    last_backward = stages[slowest].backward
    if layout.dp == 1:
        dp_comm = 0.0
    elif layout.data_parallel == "fsdp" and pp > 1:
        # Under a pipeline the stage's parameters stay gathered across its micro-batches (FSDP2's
        # reshard_after_forward=False, as torchtitan runs it with PP): one all-gather and one reduce-scatter a step.
        per_step = gather_s(grad_params * cluster.act_bytes, layout.dp, dbw, dlat) + gather_s(
            grad_params * 4, layout.dp, dbw, dlat
        )
        dp_comm = max(per_step * (1 - cluster.dp_overlap), per_step - cluster.dp_overlap * last_backward)
    elif layout.data_parallel == "fsdp":
        per_micro = 2 * gather_s(grad_params * cluster.act_bytes, layout.dp, dbw, dlat) + gather_s(
            grad_params * 4, layout.dp, dbw, dlat
        )
        dp_comm = m * max(0.0, per_micro - cluster.dp_overlap * per_mb[slowest])
    else:
        ar = allreduce_s(grad_params * 4, layout.dp, dbw, dlat)
        dp_comm = max(ar * (1 - cluster.dp_overlap), ar - cluster.dp_overlap * last_backward)
    local = max_params / (layout.dp if layout.data_parallel == "fsdp" else 1)
    optimizer = 36.0 * local / (cluster.mem_bw_gbs * 1e9)
    overhead = cluster.step_overhead_s
    critical = compute + fill + tp_comm + pp_comm + dp_comm + optimizer
    wait = 0.0
    cores = cluster.cores_for(layout.world)
    if cores is not None and cores < layout.world:
        # Busy time of every process: its micro-batches, its sends, its share of the collectives, its optimizer
        # and the step's fixed cost.
        work = sum(m * t + (m * p2p_per_mb if pp > 1 else 0.0) for t in per_mb) * layout.tp * layout.dp
        work += layout.world * (dp_comm + optimizer + overhead)
        wait = max(0.0, work / cores - critical - overhead)
    return StepTime(compute, fill, tp_comm, pp_comm, dp_comm, optimizer, overhead, wait)
