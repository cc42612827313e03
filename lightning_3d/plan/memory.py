"""Memory per device of a layout: weights, gradients, optimizer states, activations in flight, buffers.

The heaviest pipeline rank decides (the first rank holds the embedding and the most micro-batches in flight; the
last holds the output projection and the logits). Per rank:

- **states**: the rank's parameters (its layers' matrices and the vocabulary-parallel embedding/head divided by
  ``tp``; norms replicated) times the bytes per parameter: fp32 weights 4 + fp32 gradients 4 + AdamW's two fp32
  moments 8 under ``bf16-mixed`` or ``32-true`` (16 B/parameter); divided by ``dp`` under FSDP.
- **activations** saved for backward, per token and block (elements; Korthikanti et al. 2022 without sequence
  parallelism, attention by a fused kernel that keeps no ``s x s`` scores): the two norms' inputs and outputs,
  replicated (``4 h``), and the sharded ones ``(q, k, v, attention output, MLP hidden x 2) / tp`` =
  ``(2 h + 2 kv + 2 ffn) / tp`` (``4 ffn`` for a gated MLP). With full checkpointing a block keeps its input
  (``h``) and one block's activations exist at a time during its recomputation. The last stage adds the logits
  (``vocab / tp`` per token, in the activation dtype plus fp32 for the loss).
- **in flight**: GPipe keeps all ``m`` micro-batches, 1F1B ``min(m, pp - rank)``, interleaved 1F1B (``v``
  stages per rank) its warm-up forwards plus one, ``min(m v, (v - 1) m_r + 2 (pp - 1 - rank) + 1) / v``
  stage-equivalents with ``m_r`` micro-batches per round (torch's warm-up; ``pp + (pp - 1) / v`` on rank 0 from
  ``m = 2 pp`` on, Narayanan et al. 2021; the last rank far less); the zero-bubble schedules hold a micro-batch
  until its weight gradient, so more than 1F1B (the sum of each of the rank's two stages' peaks on torch's
  action lists: torch's split backward frees a graph late, benchmark B3): ZB-V ``min(m, 2pp - r) + min(m, r +
  1)`` half-stages on rank ``r`` (``pp + 1/2`` stage-equivalents, every rank), interleaved zero-bubble ``min(m,
  2pp) + min(m, pp)`` (``1.5 pp`` from ``m = 2pp`` on, against 1F1B's ``pp``; exact when ``pp`` divides ``m``,
  one micro-batch short on the first-round stage otherwise), and over one stage per rank (ZB-H1) ``min(m, pp)``
  on every rank.
- **buffers**: pipeline send/receive buffers (forward and backward, each chunk), the data-parallel gradient
  bucket, FSDP's gathered layers (under a pipeline: the stage's gathered parameters and unsharded gradients, kept
  across the micro-batches); and ``cluster.reserved_gib`` the framework keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import ClusterSpec
from .layouts import Layout
from .model import ModelSpec

GIB = float(1 << 30)
DP_BUCKET_BYTES = 50 * (1 << 20)  # two 25 MiB gradient buckets


def stage_layers(n_layer: int, stages: int) -> list[int]:
    """Blocks of each of ``stages`` pipeline stages: equal counts, the first stages taking the remainder."""
    base, extra = divmod(n_layer, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def rank_stages(layout: Layout, rank: int) -> list[int]:
    """Stage indices held by pipeline rank ``rank`` (round-robin, or a V for ZB-V)."""
    if layout.stages_per_rank == 1:
        return [rank]
    if layout.schedule == "zbvzerobubble":
        return [rank, 2 * layout.pp - 1 - rank]
    return [rank + i * layout.pp for i in range(layout.stages_per_rank)]


@dataclass(frozen=True)
class RankShape:
    """What one pipeline rank holds: its blocks, and whether it has the embedding and the head."""

    rank: int
    layers: int
    embedding: bool
    head: bool


def rank_shapes(model: ModelSpec, layout: Layout) -> list[RankShape]:
    """Every pipeline rank's blocks, embedding and head."""
    stages = layout.pp * layout.stages_per_rank
    sizes = stage_layers(model.n_layer, stages)
    shapes = []
    for r in range(layout.pp):
        held = rank_stages(layout, r)
        shapes.append(RankShape(r, sum(sizes[s] for s in held), 0 in held, stages - 1 in held))
    return shapes


def rank_params(model: ModelSpec, layout: Layout, shape: RankShape) -> float:
    """Parameters one device of this pipeline rank holds (its tensor-parallel shard)."""
    t = layout.tp
    norms = 2 * model.hidden * (2 if model.bias else 1)
    per_layer = (model.layer_params() - norms) / t + norms
    params = shape.layers * per_layer
    if shape.embedding:
        params += model.vocab * model.hidden / t + (model.seq_len * model.hidden if model.learned_positions else 0)
    if shape.head:
        params += model.vocab * model.hidden / t + model.hidden
    return params


def layer_activation_elements(model: ModelSpec, tp: int) -> float:
    """Elements one block saves for backward, per token, without checkpointing."""
    mlp = (4 if model.gated_mlp else 2) * model.ffn
    return 4 * model.hidden + (2 * model.hidden + 2 * model.kv_dim + mlp) / tp


def in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak (in whole-stage equivalents)."""
    m, pp = layout.micro_batches, layout.pp
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved1f1b":  # torch's warm-up forwards on this rank, plus one, in stage chunks
        v = layout.stages_per_rank
        per_round = m // max(1, m // pp)
        return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1) / v
    if layout.schedule == "zbvzerobubble":  # stages r and 2 pp - 1 - r, half a rank's layers each
        return (min(m, 2 * pp - rank) + min(m, rank + 1)) / 2
    if layout.schedule == "interleavedzerobubble" and layout.stages_per_rank == 1:  # ZB-H1: pp on every rank
        return float(min(m, pp))
    if layout.schedule == "interleavedzerobubble":  # stages r and r + pp
        return (min(m, 2 * pp) + min(m, pp)) / 2
    return float(min(m, pp - rank)) if layout.schedule == "1f1b" else float(min(m, pp))


@dataclass(frozen=True)
class Memory:
    """Bytes on the heaviest device, by kind (``total`` includes ``reserved``)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    reserved: float
    rank: int

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.reserved

    @property
    def gib(self) -> float:
        return self.total / GIB

    def as_gib(self) -> dict[str, float]:
        return {
            k: round(getattr(self, k) / GIB, 4)
            for k in ("weights", "gradients", "optimizer", "activations", "buffers", "reserved", "total")
        }


def rank_memory(model: ModelSpec, cluster: ClusterSpec, layout: Layout, shape: RankShape) -> Memory:
    """Memory of one device of pipeline rank ``shape.rank``."""
    wb, gb, ob = cluster.state_bytes_per_param
    ab = cluster.act_bytes
    params = rank_params(model, layout, shape)
    shard = layout.dp if layout.data_parallel == "fsdp" else 1
    tokens = layout.micro_batch_size * model.seq_len
    per_layer = layer_activation_elements(model, layout.tp) * tokens * ab
    flight = in_flight(layout, shape.rank)
    if layout.activation_checkpointing == "full":
        kept = shape.layers * model.hidden * tokens * ab * flight
        working = per_layer  # one block recomputed at a time
    else:
        kept = shape.layers * per_layer * flight
        working = 0.0
    if shape.head:  # logits (activation dtype) and the fp32 log-probabilities the loss keeps, one micro-batch
        logits = tokens * model.vocab / layout.tp * (ab + 4)
        kept += logits * (flight if layout.schedule == "gpipe" and layout.pp > 1 else 1)
        working += logits  # the logits' gradient
    boundary = tokens * model.hidden * ab
    buffers = (4 * boundary * layout.stages_per_rank) if layout.pp > 1 else 0.0
    layer_params = (model.layer_params()) / layout.tp
    if shard > 1 and layout.pp > 1:
        buffers += params * (ab + 4)  # the stage's gathered parameters and unsharded gradients, kept for the step
    elif shard > 1:
        buffers += 2 * layer_params * ab + layer_params * 4  # two gathered blocks, one block's unsharded gradient
    elif layout.dp > 1:
        buffers += min(params * gb, DP_BUCKET_BYTES)
    return Memory(
        weights=params * wb / shard,
        gradients=params * gb / shard,
        optimizer=params * ob / shard,
        activations=kept + working,
        buffers=buffers,
        reserved=cluster.reserved_gib * GIB,
        rank=shape.rank,
    )


def layout_memory(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> Memory:
    """Memory of the heaviest device of the layout."""
    return max((rank_memory(model, cluster, layout, s) for s in rank_shapes(model, layout)), key=lambda m: m.total)


def fits(memory: Memory, cluster: ClusterSpec) -> bool:
    return memory.total <= cluster.memory_gib * GIB
