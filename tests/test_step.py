"""The user's step inside the pipeline: the warning for random draws made before the body; autograd's anomaly
detection (``Trainer(detect_anomaly=True)``) through the pipeline and tensor parallelism; ``trainer.should_stop`` set
by the step after the model call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_weight_averaging import SCRIPT, _assert_same, _run

from launch import run_lightning


@pytest.mark.slow
def test_random_draws_before_the_body_are_reported_once(tmp_path: Path) -> None:
    """Draws before ``self(x)`` differ between the first stage (body input) and the last (loss): said once, by one
    last-stage rank; draws after the body, or none, are quiet. And fits one after another release each other's
    models on every rank."""
    out = tmp_path / "warnings.json"
    run_lightning("random_step.py", ["--out", out], timeout=180)
    counts = json.loads(out.read_text())
    assert counts["none"] == [[], [], [], []] and counts["after"] == [[], [], [], []], counts
    before = counts["before"]
    # ranks 0-3 are (dp, pp) = (0,0), (0,1), (1,0), (1,1): the last stage of the first replica reports
    assert [len(w) for w in before] == [0, 1, 0, 0], before
    assert "training_step drew random numbers (torch) before calling the body" in before[1][0]
    assert "belongs in the data pipeline" in before[1][0]
    # Three fits in one process: none keeps its model or strategy (reliability's exit hook held the last one's).
    assert counts["alive_after_fits"] == [[], [], [], []], counts["alive_after_fits"]


@pytest.mark.slow
def test_detect_anomaly_matches_one_device_and_reports_nan(tmp_path: Path) -> None:
    """``Trainer(detect_anomaly=True)`` at tp2 x pp2: the losses match one device within 1e-10 (float64), and a NaN
    made in the loss of step 2 stops the run with autograd's report, as on one device. Before the fix the first
    step died at pp2 x dp2 (torch's inference of the gradients' shapes runs a backward of uninitialised inputs,
    whose NaN anomaly detection reported) and at tp2 (DTensor has no sharding rule for the NaN check,
    ``aten._is_any_true``)."""
    ref = _run(tmp_path, "ref", "single", "none", 1, anomaly=True)
    got = _run(tmp_path, "got", "tp2pp2", "none", 1, anomaly=True)
    _assert_same(ref, got)
    args = ["--layout", "tp2pp2", "--callback", "none", "--epochs", 1, "--detect-anomaly", "--nan-step", 2]
    args += ["--init", tmp_path / "init.pt", "--out", tmp_path / "nan.json"]
    result = run_lightning(SCRIPT, args, timeout=300, check=False)
    assert result.returncode != 0 and not (tmp_path / "nan.json").exists()
    assert "RuntimeError: Function 'MulBackward0' returned nan values in its 0th output." in result.output
    assert "failed at global step 2" in result.output


def _stop_run(tmp_path: Path, layout: str, when: str, metric: bool) -> list[dict]:
    out = tmp_path / f"{layout}_{when}"
    args = ["--layout", layout, "--when", when, "--init", tmp_path / "init.pt", "--out", out]
    run_lightning(
        "should_stop_run.py", [*args, *(["--metric"] if metric else [])], timeout=120 if layout == "single" else 300
    )
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "when", "metric"), [("tp2pp2", "batch", False), ("pp2dp2", "loss", True)])
def test_should_stop_set_after_the_model_call_stops_every_rank(
    tmp_path: Path, layout: str, when: str, metric: bool
) -> None:
    """``self.trainer.should_stop = True`` in ``training_step`` after ``self(x)``: that code runs on the last stage
    only, and the other stages went on to the next batch and waited for it until the train timeout (every layout
    with pp > 1). Now the request travels with the batch's logs (in the packed tensor, or with the metrics' states
    by object) and every rank stops after the same batch. At a fixed batch the run matches one device (float64,
    1e-10); on a loss threshold each micro-batch's loss is compared (a micro-batch below it whenever the batch's mean
    is), on any replica, so the run stops at one device's step or earlier."""
    (ref,) = _stop_run(tmp_path, "single", when, metric)
    got = _stop_run(tmp_path, layout, when, metric)
    assert len(got) == 4 and all(row == got[0] for row in got), got  # every rank stopped after the same batch
    assert 0 < ref["step"] < 18, ref  # one device stopped early (3 epochs x 6 batches otherwise)
    if when == "batch":
        assert got[0]["step"] == ref["step"] == 6 + 3, (got[0], ref)
        for key, value in ref["metrics"].items():
            assert abs(got[0]["metrics"][key] - value) <= 1e-10 * abs(value), (key, got[0], ref)
    else:
        assert 0 < got[0]["step"] <= ref["step"], (got[0], ref)
