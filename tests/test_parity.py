"""Parity of ThreeDStrategy with single-device training of the same model on the same global batch.

For each (tp, pp, dp) layout, one launch trains every case of scripts/parity_run.py (an attention model and
an MLP; float64 and float32; Adam with clipping and a step LR scheduler; gradient accumulation; models built
in configure_model (meta) or __init__) starting from the reference's weights. Compared: step-1 loss and
every gradient (float32 rtol 1e-5 / atol 4e-5, float64 1e-10), every logged value and the returned loss
each step, the global gradient norm before clipping, and the final parameters (float32 relative 1e-4); then
data-parallel replicas bitwise identical and the data each rank read, and each rank's exact share of the
parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import copy_inits
from launch import run_lightning
from parity_check import check_replicas, compare, load, schedule_tags

# Which parameters the Megatron layout shards over tp (written out here, independently of the planner):
# column-parallel weights and biases, row-parallel weights (their biases stay whole), vocabulary-parallel
# embeddings and the gathered LM head. Norms and row-parallel biases are replicated, counted whole.
SHARDED = {
    "gpt": (
        "tok.weight",
        "pos.weight",
        "q_proj.",
        "k_proj.",
        "v_proj.",
        "fc.",
        "out_proj.weight",
        "proj.weight",
        "lm_head.",
    ),
    "mlp": ("body.0.", "body.4.", "body.2.weight", "body.6.weight"),
}


def expected_share(name: str, numel: int, model: str, tp: int) -> int:
    return numel // tp if any(key in name for key in SHARDED[model]) else numel


def check_shares(got: dict, ref: dict, model: str, tp: int) -> list[str]:
    """Each rank holds exactly its share: its stage's parameters, tensor-parallel ones split tp ways."""
    problems, owners = [], {}
    full = {name: t.numel() for name, t in ref["params"].items()}
    for rank in got["ranks"]:
        pp_i = rank["coords"][1]
        for name, numel in rank["numels"].items():
            if name not in full:
                problems.append(f"rank {rank['coords']} holds unknown parameter {name}")
                continue
            if numel != expected_share(name, full[name], model, tp):
                problems.append(
                    f"rank {rank['coords']}: {name} has {numel} elements, expected "
                    f"{expected_share(name, full[name], model, tp)} of {full[name]}"
                )
            owners.setdefault(name, set()).add(pp_i)
    for name in full:
        if len(owners.get(name, ())) != 1:
            problems.append(f"{name} is held by pipeline stages {sorted(owners.get(name, ()))}, expected exactly one")
    return problems


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 4)]
CASES = ["mlp64", "gpt64", "mlp32", "gpt32", "mlp32acc", "gptbf"]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_parity_with_single_device(parity_reference, tmp_path, tp, pp, dp):
    copy_inits(parity_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--tp", tp, "--pp", pp, "--dp", dp, "--micro", 4, "--out", tmp_path],
        timeout=300,
    )
    problems = []
    for case in CASES:
        ref, got = load(parity_reference, case), load(tmp_path, case)
        found = compare(ref, got, case[3:5]) + check_replicas(got) + check_shares(got, ref, case[:3], tp)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


SCHEDULES = [("gpipe", 1, 2), ("interleaved1f1b", 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "stages_per_rank", "dp"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_other_schedules_match_single_device(parity_reference, tmp_path, schedule, stages_per_rank, dp):
    """GPipe, and interleaved 1F1B with two stages per rank (four stages over pp=2), give the same numbers; bf16-mixed
    too, where each rank's two stages keep autocast's weight casts for the batch (``pipeline.cast_cache``)."""
    copy_inits(parity_reference, tmp_path)
    cases = ["mlp64", "gpt32", "mlp32acc", "gptbf"]
    run_lightning(
        "parity_run.py",
        [
            "--pp",
            2,
            "--dp",
            dp,
            "--schedule",
            schedule,
            "--stages-per-rank",
            stages_per_rank,
            "--micro",
            4,
            "--cases",
            ",".join(cases),
            "--out",
            tmp_path,
        ],
        timeout=300,
    )
    problems = []
    for case in cases:
        found = compare(load(parity_reference, case), load(tmp_path, case), case[3:5]) + check_replicas(
            load(tmp_path, case)
        )
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


# every zero-bubble and V schedule (two stages per rank), in one launch per layout
ZERO_BUBBLE = ["interleavedzerobubble", "zbvzerobubble", "dualpipev"]
# a schedule read from a CSV action list (torch's _PipelineScheduleRuntime): ZBV zero-bubble at pp2, V placement, m4,
# written from torch's own ScheduleZBVZeroBubble (lightning_3d.core.pipeline.write_csv_schedule)
CSV_SCHEDULE = Path(__file__).resolve().parents[1] / "conf" / "schedules" / "zbv_pp2_m4.csv"


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2)], ids=["pp2-dp2", "tp2-pp2-dp2"])
def test_zero_bubble_and_v_schedules_match_single_device(parity_reference, tmp_path, tp, dp):
    """Backward split into input- and weight-gradient actions (the weight part deferred: the linear layers'
    products kept by ``I`` for ``W``, ``split_backward="linear"``, on their DTensor shards at tp2), with two stages
    per rank and with one (``interleavedzerobubble``: ZB-H1), and the V placement (stage i and 3 - i on pp rank
    i), give single-device numbers: float64 step-1 gradients, float32 20 steps."""
    copy_inits(parity_reference, tmp_path)
    cases = ["mlp64", "gpt32"]
    runs = [(name, 2) for name in ZERO_BUBBLE] + [("interleavedzerobubble", 1)]
    runs += [(str(CSV_SCHEDULE), 2)] if tp == 1 else []  # the CSV action list: at pp2 x dp2 only
    schedules = ",".join(f"{name}:{spr}" for name, spr in runs)
    run_lightning(
        "parity_run.py",
        ["--tp", tp, "--pp", 2, "--dp", dp, "--schedules", schedules, "--micro", 4, "--cases", ",".join(cases),
         "--out", tmp_path],
        timeout=900,
    )  # fmt: skip
    problems, passes = [], []
    for (name, spr), tag in zip(runs, schedule_tags(runs)):
        for case in cases:  # (the launch runs them in this order)
            ref, got = load(parity_reference, case), load(tmp_path, f"{case}@{tag}")
            found = compare(ref, got, case[3:5]) + check_replicas(got) + check_shares(got, ref, case[:3], tp)
            problems += [f"{name} {case}: {p}" for p in found]
            passes.append((spr, [r["coords"][1] for r in got["ranks"]], [r["deferred_w"] for r in got["ranks"]]))
    assert not problems, "\n".join(problems[:40])
    # split_backward="linear" (the default): every run's W actions computed the linear layers' kept products (each
    # process's count grows run by run), at tp2 on the layers' DTensor shards: on every rank with two stages per
    # rank; with one, on pp rank 1 only (stage 0 keeps torch's split: nothing waits for its input's gradient)
    before = [0] * len(passes[0][2])
    for spr, pp_ranks, counts in passes:
        grew = [b > a for a, b in zip(before, counts, strict=True)]
        assert grew == [spr == 2 or pp_rank != 0 for pp_rank in pp_ranks], passes
        before = counts


@pytest.mark.slow
def test_boundaries_inside_layers_match_single_device(parity_reference, tmp_path):
    """Every stage boundary inside a layer (pieces.py: a block's attention on one stage and its MLP on the next, the
    head's norm and its projection apart), at tp2 x pp2 x dp2 under 1F1B and the V placement (where one rank holds
    both parts of a block, in two stages): single-device numbers (float64 step-1 gradients, float32 20 steps), every
    parameter on exactly one stage under its own name. FSDP and activation checkpointing: tests/test_fsdp.py."""
    copy_inits(parity_reference, tmp_path)
    cases, tp, schedules = ["gpt64", "gpt32"], 2, "1f1b:1,zbvzerobubble:2"
    run_lightning(
        "parity_run.py",
        ["--tp", tp, "--pp", 2, "--dp", 2, "--partitioner", "inside", "--schedules", schedules, "--micro", 4,
         "--cases", ",".join(cases), "--out", tmp_path],
        timeout=600,
    )  # fmt: skip
    problems = []
    for name in schedules.split(","):
        tag = name.split(":")[0]
        for case in cases:
            ref, got = load(parity_reference, case), load(tmp_path, f"{case}@{tag}")
            found = compare(ref, got, case[3:5]) + check_replicas(got) + check_shares(got, ref, case[:3], tp)
            problems += [f"{tag} {case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])
