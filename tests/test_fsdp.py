"""``data_parallel="fsdp"``: parity with one process, one reduce-scatter per optimizer step, checkpoints across modes.

One launch per layout (every case of scripts/parity_run.py it needs in that launch), compared with the
single-device reference like tests/test_parity.py: float64 step-1 gradients and every logged value within 1e-10,
float32 20 steps within 1e-4 relative (with Adam, clipping by the global gradient norm of the sharded gradients),
gradient accumulation (``mlp32acc``), weights tied across pipeline stages (``nanotied*``), bf16-mixed (``gptbf``:
bf16 compute, fp32 reduction; within test_parity's bf16 tolerances). Then each rank's share
(its stage's tensor-parallel share split over dp, exactly once) and the collectives FSDP2 ran per optimizer step:
one reduce-scatter per FSDP unit, also with two batches per optimizer step, and one all-gather per unit per batch
under a pipeline (``reshard_after_forward=False``: not one per micro-batch). Checkpoints: saved under FSDP at
(pp2, dp2), resumed exactly there and loaded replicated at (pp2, dp1).

HSDP (``data_parallel="hsdp"``, dp 4 = 2 replicas x 2 shards) runs in the same launches: parity at pp2 x dp4
(float64 gradients within 1e-10, float32 20 steps within 1e-4, also the split model with tied weights), each
replica's shards adding up once and the replicas holding the same shards; a checkpoint saved under HSDP (tp1, pp1,
dp4) resumed exactly there and loaded replicated at (pp2, dp1).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from test_any_model import SHARDED as SPLIT_SHARDED
from test_parity import expected_share

from conftest import copy_inits
from launch import run_lightning
from parity_check import check_replicas, compare, load

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def check_fsdp_shares(got: dict, ref: dict, model: str, tp: int, dp: int) -> list[str]:
    """Over the dp ranks of each (pp, tp) position, a parameter's shards add up to its tensor-parallel share,
    and no rank holds more than its 1 / dp of whole rows."""
    problems: list[str] = []
    sums: dict[tuple, dict[str, list[int]]] = {}
    for rank in got["ranks"]:
        position = sums.setdefault(tuple(rank["coords"][1:]), {})
        for name, numel in rank["numels"].items():
            position.setdefault(name, []).append(numel)
    for position, named in sums.items():
        for name, numels in named.items():
            full = ref["params"][name]
            if model in SPLIT_SHARDED:  # models split at their blocks (tests/test_any_model.py's sharding)
                sharded = tp > 1 and any(key in name for key in SPLIT_SHARDED[model])
                share = full.numel() // tp if sharded else full.numel()
            else:
                share = expected_share(name, full.numel(), model, tp)
            row = math.prod(full.shape[1:]) if full.dim() > 1 else 1
            if len(numels) != dp or sum(numels) != share:
                problems.append(f"{position} {name}: dp shards {numels} do not add up to {share}")
            if max(numels) > share / dp + row:
                problems.append(f"{position} {name}: a rank holds {max(numels)} of {share} (dp={dp})")
    return problems


def check_collectives(got: dict, accumulate: int) -> list[str]:
    """After the first optimizer step (torch's shape inference runs extra passes), every optimizer step runs
    exactly one reduce-scatter per FSDP unit of the rank, however many micro-batches and batches, and one
    all-gather per unit per batch (gathered once for all micro-batches; a batch that defers its reduce-scatter
    under gradient accumulation still reshards at its end)."""
    problems = []
    for rank in got["ranks"]:
        units = rank["fsdp_units"]
        steps = rank["collectives"][1:]
        if units < 2 or not steps:
            problems.append(f"rank {rank['coords']}: {units} FSDP units, {len(steps)} steps counted")
        for i, (reduce_scatters, all_gathers) in enumerate(steps):
            if (reduce_scatters, all_gathers) != (units, units * accumulate):
                problems.append(
                    f"rank {rank['coords']} step {i + 2}: {reduce_scatters} reduce-scatters and {all_gathers} "
                    f"all-gathers for {units} FSDP units (accumulate={accumulate})"
                )
    return problems


def _replicas_read_their_batches(got: dict) -> list[str]:
    # FSDP ranks hold different shards: only the data part of check_replicas applies
    return [p for p in check_replicas(got) if "data-parallel replicas differ" not in p]


LAYOUTS = {
    (2, 2, 2): ["mlp64", "gpt64", "gpt32", "mlp32acc", "nanotied64", "nanotied32"],
    (1, 2, 4): ["gpt64", "gpt32", "mlp32acc", "gptbf"],
}
# data_parallel="hsdp" in the same launch, after the FSDP cases: dp 4 = 2 replicas x 2 shards (dp_shard=2)
HSDP_CASES = {(1, 2, 4): ["gpt64", "gpt32", "nanotied64"]}
HSDP_SHARD = 2


def check_hsdp_shares(got: dict, ref: dict, model: str, tp: int, dp: int, dp_shard: int) -> list[str]:
    """Within each replica (dp rank // dp_shard) the dp_shard ranks of a (pp, tp) position hold disjoint shards
    adding up to the tensor-parallel share; the replicas hold the same shards (bitwise, after training)."""
    by_replica = {
        "ranks": [
            {**r, "coords": (r["coords"][0] % dp_shard, r["coords"][0] // dp_shard, *r["coords"][1:])}
            for r in got["ranks"]
        ]
    }
    problems = check_fsdp_shares(by_replica, ref, model, tp, dp_shard)
    copies: dict[tuple, set[str]] = {}
    for r in got["ranks"]:
        copies.setdefault((r["coords"][0] % dp_shard, *r["coords"][1:]), set()).add(r["params_sha"])
    problems += [f"shard {k}: replicas differ" for k, shas in copies.items() if len(shas) != 1]
    if len(copies) != len(got["ranks"]) // (dp // dp_shard):
        problems.append(f"{len(copies)} shard positions for {len(got['ranks'])} ranks")
    return problems


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-device reference of every case the layouts below run."""
    out = tmp_path_factory.mktemp("fsdp_ref")
    cases = sorted({case for cases in [*LAYOUTS.values(), *HSDP_CASES.values()] for case in cases})
    run_lightning("parity_run.py", ["--ref", "--cases", ",".join(cases), "--out", out], timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "dp"), list(LAYOUTS), ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_fsdp_parity_with_single_device(fsdp_reference, tmp_path, tp, pp, dp):
    parity_reference = fsdp_reference
    copy_inits(parity_reference, tmp_path)
    cases = LAYOUTS[(tp, pp, dp)]
    layout = ["--tp", tp, "--pp", pp, "--dp", dp, "--micro", 4, "--data-parallel", "fsdp"]
    hsdp = HSDP_CASES.get((tp, pp, dp), [])
    if hsdp:
        layout += ["--hsdp-cases", ",".join(hsdp), "--dp-shard", HSDP_SHARD]
    run_lightning(
        "parity_run.py",
        [*layout, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=1500 if hsdp else 1200,
    )
    problems = []
    for case in cases:
        ref, got = load(parity_reference, case), load(tmp_path, case)
        accumulate = 2 if case.endswith("acc") else 1
        found = compare(ref, got, case[-2:] if case[-2:] in ("64", "32") else case[3:5])
        model = case[:3] if case[:3] in ("gpt", "mlp") else re.sub(r"\d+$", "", case)
        found += _replicas_read_their_batches(got) + check_fsdp_shares(got, ref, model, tp, dp)
        found += check_collectives(got, accumulate)
        problems += [f"{case}: {p}" for p in found]
    for case in hsdp:  # float64 within 1e-10, float32 20 steps (clipped by the norm over dp_shard) within 1e-4
        ref, got = load(parity_reference, case), load(tmp_path, f"{case}@hsdp")
        found = compare(ref, got, case[-2:])
        model = case[:3] if case[:3] in ("gpt", "mlp") else re.sub(r"\d+$", "", case)
        found += _replicas_read_their_batches(got) + check_hsdp_shares(got, ref, model, tp, dp, HSDP_SHARD)
        found += check_collectives(got, 1)  # per shard group as FSDP (the replicas' all-reduce is not counted)
        problems += [f"{case}@hsdp: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


COMBINATIONS = {  # pp2 x dp2 with the other features, one launch each: parity and shares (not the FSDP counts)
    "fsdp+checkpointing": ["--data-parallel", "fsdp", "--activation-checkpointing", "full"],
    "fsdp+interleaved": ["--data-parallel", "fsdp", "--schedule", "interleaved1f1b", "--stages-per-rank", 2],
    "buckets+compile": ["--compile-backend", "aot_eager"],
}


@pytest.mark.slow
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_data_parallel_combined_with_other_features(fsdp_reference, tmp_path, combination):
    """FSDP with activation checkpointing and with two interleaved stages per rank, and the bucketed replicate
    (a group per block) with compiled blocks: the same numbers as one process (float64 within 1e-10, float32 20
    steps within 1e-4 relative)."""
    copy_inits(fsdp_reference, tmp_path)
    cases = ["gpt64", "gpt32"]
    layout = ["--pp", 2, "--dp", 2, "--micro", 4, *COMBINATIONS[combination]]
    run_lightning("parity_run.py", [*layout, "--cases", ",".join(cases), "--out", tmp_path], timeout=900)
    problems = []
    for case in cases:
        found = compare(load(fsdp_reference, case), load(tmp_path, case), case[-2:])
        if combination.startswith("fsdp"):
            found += check_fsdp_shares(load(tmp_path, case), load(fsdp_reference, case), "gpt", 1, 2)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_exactly_and_loads_replicated(tmp_path: Path) -> None:
    """Saved under FSDP (pp2 x dp2): resumed there bitwise; loaded under replicate at (pp2, dp1): the same full
    parameters and Adam states as at the save, then the same losses within float32 round-off. The same for a
    checkpoint saved under HSDP (in the same two launches, ``_check_hsdp_checkpoints``)."""
    run_lightning("fsdp_ckpt.py", ["--phase", "save", "--pp", 2, "--dp", 2, "--hsdp", "--out", tmp_path], timeout=1200)
    saved = torch.load(tmp_path / "fsdp-save.pt", weights_only=False)
    clean, from5 = saved["clean"], saved["from5"]
    assert from5["steps"] == list(range(6, 11)) and from5["losses"] == clean["losses"][5:]
    assert not _differences(from5["snap_end"]["params"], clean["snap_end"]["params"])
    assert not _differences(from5["snap_end"]["opt"], clean["snap_end"]["opt"])
    run_lightning(
        "fsdp_ckpt.py",
        ["--phase", "load", "--pp", 2, "--dp", 1, "--data-parallel", "replicate", "--hsdp", "--out", tmp_path],
        timeout=900,
    )
    loaded = torch.load(tmp_path / "fsdp-load-replicate-tp1-pp2-dp1.pt", weights_only=False)
    resumed = loaded["resume"]
    at5 = clean["snap_5"]
    assert len(at5["opt"]) == 3 * len(at5["params"])  # step, exp_avg, exp_avg_sq per parameter
    assert not _differences(resumed["snap_start"]["params"], at5["params"])
    assert not _differences(resumed["snap_start"]["opt"], at5["opt"])
    assert resumed["steps"] == list(range(6, 11))
    for got, want in zip(resumed["losses"], clean["losses"][5:], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (resumed["losses"], clean["losses"][5:])
    _check_hsdp_checkpoints(saved, loaded["resume_hsdp"])


def _check_hsdp_checkpoints(saved: dict, resumed: dict) -> None:
    """HSDP (tp1, pp1, dp4 = 2 replicas x 2 shards, in the save launch): the same losses as FSDP within float32
    round-off (another reduction order), resumed exactly there from its step-5 checkpoint, and that checkpoint
    loaded under replicate at (pp2, dp1) with the same full parameters and Adam states."""
    clean, from5, fsdp = saved["hsdp_clean"], saved["hsdp_from5"], saved["clean"]
    for got, want in zip(clean["losses"], fsdp["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (clean["losses"], fsdp["losses"])
    assert from5["steps"] == list(range(6, 11)) and from5["losses"] == clean["losses"][5:]
    assert not _differences(from5["snap_end"]["params"], clean["snap_end"]["params"])
    assert not _differences(from5["snap_end"]["opt"], clean["snap_end"]["opt"])
    at5 = clean["snap_5"]
    assert len(at5["opt"]) == 3 * len(at5["params"]) > 0
    assert not _differences(resumed["snap_start"]["params"], at5["params"])
    assert not _differences(resumed["snap_start"]["opt"], at5["opt"])
    assert resumed["steps"] == list(range(6, 11))
    for got, want in zip(resumed["losses"], clean["losses"][5:], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (resumed["losses"], clean["losses"][5:])
