"""The user's step inside the pipeline: the warning for random draws made before the body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
