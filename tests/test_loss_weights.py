"""Label-token weighting (``loss_weighting="auto"``) against one device: a Hugging Face causal LM fine-tuned on
padded, prompt-masked batches, whose loss is a mean over the batch's label tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import run_lightning


def _run(tmp_path: Path, layout: str, loss: str) -> dict:
    out = tmp_path / f"{layout}_{loss}.json"
    args = ["--layout", layout, "--loss", loss, "--init", tmp_path / f"init_{loss}.pt", "--out", out]
    if layout != "single":
        args += ["--ref", tmp_path / f"single_{loss}.pt"]
    run_lightning("label_weights_run.py", args, timeout=120 if layout == "single" else 300)
    return json.loads(out.read_text())


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "loss"), [("pp2dp2", "own"), ("dp4", "own"), ("pp2dp2", "hf")])
def test_label_tokens_weigh_micro_batches_and_replicas_as_one_device(tmp_path: Path, layout: str, loss: str) -> None:
    """Micro-batches and replicas hold different numbers of label tokens (asserted: 10, 15, 18 and 12 in the first
    batch at pp2 x dp2). Weighted by samples, as before, the parameters after four AdamW steps were 0.068 off one
    device's and the logged losses 2e-3 off. By label tokens: one device's numbers, float64 to round-off for the
    step's own loss (training and validation losses, a token accuracy, the final parameters); the model's own
    ``.loss``, which Hugging Face computes in float32, to float32 round-off. At dp4 a micro-batch is one sample, and
    one sample has no label token (its mean loss is NaN: the run stopped with ``NonFiniteError`` at step 1); it
    counts for nothing, as on one device."""
    ref, got = _run(tmp_path, "single", loss), _run(tmp_path, layout, loss)
    assert len(set(got["counts"])) > 1, got["counts"]  # uneven: sample weighting would not be exact
    if layout == "dp4":
        assert got["fewest_labels"] == 0, got
    rel, params = (1e-12, 1e-12) if loss == "own" else (1e-6, 1e-4)
    assert len(got["train"]) == len(ref["train"]) == 4
    for a, b in zip(got["train"], ref["train"], strict=True):
        assert _close(a, b, rel), (got["train"], ref["train"])
    assert set(got["metrics"]) == set(ref["metrics"])
    for key, value in ref["metrics"].items():
        assert _close(got["metrics"][key], value, rel), (key, got["metrics"], ref["metrics"])
    assert got["param_diff"] < params, got["param_diff"]
