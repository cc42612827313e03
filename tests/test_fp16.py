"""``precision="16-mixed"`` under ThreeDStrategy against single-device Lightning (scripts/fp16_run.py).

One single-process reference and ONE 4-rank launch (pp=2 x dp=2 with a checkpoint and a resume, then tp=2 x dp=2
under FSDP),
all with ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", init_scale=2**24, ...))`` (Lightning turns
the ``"16-mixed"`` string into bf16 on CPU) and the default ``on_nonfinite="raise"`` (a scaler overflow must not
raise). Compared per step and per rank: the scale after the step (the same skipped steps, back-offs and growths:
step 0 overflows at the initial scale, step 5's loss is made huge), the returned and logged losses (within 2e-2);
the scale and growth tracker a fresh Trainer resumes with equal the reference's at the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import run_lightning

TOL = 2e-2
SKIPPED = [0, 5]  # the script's initial-scale overflow and its huge-loss step
RESUME_AT = 8


def _load(out: Path, case: str, rank: int) -> dict:
    return json.loads((out / f"{case}.rank{rank}.json").read_text())


def _skipped(scales: list[float], init: float) -> list[int]:
    return [i for i, s in enumerate(scales) if s < ([init, *scales][i])]


@pytest.mark.slow
def test_fp16_loss_scaling_matches_single_device(tmp_path):
    run_lightning("fp16_run.py", ["--ref", "--out", tmp_path], timeout=180)
    ref = _load(tmp_path, "ref", 0)
    assert _skipped(ref["scale"], 2.0**24) == SKIPPED, ref["scale"]  # the reference itself skips what we force
    assert max(ref["scale"]) > min(ref["scale"][1:5]), "no growth in the reference"
    run_lightning("fp16_run.py", ["--out", tmp_path], timeout=720)
    problems = []
    for case in ("pp2dp2", "tp2dp2fsdp"):
        for rank in range(4):
            got = _load(tmp_path, case, rank)
            where = f"{case} rank {rank}"
            if got["scale"] != ref["scale"]:
                problems.append(f"{where}: scales {got['scale']} != reference {ref['scale']}")
            if got["skipped"] != SKIPPED:
                problems.append(f"{where}: skipped steps {got['skipped']} != {SKIPPED}")
            for key in ("ce", "loss"):
                for step, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
                    if abs(a - b) > TOL * max(1.0, abs(b)):
                        problems.append(f"{where}: {key} at step {step}: {a} vs reference {b}")
            if case == "pp2dp2":
                expected = [ref["scale"][RESUME_AT - 1], ref["tracker"][RESUME_AT - 1]]
                if got["resumed_scale"] != expected:
                    problems.append(f"{where}: resumed with (scale, tracker) {got['resumed_scale']} != {expected}")
    assert not problems, "\n".join(problems)
