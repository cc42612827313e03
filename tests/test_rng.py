"""The body's random streams: per pipeline stage, and per tensor-parallel rank inside sharded regions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_3d.core import torch_compat
from lightning_3d.core.rng import BodyRandomness, region_stream, stage_stream, stream_seed

from launch import run_lightning

CPU = torch.device("cpu")


def test_stream_seeds_differ_by_stage_and_tp_rank_and_are_stable() -> None:
    seeds = {stream_seed(7, kind, s, t) for kind in (1, 2) for s in range(4) for t in range(4)}
    assert len(seeds) == 32
    assert stream_seed(7, 2, 1, 0) == stream_seed(7, 2, 1, 0) != stream_seed(8, 2, 1, 0)
    assert all(0 <= s < 2**63 for s in seeds)


def test_streams_leave_the_default_generator_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(5)  # what the default generator gives with no streams in between
    torch.manual_seed(0)
    rng = BodyRandomness(seed=3, stages=[1], tp_rank=0, device=CPU)
    rng.enter(stage_stream(1))
    first = torch.rand(4)
    rng.enter(region_stream(1))
    region = torch.rand(4)
    rng.exit()
    rng.exit()
    assert torch.equal(torch.rand(5), expected), "the default generator moved"
    rng.enter(stage_stream(1))
    second = torch.rand(4)  # the stage stream continues where it stopped
    rng.exit()
    fresh = torch.Generator().manual_seed(stream_seed(3, 1, 1))
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=fresh))
    assert not torch.equal(first, region)


def test_frozen_streams_do_not_advance_and_state_dict_round_trips() -> None:
    rng = BodyRandomness(seed=3, stages=[0], tp_rank=1, device=CPU)
    saved = rng.state_dict()
    with rng.frozen():
        rng.enter(stage_stream(0))
        torch.rand(10)
        rng.exit()
    assert all(torch.equal(saved[k], v) for k, v in rng.states.items())
    rng.enter(stage_stream(0))
    a = torch.rand(3)
    rng.exit()
    other = BodyRandomness(seed=99, stages=[0, 5], tp_rank=1, device=CPU)
    other.load_state_dict(saved)  # stage 5 is not in the saved states: keeps its own
    other.enter(stage_stream(0))
    b = torch.rand(3)
    other.exit()
    assert torch.equal(a, b)
    assert not torch.equal(other.states[stage_stream(5)], saved[stage_stream(0)])


def test_stage_hook_swaps_around_forward_even_when_it_raises() -> None:
    rng = BodyRandomness(seed=1, stages=[0], tp_rank=0, device=CPU)
    stage = nn.Sequential(nn.Dropout(0.5))
    rng.install_stage(stage, 0)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    stage(torch.ones(64))
    assert torch.equal(torch.get_rng_state(), before) and rng.current is None

    def boom(mod, args):
        raise RuntimeError("boom")

    stage[0].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        stage(torch.ones(64))
    assert rng.current is None and torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow
def test_dropout_masks_under_tp2_pp2(tmp_path: Path) -> None:
    """Megatron's semantics: sharded regions draw per tp rank, replicated activations alike on all tp ranks,
    and every pipeline stage its own numbers."""
    out = tmp_path / "masks.pt"
    run_lightning("rng_run.py", ["--out", out], timeout=180)
    ranks = torch.load(out)
    calls = {(r["coords"]["pp"], r["coords"]["tp"]): r["masks"] for r in ranks}
    inner, outer = {0: "body.1.inner", 1: "body.2.inner"}, {0: "body.1.outer", 1: "body.2.outer"}
    assert all(len(c) == 5 for m in calls.values() for c in m.values()), "shape inference + 2 steps x 2 micro"

    def same_mask(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether two dropout calls kept the same positions (where both inputs are non-zero)."""
        (in_a, out_a), (in_b, out_b) = a, b
        valid = (in_a != 0) & (in_b != 0)
        assert valid.sum() > 50, "too few positions to compare"
        return torch.equal((out_a != 0)[valid], (out_b != 0)[valid])

    # Call 0 is torch's shape inference. On stage 0, with the streams frozen, it draws the very numbers the real
    # call 1 draws after it: it consumed nothing. (torch 2.13 infers on the real first micro-batch, so the two calls
    # are equal; torch 2.11 on zeros, so only the kept positions can be compared.)
    for tp in (0, 1):
        for name in (inner[0], outer[0]):
            assert same_mask(calls[(0, tp)][name][0], calls[(0, tp)][name][1]), name
            if torch_compat.torch_release() >= (2, 13):
                assert torch.equal(calls[(0, tp)][name][0][1], calls[(0, tp)][name][1][1]), name
    by = {key: {name: c[1] for name, c in masks.items()} for key, masks in calls.items()}  # the first real call

    for pp in (0, 1):
        r0, r1 = by[(pp, 0)], by[(pp, 1)]
        assert r0[inner[pp]][0].shape == (16, 32), "the inner dropout sees a tp shard (64 / 2 features)"
        assert not same_mask(r0[inner[pp]], r1[inner[pp]]), "tp ranks drew the same mask for their shards"
        assert torch.equal(r0[outer[pp]][0], r1[outer[pp]][0]), "the outer dropout's input is replicated"
        assert torch.equal(r0[outer[pp]][1], r1[outer[pp]][1]), "replicated activations got different masks"
    for tp in (0, 1):
        assert not same_mask(by[(0, tp)][inner[0]], by[(1, tp)][inner[1]]), "stages drew the same masks"
        assert not same_mask(by[(0, tp)][outer[0]], by[(1, tp)][outer[1]]), "stages drew the same masks"
