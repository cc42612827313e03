"""Topology: degree validation (with the layouts that fit), rank coordinates (tp innermost), describe()."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lightning_3d.core.topology import MESH_DIMS, Topology, mesh_ranks_table


def test_dp_is_inferred_from_the_world() -> None:
    topo = Topology(world_size=8, tp=2, pp=2)
    assert topo.dp == 2
    assert topo.shape == (2, 2, 2)
    assert Topology(world_size=12, tp=3).shape == (4, 1, 3)
    assert Topology(world_size=1).shape == (1, 1, 1)


def test_explicit_dp_that_matches_is_accepted() -> None:
    assert Topology(world_size=8, tp=2, pp=1, dp=4).shape == (4, 1, 2)


def test_topology_is_frozen() -> None:
    topo = Topology(world_size=4, tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.tp = 4  # type: ignore[misc]


def test_tp_times_pp_not_dividing_the_world_lists_the_layouts_that_fit() -> None:
    with pytest.raises(ValueError) as info:
        Topology(world_size=4, tp=3, pp=1)
    assert str(info.value) == (
        "ThreeDStrategy: tp * pp = 3 * 1 = 3 does not divide the world size 4. Layouts that fit 4 processes: "
        "(tp=1, pp=1, dp=4), (tp=1, pp=2, dp=2), (tp=1, pp=4, dp=1), (tp=2, pp=1, dp=2), (tp=2, pp=2, dp=1), "
        "(tp=4, pp=1, dp=1)."
    )


def test_every_listed_layout_fits_and_none_is_missing() -> None:
    with pytest.raises(ValueError) as info:
        Topology(world_size=12, tp=5)
    listed = str(info.value).split("Layouts that fit 12 processes: ")[1].rstrip(".")
    layouts = {tuple(int(kv.split("=")[1]) for kv in item.strip("()").split(", ")) for item in listed.split("), (")}
    expected = {(t, p, 12 // (t * p)) for t in range(1, 13) for p in range(1, 13) if 12 % (t * p) == 0}
    assert layouts == expected
    assert len(expected) == 18  # sum over tp | 12 of the number of divisors of 12 / tp
    for tp, pp, dp in layouts:
        assert Topology(world_size=12, tp=tp, pp=pp, dp=dp).shape == (dp, pp, tp)


def test_explicit_dp_mismatch_names_the_product_and_the_inferred_dp() -> None:
    with pytest.raises(ValueError, match="Use dp=None") as info:
        Topology(world_size=8, tp=2, pp=2, dp=4)
    message = str(info.value)
    assert message.startswith(
        "ThreeDStrategy: dp=4 does not match the world: dp * pp * tp = 4 * 2 * 2 = 16, but the world size is 8. "
        "Use dp=None to infer it (here dp=2). Layouts that fit 8 processes: "
    )
    assert "(tp=2, pp=2, dp=2)" in message


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "tp": 0}, "tp"),
        ({"world_size": 4, "pp": -2}, "pp"),
        ({"world_size": 4, "tp": 2.0}, "tp"),
        ({"world_size": 4, "pp": "2"}, "pp"),
    ],
)
def test_degrees_must_be_positive_integers(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        Topology(**kwargs)


@pytest.mark.parametrize("dp", [0, -1, 2.0])
def test_dp_must_be_a_positive_integer_or_none(dp: object) -> None:
    with pytest.raises(ValueError, match="dp must be a positive integer or None"):
        Topology(world_size=4, dp=dp)  # type: ignore[arg-type]


def test_coordinates_of_a_2x2x2_world_have_tp_innermost() -> None:
    topo = Topology(world_size=8, tp=2, pp=2)
    expected = {  # rank: (dp, pp, tp)
        0: (0, 0, 0),
        1: (0, 0, 1),
        2: (0, 1, 0),
        3: (0, 1, 1),
        4: (1, 0, 0),
        5: (1, 0, 1),
        6: (1, 1, 0),
        7: (1, 1, 1),
    }
    for rank, (dp, pp, tp) in expected.items():
        assert topo.coordinates(rank) == {"dp": dp, "pp": pp, "tp": tp}


@pytest.mark.parametrize(("world", "tp", "pp"), [(8, 2, 2), (12, 3, 2), (16, 4, 1), (6, 1, 3), (8, 8, 1)])
def test_coordinates_match_the_device_mesh_layout(world: int, tp: int, pp: int) -> None:
    """init_device_mesh lays ranks out as arange(world).reshape(shape): coordinates must be that position."""
    topo = Topology(world_size=world, tp=tp, pp=pp)
    grid = torch.arange(world).reshape(topo.shape)
    for rank in range(world):
        where = (grid == rank).nonzero()[0].tolist()
        assert topo.coordinates(rank) == dict(zip(MESH_DIMS, where)), rank


def test_tp_groups_are_consecutive_ranks() -> None:
    topo = Topology(world_size=16, tp=4, pp=2)
    for rank in range(16):
        c = topo.coordinates(rank)
        peers = [r for r in range(16) if {**topo.coordinates(r), "tp": 0} == {**c, "tp": 0}]
        assert peers == list(range(rank - rank % 4, rank - rank % 4 + 4))


def test_describe() -> None:
    assert Topology(world_size=8, tp=2, pp=2).describe() == "world=8 = dp 2 x pp 2 x tp 2 (tp innermost)"
    assert Topology(world_size=6, pp=3).describe() == "world=6 = dp 2 x pp 3 x tp 1 (tp innermost)"


def test_mesh_ranks_table_has_one_line_per_dp_and_stage() -> None:
    mesh = SimpleNamespace(mesh=torch.arange(8).reshape(2, 2, 2))
    assert mesh_ranks_table(mesh).splitlines() == [  # type: ignore[arg-type]
        "  dp 0 | stage 0 | tp ranks [0, 1]",
        "  dp 0 | stage 1 | tp ranks [2, 3]",
        "  dp 1 | stage 0 | tp ranks [4, 5]",
        "  dp 1 | stage 1 | tp ranks [6, 7]",
    ]


def test_build_mesh_names_the_dimensions(gloo_world: object) -> None:
    mesh = Topology(world_size=1).build_mesh("cpu")
    assert mesh.mesh_dim_names == MESH_DIMS
    assert tuple(mesh.mesh.shape) == (1, 1, 1)
    assert mesh["tp"].size() == 1
