"""The (dp, pp, tp) process grid.

One small dataclass owns the degrees and their validation; the device mesh is built from it with named
dimensions, and the parallel machinery fetches sub-meshes and groups by name (``mesh["tp"]``). The one place
that computes with ranks is ``Topology.coordinates``: where a rank sits in the grid, for code that has a rank
number but no mesh (the fail-fast watch's messages about other ranks, the checkpoint's mapping from saved to
current ranks); it follows the mesh's row-major layout. ``tp`` is the innermost dimension so that the ranks
of one tensor-parallel group are neighbours (on GPUs: the same node, the fastest links).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS: tuple[str, str, str] = ("dp", "pp", "tp")


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
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int | None = None

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

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the (dp, pp, tp) device mesh over the default process group (which must exist)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)

    def describe(self) -> str:
        dp, pp, tp = self.shape
        return f"world={self.world_size} = dp {dp} x pp {pp} x tp {tp} (tp innermost)"


def mesh_ranks_table(mesh: DeviceMesh) -> str:
    """The rank grid as text: one line per (dp, pp) with the tp ranks, for the layout print-out."""
    grid: torch.Tensor = mesh.mesh
    lines = []
    for d in range(grid.shape[0]):
        for p in range(grid.shape[1]):
            ranks = ", ".join(str(int(r)) for r in grid[d, p])
            lines.append(f"  dp {d} | stage {p} | tp ranks [{ranks}]")
    return "\n".join(lines)
