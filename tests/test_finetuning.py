"""Lightning's ``BaseFinetuning`` (freeze before training, unfreeze into a new parameter group at epoch 1) under
pp2 x dp2 and tp2 x pp2 against one device (``core/finetuning.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_weight_averaging import SCRIPT, _assert_same, _run

from launch import run_lightning


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2dp2", "tp2pp2"])
def test_unfreezing_matches_one_device(tmp_path: Path, layout: str) -> None:
    """Training and validation losses of two epochs match one device within 1e-10 (float64; the first block and
    the head frozen, one on each stage). Before the fix the unfreezing hung at pp2 x dp2 (a collective
    ``torch.equal`` per pair of DTensor parameters) and raised at tp2 x pp2 (a DTensor against a plain tensor)."""
    ref = _run(tmp_path, "ref", "single", "finetune", 2)
    got = _run(tmp_path, "got", layout, "finetune", 2)
    _assert_same(ref, got)


@pytest.mark.slow
def test_unfreezing_one_end_of_a_weight_tied_across_stages_is_refused(tmp_path: Path) -> None:
    """The head tied to the embedding, the head unfrozen alone: on one device that unfreezes the shared tensor; at
    pp2 x dp2 the first stage's copy would stay frozen and out of its optimizer while the last stage's trains, and
    the copies would drift apart without a word. Every rank stops at the first step of epoch 1 with the reason."""
    args = ["--layout", "pp2dp2", "--callback", "finetune", "--epochs", 2, "--tied-finetune"]
    args += ["--init", tmp_path / "init.pt", "--out", tmp_path / "out.json"]
    result = run_lightning(SCRIPT, args, timeout=300, check=False)
    assert result.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "the weight tied as transformer.wte.weight / lm_head.weight is trainable on one pipeline stage" in (
        result.output
    )
    assert "failed at global step 4" in result.output  # the first step of epoch 1, after the unfreezing
