"""Lightning's single-file checkpoints and ThreeDStrategy (``checkpoint/lightning_file.py``), multi-process.

Scaling a run up: a file plain single-device Lightning wrote, given as ``ckpt_path=`` to a ``ThreeDStrategy`` fit,
continues as one device would (``scripts/ckpt_file_resume.py``). The other direction, a folder read by
single-device Lightning, is checked in ``test_weight_averaging.py`` (folders saved there at two layouts);
``unit/test_lightning_file.py`` covers the pieces in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import run_lightning

SCRIPT = "ckpt_file_resume.py"


@pytest.fixture(scope="module")
def single_device(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One device's checkpoint file after one epoch (4 steps), and one device resuming it to step 8."""
    out = tmp_path_factory.mktemp("lightning_file")
    file = out / "epoch=0-step=4.ckpt"
    run_lightning(SCRIPT, ["--save", file], timeout=120)
    run_lightning(SCRIPT, ["--resume", file, "--single", "--out", out / "ref.pt"], timeout=120)
    return file, torch.load(out / "ref.pt", weights_only=False)


def _largest(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(ref)
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)) for k in ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2", "pp2dp2fsdp"])
def test_single_device_file_resumes_at_a_3d_layout(
    single_device: tuple[Path, dict], tmp_path: Path, layout: str
) -> None:
    """``trainer.fit(model, ckpt_path="epoch=0-step=4.ckpt")`` with a file one device's Lightning wrote was refused
    (*"is a file, not a ThreeDStrategy checkpoint folder"*; only the weights could be taken, by ``LoadWeights``). Now
    the model, Adam's states (numbered in one device's file by the position of each parameter in its two groups;
    a pipeline stage holds one or both groups), each group's learning rate and ``LambdaLR``'s state, and the loops
    resume: at the first resumed step every parameter and optimizer state equals the file's (bitwise), and the
    four resumed steps' losses, parameters and optimizer states equal one device's resume of the same file within
    1e-12 (float64)."""
    file, ref = single_device
    extra = ["--tp", 2, "--pp", 2] if layout == "tp2pp2" else ["--pp", 2, "--dp", 2, "--fsdp"]
    out = tmp_path / "got.pt"
    run_lightning(SCRIPT, ["--resume", file, *extra, "--out", out], timeout=300)
    got = torch.load(out, weights_only=False)
    assert got["steps"] == ref["steps"] == [5, 6, 7, 8]
    assert _largest(ref["snap_start"]["params"], got["snap_start"]["params"]) == 0.0
    assert _largest(ref["snap_start"]["opt"], got["snap_start"]["opt"]) == 0.0
    assert len(ref["snap_start"]["opt"]) == 3 * len(ref["snap_start"]["params"])  # Adam: step, exp_avg, exp_avg_sq
    for a, b in zip(ref["losses"], got["losses"], strict=True):
        assert abs(a - b) <= 1e-12 * abs(a), (ref["losses"], got["losses"])
    for snap in ("snap_5", "snap_end"):
        assert _largest(ref[snap]["params"], got[snap]["params"]) <= 1e-12, snap
        assert _largest(ref[snap]["opt"], got[snap]["opt"]) <= 1e-12, snap
