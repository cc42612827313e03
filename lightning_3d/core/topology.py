"""The (dp, pp, tp) process grid.

One small dataclass owns the degrees and their validation; the device mesh is built from it with named
dimensions, and the parallel machinery fetches sub-meshes and groups by name (``mesh["tp"]``). The one place
that computes with ranks is ``Topology.coordinates``: where a rank sits in the grid, for code that has a rank
number but no mesh (the fail-fast watch's messages about other ranks, the checkpoint's mapping from saved to
current ranks); it follows the mesh's row-major layout. ``tp`` is the innermost dimension so that the ranks
of one tensor-parallel group are neighbours (on GPUs: the same node, the fastest links).

HSDP (``data_parallel="hsdp"``) splits dp into ``dp_replicate x dp_shard`` (``Topology.dp_shard``) without
changing the (dp, pp, tp) mesh or the global rank order: every consumer of the dp group (data loading, metric
sync, the log relay, the non-finite agreement, checkpoints, tools) keeps ``mesh["dp"]``, the whole dp group.
Only FSDP gets a second view of the same ranks, ``Topology.build_hsdp_mesh``: the dp dimension unflattened
into ``("dp_replicate", "dp_shard")`` with ``dp_replicate`` OUTER, so dp rank ``d`` is replica ``d //
dp_shard``, shard ``d % dp_shard``: a shard group is ``dp_shard`` consecutive dp ranks, i.e. ``dp_shard * pp *
tp`` consecutive global ranks. With the default ``dp_shard`` (the dp ranks of one node) that is exactly one
node: parameters are gathered and gradients reduce-scattered within a node, and only the all-reduce of the
already reduce-scattered gradient shards crosses nodes (between the ranks holding the same shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import torch_compat

MESH_DIMS: tuple[str, str, str] = ("dp", "pp", "tp")
HSDP_DIMS: tuple[str, str] = ("dp_replicate", "dp_shard")  # HSDP's split of dp, replicate outer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Topology:
    """Degrees of data (dp), pipeline (pp) and tensor (tp) parallelism over ``world_size`` processes.

    Args:
        world_size: number of processes in the job.
        tp: tensor-parallel degree (ranks that split each layer).
        pp: pipeline-parallel degree (stages).
        dp: data-parallel degree; ``None`` means whatever ``tp * pp`` leaves of the world.
        dp_shard: HSDP only (``None`` otherwise): the ranks each parameter is sharded over, a divisor of dp with
            ``1 < dp_shard < dp``; the ``dp // dp_shard`` groups of them hold replicas. See the module text for
            the rank order and ``resolve_dp_shard`` for the default.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    dp_shard: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ThreeDStrategy: {name} must be a positive integer, got {value!r}.")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"ThreeDStrategy: dp must be a positive integer or None, got {self.dp!r}.")
        model_parallel = self.tp * self.pp
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"ThreeDStrategy: tp * pp = {self.tp} * {self.pp} = {model_parallel} does not divide the world size "
                f"{self.world_size}. {self._suggestion()}"
            )
        inferred = self.world_size // model_parallel
        if self.dp is not None and self.dp != inferred:
            raise ValueError(
                f"ThreeDStrategy: dp={self.dp} does not match the world: dp * pp * tp = {self.dp} * {self.pp} * "
                f"{self.tp} = {self.dp * model_parallel}, but the world size is {self.world_size}. Use dp=None to "
                f"infer it (here dp={inferred}). {self._suggestion()}"
            )
        object.__setattr__(self, "dp", inferred)
        if self.dp_shard is not None:
            problem = hsdp_problem(inferred, self.dp_shard)
            if problem is not None:
                raise ValueError(problem)

    def _suggestion(self) -> str:
        pairs = [
            f"(tp={t}, pp={p}, dp={self.world_size // (t * p)})"
            for t in _divisors(self.world_size)
            for p in _divisors(self.world_size // t)
        ]
        return f"Layouts that fit {self.world_size} processes: " + ", ".join(pairs) + "."

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in ``MESH_DIMS`` order."""
        assert self.dp is not None
        return (self.dp, self.pp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(dp, pp, tp) coordinates of a global rank in the mesh ``build_mesh`` makes (row-major: tp fastest)."""
        _, pp, tp = self.shape
        return {"dp": rank // (pp * tp), "pp": (rank // tp) % pp, "tp": rank % tp}

    @property
    def hsdp_shape(self) -> tuple[int, int]:
        """``(dp_replicate, dp_shard)`` under HSDP (``dp_shard`` set); raises otherwise."""
        if self.dp_shard is None:
            raise ValueError("Topology.hsdp_shape: this topology has no HSDP split (dp_shard is None).")
        assert self.dp is not None
        return (self.dp // self.dp_shard, self.dp_shard)

    def hsdp_coordinates(self, rank: int) -> dict[str, int]:
        """(dp_replicate, dp_shard) coordinates of a global rank in ``build_hsdp_mesh``'s mesh (replicate outer)."""
        _, shard = self.hsdp_shape
        d = self.coordinates(rank)["dp"]
        return {"dp_replicate": d // shard, "dp_shard": d % shard}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the (dp, pp, tp) device mesh over the default process group (which must exist)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)

    def build_hsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """HSDP's (dp_replicate, dp_shard, pp, tp) view of ``build_mesh``'s mesh: the same ranks and root mesh, dp
        split with ``dp_replicate`` outer. Creates the two new dimensions' process groups (collective)."""
        return torch_compat.unflatten_mesh(mesh, "dp", self.hsdp_shape, HSDP_DIMS)

    def describe(self) -> str:
        dp, pp, tp = self.shape
        text = f"world={self.world_size} = dp {dp} x pp {pp} x tp {tp} (tp innermost)"
        if self.dp_shard is not None:
            replicate, shard = self.hsdp_shape
            text += f"; HSDP: dp {dp} = {replicate} replicas x {shard} shards (each shard group {shard * pp * tp} "
            text += "consecutive ranks)"
        return text


def hsdp_problem(dp: int, dp_shard: int) -> str | None:
    """Why ``dp_shard`` cannot split ``dp`` for HSDP (one message, saying what to use instead), or ``None``."""
    if dp == 1:
        return (
            "ThreeDStrategy(data_parallel='hsdp') shards and replicates over the data-parallel ranks, but dp=1: "
            "there is nothing to shard over. Use data_parallel='replicate' at dp=1, or more processes."
        )
    if dp_shard == 1:
        return (
            f"ThreeDStrategy(data_parallel='hsdp', dp_shard=1) shards over one rank: that is plain replication. Use "
            f"data_parallel='replicate', or dp_shard > 1 (a divisor of dp={dp} below it)."
        )
    if dp % dp_shard != 0:
        fitting = [d for d in _divisors(dp) if 1 < d < dp]
        return (
            f"ThreeDStrategy(data_parallel='hsdp'): dp_shard={dp_shard} does not divide dp={dp} (dp = dp_replicate "
            f"x dp_shard). "
            + (
                f"Divisors that fit: {fitting}."
                if fitting
                else f"dp={dp} has no divisor between 1 and itself: use data_parallel='fsdp' or 'replicate'."
            )
        )
    if dp_shard == dp:
        return (
            f"ThreeDStrategy(data_parallel='hsdp', dp_shard={dp_shard}) shards over all of dp={dp} with no "
            "replicas: that is FSDP. Use data_parallel='fsdp', or a dp_shard below dp."
        )
    return None


def resolve_dp_shard(dp: int, dp_shard: int | None, num_nodes: int) -> int:
    """HSDP's shard size: ``dp_shard`` when given, else the data-parallel ranks of one node (``dp // num_nodes``:
    shard within a node, replicate across nodes), which needs more than one node.

    Raises:
        ValueError: ``dp_shard`` is ``None`` on one node, or the nodes do not split dp evenly.
    """
    if dp_shard is not None:
        return dp_shard
    if num_nodes <= 1 or dp % num_nodes != 0:
        why = "this job runs on one node" if num_nodes <= 1 else f"dp={dp} does not split over {num_nodes} nodes"
        fitting = [d for d in _divisors(dp) if 1 < d < dp]
        raise ValueError(
            f"ThreeDStrategy(data_parallel='hsdp', dp_shard=None) shards over the data-parallel ranks of one node "
            f"(dp // num_nodes), but {why}. Give dp_shard explicitly"
            + (f" (divisors of dp={dp} that fit: {fitting})" if fitting else "")
            + ", or use data_parallel='fsdp'."
        )
    return dp // num_nodes


def mesh_ranks_table(mesh: DeviceMesh) -> str:
    """The rank grid as text: one line per (dp, pp) with the tp ranks, for the layout print-out."""
    grid: torch.Tensor = mesh.mesh
    lines = []
    for d in range(grid.shape[0]):
        for p in range(grid.shape[1]):
            ranks = ", ".join(str(int(r)) for r in grid[d, p])
            lines.append(f"  dp {d} | stage {p} | tp ranks [{ranks}]")
    return "\n".join(lines)
