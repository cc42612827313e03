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

import pytest
from conftest import copy_inits
from launch import run_lightning
from parity_check import check_replicas, compare, load

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 4)]
CASES = ["mlp64", "gpt64", "mlp32", "gpt32", "mlp32acc"]


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
        found = compare(ref, got, case[3:5]) + check_replicas(got)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])
