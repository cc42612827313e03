"""Lightning's ``ModelPruning`` under pipeline parallelism against one device, saved at one layout and resumed at
another, and refused under data parallelism (``core/pruning.py``, the checkpoint's optimizer keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_weight_averaging import SCRIPT, _assert_same, _run

from launch import run_lightning


@pytest.mark.slow
def test_global_pruning_matches_one_device_and_resumes_at_another_layout(tmp_path: Path) -> None:
    """Global L1 pruning (30% of all weights and biases together, every epoch) at pp2 for two epochs, then resumed
    at pp4 for a third, the head tied to the embedding across the stages: every training and validation loss and
    the final weights' loss match one device (saved and resumed alike) within 1e-10, float64. Before the fix each
    pipeline rank pruned every stage's modules (the others' at their initial values) and chose its own threshold
    over them (the losses drifted by 0.7%); a ``validate`` after ``fit`` died in the callback's second setup; the
    resumed run lost its Adam state without a word (the optimizer was saved under the pruned parameters' names,
    ``weight_orig``, and the resumed model, not pruned yet, asked for ``weight``: 6.8% apart by the end); and the
    last stage saved the pruned head under its own name beside the embedding's, which the resume refused."""
    ref1 = _run(tmp_path, "ref1", "single", "prune-global", 2, save=tmp_path / "ref_ckpt")
    ref2 = _run(tmp_path, "ref2", "single", "prune-global", 3, resume=tmp_path / "ref_ckpt" / "last.ckpt")
    got1 = _run(tmp_path, "got1", "pp2", "prune-global", 2, save=tmp_path / "ckpt")
    got2 = _run(tmp_path, "got2", "pp4", "prune-global", 3, resume=tmp_path / "ckpt" / "last.ckpt")
    _assert_same(ref1, got1)
    _assert_same(ref2, got2)


@pytest.mark.slow
def test_pruning_under_data_parallelism_is_refused(tmp_path: Path) -> None:
    """At pp2 x dp2 every rank stops before training with the reason (it died in the first forward: replicate's
    parameters cannot be renamed by ``torch.nn.utils.prune``)."""
    args = ["--layout", "pp2dp2", "--callback", "prune", "--epochs", 1]
    args += ["--init", tmp_path / "init.pt", "--out", tmp_path / "out.json"]
    result = run_lightning(SCRIPT, args, timeout=300, check=False)
    assert result.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "ModelPruning works with pipeline parallelism only (tp=1, one data-parallel replica)" in result.output
    assert "dp=2, tp=1" in result.output
    assert "global step" not in result.output  # nothing trained
