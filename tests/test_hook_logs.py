"""``self.log`` in the gradient hooks under tp2 x pp2 against one device (``core/hook_logs.py``, ``grad_norm``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launch import run_lightning


@pytest.mark.slow
def test_gradient_hook_logs_match_one_device(tmp_path: Path) -> None:
    """Every parameter's gradient norm (2 and inf) and the totals, logged in ``on_before_optimizer_step`` with
    ``sync_dist=True``, and a sum over processes logged by a callback's ``on_after_backward``: rank 0 under
    tp2 x pp2 logs the keys and values one device logs (float64, 1e-10 relative), and nothing waits. The same run
    checks ``self.all_gather`` in ``training_step`` (over the replicas, not the world)."""
    init = tmp_path / "init.pt"
    run_lightning("hook_logs_run.py", ["--single", "--init", init, "--out", tmp_path / "single.json"], timeout=120)
    run_lightning("hook_logs_run.py", ["--init", init, "--out", tmp_path / "3d.json"], timeout=240)
    single = json.loads((tmp_path / "single.json").read_text())
    three_d = json.loads((tmp_path / "3d.json").read_text())
    assert len(single) == len(three_d) == 4
    for step, (ref, got) in enumerate(zip(single, three_d, strict=True)):
        assert set(got) == set(ref), (step, sorted(set(ref) ^ set(got)))
        assert sum(k.startswith("grad_2.0_norm/") for k in ref) > 40  # every parameter of the model, both stages
        assert got["backward_calls"] == 1.0
        assert "gathered_loss" in got and "train_loss" in got
        for key, value in ref.items():
            assert math.isclose(got[key], value, rel_tol=1e-10, abs_tol=1e-14), (step, key, got[key], value)
