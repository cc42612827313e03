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
replica's shards adding up once and the replicas holding the same shards, one all-reduce across the replicas per
unit and optimizer step; models built in ``configure_model`` materialised directly as HSDP shards: the initial
parameters equal one process's materialisation with the same seed (max abs difference 0.0) and building the stages
peaks at the rank's parameter share plus one layer whole (``nano64``: two blocks per stage). A checkpoint saved
under HSDP (tp1, pp1, dp4) resumed exactly there and loaded replicated at (pp2, dp1).

``fsdp_reshard_after_backward=True`` (ZeRO-3 under micro-batches) in the same launches: parity at tp2 x pp2 x dp2
(1F1B, m = 4; float64 gradients within 1e-10, float32 20 steps within 1e-4, gradient accumulation) and under HSDP
at pp2 x dp4, with the collectives of that mode per optimizer step: m reduce-scatters and 2m all-gathers per unit
and batch, and still one all-reduce across HSDP replicas per unit and optimizer step, accumulation included.

``fsdp_unit="submodule"`` (with ``fsdp_reshard_after_backward=True``, the memory choice) in the same launches: parity
at tp2 x pp2 x dp2 (1F1B: float64 gradients within 1e-10, float32 20 steps within 1e-4) and under HSDP, with the
units the model's structure gives (every parameter-owning submodule of a block: 10 per rank) and their collectives
(m reduce-scatters and 2m all-gathers per unit and batch), the initial parameters of the meta-built cases equal to one
process's materialisation and their build peak within the share + one layer; and in the combination launches with
activation checkpointing, two interleaved stages per rank and compiled blocks.
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


def check_collectives(got: dict, accumulate: int, micro: int | None = None, hsdp: bool = False) -> list[str]:
    """After the first optimizer step (torch's shape inference runs extra passes), the FSDP collectives of each
    optimizer step, per FSDP unit of the rank. Default (``micro=None``): exactly one reduce-scatter per unit,
    however many micro-batches and batches, and one all-gather per unit per batch (gathered once for all
    micro-batches; a batch that defers its reduce-scatter under gradient accumulation still reshards at its end).
    ``fsdp_reshard_after_backward=True`` (``micro`` = m micro-batches per batch): per batch, one reduce-scatter per
    unit per micro-batch and two all-gathers (its forward's and its backward's, resharded after each), deferred
    batches alike. HSDP (``hsdp``): one all-reduce across the replicas per unit and optimizer step in both modes
    (none counted otherwise)."""
    problems = []
    for rank in got["ranks"]:
        units = rank["fsdp_units"]
        steps = rank["collectives"][1:]
        if units < 2 or not steps:
            problems.append(f"rank {rank['coords']}: {units} FSDP units, {len(steps)} steps counted")
        if micro is None:
            want = (units, units * accumulate)
        else:
            want = (units * micro * accumulate, units * 2 * micro * accumulate)
        want += (units if hsdp else 0,)
        for i, counted in enumerate(steps):
            if tuple(counted) != want:
                problems.append(
                    f"rank {rank['coords']} step {i + 2}: (reduce-scatters, all-gathers, replica all-reduces) = "
                    f"{tuple(counted)}, expected {want} for {units} FSDP units (accumulate={accumulate}, "
                    f"micro={micro})"
                )
    return problems


def check_materialised(got: dict) -> list[str]:
    """A model built on the meta device, materialised as HSDP shards: rank 0's gathered initial parameters equal one
    process's materialisation (max abs difference 0.0), and no rank's build peaked above its parameter share plus
    the largest layer it holds whole (+ 4 KiB of device-mesh rank tables; the whole stage would be more)."""
    problems = []
    diffs = [r["materialised"]["init_max_abs_diff"] for r in got["ranks"]]
    if diffs[0] != 0.0 or any(d is not None for d in diffs[1:]):
        problems.append(f"initial parameters vs one process: max abs differences {diffs}")
    for rank in got["ranks"]:
        m = rank["materialised"]
        goal = m["param_share_bytes"] + m["largest_layer_full_bytes"] + 4096
        if m["build_peak"] > goal:
            problems.append(
                f"rank {rank['coords']}: building the stages peaked at {m['build_peak']} B > share "
                f"{m['param_share_bytes']} + one layer {m['largest_layer_full_bytes']} + 4096"
            )
    return problems


def check_submodule_units(got: dict, model: str) -> list[str]:
    """Under ``fsdp_unit="submodule"`` every rank wraps the units its stages' structure gives
    (:data:`SUBMODULE_UNITS`), not the strategy's own count of them alone."""
    want = SUBMODULE_UNITS[model]
    wrong = [r for r in got["ranks"] if r["fsdp_units"] != want]
    return [f"rank {r['coords']}: {r['fsdp_units']} FSDP units, expected {want}" for r in wrong]


def _replicas_read_their_batches(got: dict) -> list[str]:
    # FSDP ranks hold different shards: only the data part of check_replicas applies
    return [p for p in check_replicas(got) if "data-parallel replicas differ" not in p]


LAYOUTS = {
    (2, 2, 2): ["mlp64", "gpt64", "gpt32", "mlp32acc", "nanotied64", "nanotied32"],
    (1, 2, 4): ["gpt64", "gpt32", "mlp32acc", "gptbf"],
}
# data_parallel="hsdp" in the same launch, after the FSDP cases: dp 4 = 2 replicas x 2 shards (dp_shard=2)
HSDP_CASES = {(1, 2, 4): ["gpt64", "gpt32", "nanotied64", "nano64"]}
HSDP_SHARD = 2
MICRO = 4  # micro-batches per batch in these launches (1F1B at pp2)
# fsdp_reshard_after_backward=True in the same launch, after the other cases (fsdp, and hsdp)
RAB_CASES = {(2, 2, 2): ["gpt64", "gpt32", "mlp32acc"]}
HSDP_RAB_CASES = {(1, 2, 4): ["gpt64", "mlp32acc"]}
# fsdp_unit="submodule" with fsdp_reshard_after_backward=True in the same launch, after those (fsdp, and hsdp)
SUB_RAB_CASES = {(2, 2, 2): ["gpt64", "gpt32"]}
HSDP_SUB_RAB_CASES = {(1, 2, 4): ["gpt64"]}
# FSDP units per rank of tests/models.py's TinyGPT under fsdp_unit="submodule", from its structure: 4 layers (Embed:
# tok, pos; 2 x Block: ln1, ln2, q_proj, k_proj, v_proj, out_proj, fc, proj; Head: ln, lm_head), split 2 + 2 over pp2
# (or 1 + 1 + 1 + 1 over two interleaved stages per rank): every rank holds one Block (8 units) and the Embed or the
# Head (2); the Embed, Block and Head modules and the stage root own no parameter themselves, so they gather nothing
SUBMODULE_UNITS = {"gpt": 10}


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
    every = [*LAYOUTS.values(), *HSDP_CASES.values(), *RAB_CASES.values(), *HSDP_RAB_CASES.values()]
    every += [*SUB_RAB_CASES.values(), *HSDP_SUB_RAB_CASES.values()]
    cases = sorted({case for cases in every for case in cases})
    run_lightning("parity_run.py", ["--ref", "--cases", ",".join(cases), "--out", out], timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "dp"), list(LAYOUTS), ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_fsdp_parity_with_single_device(fsdp_reference, tmp_path, tp, pp, dp):
    parity_reference = fsdp_reference
    copy_inits(parity_reference, tmp_path)
    cases = LAYOUTS[(tp, pp, dp)]
    layout = ["--tp", tp, "--pp", pp, "--dp", dp, "--micro", MICRO, "--data-parallel", "fsdp"]
    hsdp, hsdp_rab = HSDP_CASES.get((tp, pp, dp), []), HSDP_RAB_CASES.get((tp, pp, dp), [])
    rab, sub_rab = RAB_CASES.get((tp, pp, dp), []), SUB_RAB_CASES.get((tp, pp, dp), [])
    hsdp_sub_rab = HSDP_SUB_RAB_CASES.get((tp, pp, dp), [])
    if hsdp or hsdp_rab or hsdp_sub_rab:
        layout += ["--hsdp-cases", ",".join(hsdp), "--hsdp-rab-cases", ",".join(hsdp_rab), "--dp-shard", HSDP_SHARD]
        layout += ["--hsdp-sub-rab-cases", ",".join(hsdp_sub_rab)]
    if rab or sub_rab:
        layout += ["--rab-cases", ",".join(rab), "--sub-rab-cases", ",".join(sub_rab)]
    run_lightning(
        "parity_run.py",
        [*layout, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=1800 if hsdp or rab else 1200,
    )
    runs = [(case, "", False) for case in cases] + [(case, "@rab", True) for case in rab]
    runs += [(case, "@sub-rab", True) for case in sub_rab]
    runs += [(case, "@hsdp", False) for case in hsdp] + [(case, "@hsdp-rab", True) for case in hsdp_rab]
    runs += [(case, "@hsdp-sub-rab", True) for case in hsdp_sub_rab]
    problems = []
    for case, tag, reshard_after_backward in runs:
        ref, got = load(parity_reference, case), load(tmp_path, f"{case}{tag}")
        accumulate = 2 if case.endswith("acc") else 1
        # float64 within 1e-10, float32 20 steps (clipped by the norm of the sharded gradients) within 1e-4
        found = compare(ref, got, case[-2:] if case[-2:] in ("64", "32") else case[3:5])
        model = case[:3] if case[:3] in ("gpt", "mlp") else re.sub(r"\d+$", "", case)
        found += _replicas_read_their_batches(got)
        if tag.startswith("@hsdp"):
            found += check_hsdp_shares(got, ref, model, tp, dp, HSDP_SHARD)
        else:
            found += check_fsdp_shares(got, ref, model, tp, dp)
        # per shard group as FSDP, plus HSDP's all-reduces across the replicas
        found += check_collectives(got, accumulate, MICRO if reshard_after_backward else None, tag.startswith("@hsdp"))
        if "sub" in tag:
            found += check_submodule_units(got, model)
        if (tag == "@hsdp" or "sub" in tag) and case in BUILT_ON_META:
            found += check_materialised(got)
        problems += [f"{case}{tag}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


# the HSDP cases parity_run.py builds in configure_model (the meta device under ThreeDStrategy; nanotied64 is built
# in __init__): their records say how HSDP materialised them
BUILT_ON_META = ("gpt64", "gpt32", "nano64")


COMBINATIONS = {  # pp2 x dp2 with the other features, one launch each: parity and shares (not the FSDP counts)
    # each with one more case under fsdp_unit="submodule" and fsdp_reshard_after_backward=True (its units, counts)
    "fsdp+checkpointing": ["--data-parallel", "fsdp", "--activation-checkpointing", "full", "--sub-rab-cases", "gpt64"],
    # and one under fsdp_reshard_after_backward=True alone (two FSDP roots per rank)
    "fsdp+interleaved": [
        "--data-parallel",
        "fsdp",
        "--schedule",
        "interleaved1f1b",
        "--stages-per-rank",
        2,
        "--rab-cases",
        "gpt64",
        "--sub-rab-cases",
        "gpt64",
    ],
    # every stage boundary inside a layer (pieces.py) under the V placement, with activation checkpointing
    "fsdp+inside": [
        "--data-parallel",
        "fsdp",
        "--partitioner",
        "inside",
        "--schedule",
        "zbvzerobubble",
        "--stages-per-rank",
        2,
        "--activation-checkpointing",
        "full",
    ],
    # (the submodule case under fsdp, the launch's own cases under replicate)
    "buckets+compile": ["--compile-backend", "aot_eager", "--sub-rab-cases", "gpt64"],
}


@pytest.mark.slow
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_data_parallel_combined_with_other_features(fsdp_reference, tmp_path, combination):
    """FSDP with activation checkpointing and with two interleaved stages per rank (also under
    ``fsdp_reshard_after_backward=True``: m reduce-scatters and 2m all-gathers per unit), and the bucketed
    replicate (a group per block) with compiled blocks: the same numbers as one process (float64 within 1e-10,
    float32 20 steps within 1e-4 relative). In each launch one more case under ``fsdp_unit="submodule"`` with
    ``fsdp_reshard_after_backward=True`` (FSDP over compiled blocks in the compile launch): parity, its units and
    m reduce-scatters and 2m all-gathers per unit (under activation checkpointing too: FSDP2 does not reshard a unit
    the recomputation gathers, so its backward gathers nothing more)."""
    copy_inits(fsdp_reference, tmp_path)
    cases = ["gpt64", "gpt32"]
    options = COMBINATIONS[combination]
    layout = ["--pp", 2, "--dp", 2, "--micro", MICRO, *options]
    run_lightning("parity_run.py", [*layout, "--cases", ",".join(cases), "--out", tmp_path], timeout=900)
    runs = [(case, "") for case in cases]
    for flag, tag in (("--rab-cases", "@rab"), ("--sub-rab-cases", "@sub-rab")):
        if flag in options:
            runs += [(case, tag) for case in str(options[options.index(flag) + 1]).split(",")]
    problems = []
    for case, tag in runs:
        got = load(tmp_path, f"{case}{tag}")
        found = compare(load(fsdp_reference, case), got, case[-2:])
        if combination.startswith("fsdp") or tag:
            found += check_fsdp_shares(got, load(fsdp_reference, case), "gpt", 1, 2)
        if tag:
            found += check_collectives(got, 1, MICRO)
        if tag == "@sub-rab":
            found += check_submodule_units(got, "gpt")
        problems += [f"{case}{tag}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_exactly_and_loads_replicated(tmp_path: Path) -> None:
    """Saved under FSDP (pp2 x dp2): resumed there bitwise; loaded under replicate at (pp2, dp1): the same full
    parameters and Adam states as at the save, then the same losses within float32 round-off. The same for a
    checkpoint saved under HSDP and one saved under ``fsdp_unit="submodule"`` (in the same two launches,
    ``_check_hsdp_checkpoints``, ``_check_submodule_checkpoints``)."""
    save = ["--phase", "save", "--pp", 2, "--dp", 2, "--hsdp", "--submodule", "--out", tmp_path]
    run_lightning("fsdp_ckpt.py", save, timeout=1200)
    saved = torch.load(tmp_path / "fsdp-save.pt", weights_only=False)
    clean, from5 = saved["clean"], saved["from5"]
    assert from5["steps"] == list(range(6, 11)) and from5["losses"] == clean["losses"][5:]
    assert not _differences(from5["snap_end"]["params"], clean["snap_end"]["params"])
    assert not _differences(from5["snap_end"]["opt"], clean["snap_end"]["opt"])
    load = ["--phase", "load", "--pp", 2, "--dp", 1, "--data-parallel", "replicate", "--hsdp", "--submodule"]
    run_lightning("fsdp_ckpt.py", [*load, "--out", tmp_path], timeout=900)
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
    _check_submodule_checkpoints(saved, loaded["resume_sub"])


def _check_submodule_checkpoints(saved: dict, resumed: dict) -> None:
    """``fsdp_unit="submodule"`` (pp2 x dp2, in the save launch; a model whose parameters sit one module below the
    body's layers, so each inner Linear is its own FSDP unit): the checkpoint keys are the unwrapped names, the run
    resumed exactly from its step-5 checkpoint, and that checkpoint loaded under replicate at (pp2, dp1) with the same
    full parameters and Adam states."""
    clean, from5 = saved["sub_clean"], saved["sub_from5"]
    at5 = clean["snap_5"]
    names = [f"body.{i}.0.{k}" for i in range(3) for k in ("bias", "weight")] + ["body.3.bias", "body.3.weight"]
    assert sorted(at5["params"]) == names  # as unwrapped: FSDP2 keeps every name
    _check_step5_resumes(clean, from5, resumed)


def _check_hsdp_checkpoints(saved: dict, resumed: dict) -> None:
    """HSDP (tp1, pp1, dp4 = 2 replicas x 2 shards, in the save launch): the same losses as FSDP within float32
    round-off (another reduction order), resumed exactly there from its step-5 checkpoint, and that checkpoint
    loaded under replicate at (pp2, dp1) with the same full parameters and Adam states."""
    clean, from5, fsdp = saved["hsdp_clean"], saved["hsdp_from5"], saved["clean"]
    for got, want in zip(clean["losses"], fsdp["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (clean["losses"], fsdp["losses"])
    _check_step5_resumes(clean, from5, resumed)


def _check_step5_resumes(clean: dict, from5: dict, resumed: dict) -> None:
    """A 10-step run's step-5 checkpoint: resumed in the same layout (``from5``) it ends bitwise where the clean
    run ends; loaded in another layout (``resumed``) it starts from the same full parameters and Adam states and
    gives the clean run's losses within float32 round-off."""
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
