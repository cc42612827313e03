"""``data_parallel="hsdp"``: bad input refused before any collective (one message each), the default shard size,
and the (dp_replicate, dp_shard) view of the mesh (replicate outer, the (dp, pp, tp) mesh and its dp group
unchanged), built for several ranks of a 16-process world on torch's fake process group, in this process.

The numbers (parity with one process, checkpoints into replicate) are checked by ``tests/test_fsdp.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_3d import ThreeDStrategy
from lightning_3d.core.topology import HSDP_DIMS, MESH_DIMS, Topology, hsdp_problem, resolve_dp_shard
from lightning_3d.settings import ThreeDSettings


# ---------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 6, "dp_shard": 4}, r"dp_shard=4 does not divide dp=6 \(dp = dp_replicate x dp_shard\)\. "
                                   r"Divisors that fit: \[2, 3\]\.$"),
        ({"dp": 4, "dp_shard": 1}, r"dp_shard=1\) shards over one rank: that is plain replication\. "
                                   r"Use data_parallel='replicate'"),
        ({"dp": 4, "dp_shard": 4}, r"dp_shard=4\) shards over all of dp=4 with no replicas: that is FSDP\. "
                                   r"Use data_parallel='fsdp'"),
        ({"dp": 1}, r"but dp=1: there is nothing to shard over\. Use data_parallel='replicate' at dp=1"),
        ({"dp": 1, "dp_shard": 2}, r"but dp=1: there is nothing to shard over"),
        ({"dp": 4, "dp_shard": 0}, r"dp_shard must be >= 1, got 0\.$"),
        ({"dp_shard": "2"}, r"dp_shard must be an integer, got '2'\.$"),
    ],
)  # fmt: skip
def test_bad_hsdp_settings_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThreeDSettings(data_parallel="hsdp", **kwargs)


def test_dp_shard_without_hsdp_is_refused() -> None:
    for mode in ("replicate", "fsdp"):
        with pytest.raises(ValueError, match=rf"dp_shard=2 is the shard size of data_parallel='hsdp', but "
                                             rf"data_parallel='{mode}'\. Use data_parallel='hsdp'"):  # fmt: skip
            ThreeDSettings(dp=4, dp_shard=2, data_parallel=mode)


def test_valid_hsdp_settings() -> None:
    s = ThreeDSettings(dp=4, dp_shard=2, data_parallel="hsdp")
    assert (s.data_parallel, s.dp_shard) == ("hsdp", 2)
    assert ThreeDSettings(data_parallel="hsdp").dp_shard is None  # resolved when the trainer is built
    assert ThreeDSettings(dp=8, data_parallel="hsdp").dp_shard is None  # (it needs the node count)


def test_hsdp_problem_accepts_proper_divisors_only() -> None:
    for dp in range(1, 13):
        for shard in range(1, 13):
            ok = dp > 1 and 1 < shard < dp and dp % shard == 0
            assert (hsdp_problem(dp, shard) is None) == ok, (dp, shard)


# ---------------------------------------------------------------------------------------------- default shard size
def test_default_dp_shard_is_one_node() -> None:
    assert resolve_dp_shard(8, None, num_nodes=2) == 4
    assert resolve_dp_shard(8, None, num_nodes=4) == 2
    assert resolve_dp_shard(8, 2, num_nodes=1) == 2  # given: kept (checked by Topology)


def test_default_dp_shard_needs_several_nodes() -> None:
    message = (
        r"dp_shard=None\) shards over the data-parallel ranks of one node \(dp // num_nodes\), but this job runs on "
        r"one node\. Give dp_shard explicitly \(divisors of dp=8 that fit: \[2, 4\]\), or use data_parallel='fsdp'\.$"
    )
    with pytest.raises(ValueError, match=message):
        resolve_dp_shard(8, None, num_nodes=1)
    with pytest.raises(ValueError, match=r"but dp=6 does not split over 4 nodes"):
        resolve_dp_shard(6, None, num_nodes=4)


def _trainer(devices: int, num_nodes: int = 1, **kwargs: object) -> L.Trainer:
    strategy = ThreeDStrategy(data_parallel="hsdp", **kwargs)  # type: ignore[arg-type]
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)


def test_hsdp_layout_is_checked_when_the_trainer_is_built() -> None:
    """dp inferred from the world: refused in the launching process, before any rank starts."""
    assert _trainer(8, pp=2, dp_shard=2).strategy.topology.hsdp_shape == (2, 2)
    assert _trainer(4, num_nodes=2, dp_shard=None).strategy.topology.hsdp_shape == (2, 4)  # one node's 4 dp ranks
    assert _trainer(4, num_nodes=2, tp=2).strategy.topology.hsdp_shape == (2, 2)
    with pytest.raises(ValueError, match="that is FSDP"):
        _trainer(4, pp=2, dp_shard=2)  # dp = 2
    with pytest.raises(ValueError, match="dp=1: there is nothing to shard over"):
        _trainer(4, tp=2, pp=2, dp_shard=2)
    with pytest.raises(ValueError, match="dp=1: there is nothing to shard over"):
        _trainer(4, tp=2, pp=2)  # (dp=1 first, not the default shard size)
    with pytest.raises(ValueError, match="this job runs on one node"):
        _trainer(8)
    with pytest.raises(ValueError, match="dp_shard=3 does not divide dp=8"):
        _trainer(8, dp_shard=3)


# ---------------------------------------------------------------------------------------------- the mesh
def test_hsdp_coordinates_put_replicas_outer() -> None:
    topo = Topology(world_size=16, tp=2, pp=2, dp_shard=2)  # dp 4 = 2 replicas x 2 shards
    assert topo.hsdp_shape == (2, 2)
    groups: dict[tuple, list[int]] = {}
    for rank in range(16):
        c = {**topo.coordinates(rank), **topo.hsdp_coordinates(rank)}
        assert c["dp"] == c["dp_replicate"] * 2 + c["dp_shard"]
        groups.setdefault((c["dp_replicate"], c["pp"], c["tp"]), []).append(rank)
    # a shard group spans dp_shard * pp * tp = 8 consecutive ranks (one 8-GPU node), tp pairs inside it
    assert groups[(0, 0, 0)] == [0, 4] and groups[(1, 1, 1)] == [11, 15]
    assert all(max(r) < 8 or min(r) >= 8 for r in groups.values())
    assert "HSDP: dp 4 = 2 replicas x 2 shards (each shard group 8 consecutive ranks)" in topo.describe()


def test_topology_checks_dp_shard_and_has_no_hsdp_shape_without_it() -> None:
    with pytest.raises(ValueError, match="dp_shard=3 does not divide dp=4"):
        Topology(world_size=8, pp=2, dp_shard=3)
    with pytest.raises(ValueError, match="no HSDP split"):
        _ = Topology(world_size=8).hsdp_shape
    assert "HSDP" not in Topology(world_size=8).describe()


@contextmanager
def _fake_rank(rank: int, world: int) -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 5, 10, 15])
def test_hsdp_mesh_is_a_view_of_the_dp_dimension(rank: int) -> None:
    """On rank r of 16 (dp 4 = 2 x 2, pp 2, tp 2): the (dp, pp, tp) mesh stays as it is, ``mesh["dp"]`` is still
    the whole dp group, and the HSDP mesh holds the same ranks with dp split replicate-outer, as
    ``hsdp_coordinates`` says."""
    topo = Topology(world_size=16, tp=2, pp=2, dp_shard=2)
    grid = torch.arange(16).reshape(4, 2, 2)
    with _fake_rank(rank, 16):
        mesh = topo.build_mesh("cpu")
        hsdp = topo.build_hsdp_mesh(mesh)
        assert mesh.mesh_dim_names == MESH_DIMS and torch.equal(mesh.mesh, grid)
        assert hsdp.mesh_dim_names == (*HSDP_DIMS, "pp", "tp")
        assert torch.equal(hsdp.mesh, grid.reshape(2, 2, 2, 2))
        c, h = topo.coordinates(rank), topo.hsdp_coordinates(rank)
        assert mesh["dp"].mesh.tolist() == grid[:, c["pp"], c["tp"]].tolist()  # the whole dp group
        assert mesh["dp"].get_local_rank() == c["dp"]
        assert hsdp["dp_shard"].get_local_rank() == h["dp_shard"]
        assert hsdp["dp_replicate"].get_local_rank() == h["dp_replicate"]
        shard_group = [r for r in range(16) if {**topo.coordinates(r), "dp": 0} == {**c, "dp": 0}
                       and topo.hsdp_coordinates(r)["dp_replicate"] == h["dp_replicate"]]  # fmt: skip
        assert hsdp["dp_shard"].mesh.tolist() == shard_group
        assert hsdp[HSDP_DIMS].mesh.flatten().tolist() == mesh["dp"].mesh.tolist()
