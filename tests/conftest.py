"""Shared fixtures: single-device reference runs, computed once per test session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from launch import run_lightning

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def parity_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records of the single-device reference for every case of scripts/parity_run.py."""
    out = tmp_path_factory.mktemp("parity_ref")
    run_lightning("parity_run.py", ["--ref", "--out", out], timeout=180)
    return out


@pytest.fixture(scope="session")
def eval_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records of the single-device reference of scripts/eval_run.py."""
    out = tmp_path_factory.mktemp("eval_ref")
    run_lightning("eval_run.py", ["--ref", "--out", out], timeout=180)
    return out


def copy_inits(src: Path, dst: Path) -> None:
    """Give a 3D run the reference's initial weights."""
    for init in src.glob("*.init.pt"):
        shutil.copy(init, dst / init.name)
