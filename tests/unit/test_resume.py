"""Exact resume: which saved rank's RNG state a rank takes, how many batches it skips when the layout changes,
and the RNG states' round trip (through ``torch.load(weights_only=True)``)."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from lightning_3d.checkpoint.resume import (
    _skip_for_layout,
    elastic_ckpt_path,
    elastic_store_problem,
    rng_state,
    set_rng_state,
    source_rank,
)
from lightning_3d.core.topology import Topology


# ------------------------------------------------------------------------------------ source_rank
def test_same_layout_keeps_every_rank_its_own_state() -> None:
    topo = Topology(world_size=8, tp=2, pp=2)
    saved = {"dp": 2, "pp": 2, "tp": 2}
    assert [source_rank(saved, topo, r) for r in range(8)] == list(range(8))


def test_fewer_replicas_take_the_states_of_the_first_ones() -> None:
    topo = Topology(world_size=4, tp=2, pp=2)  # dp 1
    saved = {"dp": 2, "pp": 2, "tp": 2}
    assert [source_rank(saved, topo, r) for r in range(4)] == [0, 1, 2, 3]


def test_more_replicas_wrap_around_the_saved_ones() -> None:
    topo = Topology(world_size=8, tp=1, pp=2)  # dp 4: rank r has dp r // 2, pp r % 2
    saved = {"dp": 2, "pp": 2, "tp": 1}
    # dp 0, 1, 2, 3 -> saved dp 0, 1, 0, 1
    assert [source_rank(saved, topo, r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_new_tensor_parallel_peers_share_one_saved_state() -> None:
    topo = Topology(world_size=4, tp=2, pp=1)  # dp 2
    saved = {"dp": 2, "pp": 1, "tp": 1}
    assert [source_rank(saved, topo, r) for r in range(4)] == [0, 0, 1, 1]


def test_saved_tp_peers_map_by_tp_coordinate() -> None:
    topo = Topology(world_size=8, tp=4, pp=1)  # dp 2
    saved = {"dp": 1, "pp": 2, "tp": 2}  # saved rank = pp * 2 + tp
    # new (dp, tp): tp 0..3 -> saved tp 0, 1, 0, 1 at pp 0; dp wraps to 0
    assert [source_rank(saved, topo, r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]


# ------------------------------------------------------------------------------------ _skip_for_layout
def test_same_layout_skips_as_saved() -> None:
    assert _skip_for_layout(10, {"dp": 2, "batch_size": 8}, 2, 8) == (10, None)
    assert _skip_for_layout(10, {}, 4, 8) == (10, None)  # nothing recorded: assume the same dp


def test_same_global_batch_skips_as_saved() -> None:
    assert _skip_for_layout(10, {"dp": 2, "batch_size": 8}, 4, 4) == (10, None)  # 2 x 8 = 4 x 4


def test_larger_global_batch_rounds_down_and_says_so() -> None:
    k, problem = _skip_for_layout(3, {"dp": 2, "batch_size": 8}, 1, 10)
    # 3 batches x 16 samples = 48 samples; new batches of 10: 4 whole ones (40), 8 samples seen again
    assert k == 4
    assert problem == (
        "the global batch changed from 16 (dp=2 x 8) to 10 (dp=1 x 10): the epoch had consumed 48 samples, so 4 new "
        "batches (40 samples) are skipped and 8 samples are seen again"
    )


def test_exact_multiple_still_reports_the_change() -> None:
    k, problem = _skip_for_layout(10, {"dp": 2, "batch_size": 8}, 4, 8)
    assert k == 5 and problem is not None and "0 samples are seen again" in problem


def test_unknown_batch_size_with_another_dp() -> None:
    k, problem = _skip_for_layout(7, {"dp": 2, "batch_size": None}, 4, 8)
    assert k == 7
    assert problem is not None and "dp=2" in problem and "dp=4" in problem and "unknown" in problem
    assert _skip_for_layout(7, {"dp": 2, "batch_size": 8}, 4, None)[0] == 7


def test_batch_size_change_at_the_same_dp_is_approximate() -> None:
    k, problem = _skip_for_layout(5, {"dp": 2, "batch_size": 4}, 2, 8)
    assert k == 2 and problem is not None and "8 samples are seen again" in problem  # 40 samples, 2 x 16


# ------------------------------------------------------------------------------------ RNG states
def draws() -> tuple[list[float], float, list[float], float]:
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), float(np.random.randn())


def test_rng_state_round_trip_through_a_weights_only_load() -> None:
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    np.random.randn()  # draws a pair of gaussians and caches the second one in numpy's state
    state = rng_state()
    assert state["numpy"][3] == 1  # has_gauss: the cached value is part of the state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = draws()
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    assert draws() != expected
    set_rng_state(loaded)
    assert draws() == expected


def test_rng_state_without_cuda_or_streams() -> None:
    state = rng_state()
    assert set(state) == {"torch", "python", "numpy"}


def test_elastic_restart_resumes_from_last_unless_a_path_is_given():
    assert elastic_ckpt_path(None, {}) is None  # not under torchrun
    assert elastic_ckpt_path(None, {"TORCHELASTIC_RESTART_COUNT": "0"}) is None  # first attempt
    assert elastic_ckpt_path(None, {"TORCHELASTIC_RESTART_COUNT": "2"}) == "last"
    assert elastic_ckpt_path("a/b.ckpt", {"TORCHELASTIC_RESTART_COUNT": "1"}) == "a/b.ckpt"  # explicit wins


def test_elastic_store_problem_only_on_a_restart_with_the_shared_store():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert elastic_store_problem({**shared, "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert elastic_store_problem({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}) is None
    message = elastic_store_problem({**shared, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert message is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message
