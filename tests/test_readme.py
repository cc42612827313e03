"""The README's example and commands: the example runs as written and matches single-device training; the
quickstart commands are the ones CI runs; the annotated CLI commands are the ones the CLI tests run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from launch import ROOT, run_lightning

README = (ROOT / "README.md").read_text()
REL = 1e-4  # float32, 8 AdamW steps: the parity tests' relative tolerance on trained parameters


def _bash_lines() -> list[str]:
    """Shell command lines of the README's bash blocks, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M):
        text = block.replace("\\\n", " ")
        lines += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines


@pytest.mark.slow
def test_readme_example_trains_like_a_single_device(tmp_path: Path) -> None:
    """The ``Classifier`` + ``Trainer(devices=8, strategy=ThreeDStrategy(tp=2, pp=2, micro_batches=4))`` blocks."""
    run_lightning("readme_example.py", ["--single", "--out", tmp_path], timeout=120)
    job = run_lightning("readme_example.py", ["--out", tmp_path], timeout=240)
    assert "world=8 = dp 2 x pp 2 x tp 2" in job.output, job.tail()
    ref, got = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "3d.pt")
    assert len(ref["losses"]) == len(got["losses"]) == 8
    assert ref["losses"][-1] < 0.8 * ref["losses"][0], "the reference did not learn: the comparison would be weak"
    for step, (want, have) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(have - want) <= REL * abs(want), (step, ref["losses"], got["losses"])
    for key in ("train_loss", "val_loss"):  # what the example logs, as rank 0's callbacks see it
        assert key in got["logged"], got["logged"]
        assert abs(got["logged"][key] - ref["logged"][key]) <= REL * abs(ref["logged"][key]), (key, ref, got)


def test_quickstart_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    main_job, tests = [ln for ln in _bash_lines() if ln.startswith("pip install torch==2.13.0")][:2]
    assert main_job.endswith("OMP_NUM_THREADS=1 python -m lightning_3d.train")
    assert tests.endswith("OMP_NUM_THREADS=1 python -m pytest -q")
    assert "pip install torch==2.13.0\n" in ci and 'pip install -e ".[test,hf]"' in ci
    assert "export OMP_NUM_THREADS=1" in ci
    assert '"$PYTHON" -m pytest -q' in ci and '"$PYTHON" -m lightning_3d.train 2>&1' in ci, "CI must run both as is"


def test_cli_commands_marked_as_tested_are_the_tested_ones() -> None:
    """Each README command annotated "(tests/test_cli.py runs this)": its arguments appear in tests/test_cli.py."""
    cli_tests = (ROOT / "tests" / "test_cli.py").read_text()
    marked = re.findall(r"^# [^\n]*\(tests/test_cli\.py runs this[^\n]*\)\n(.*?)(?=\n\n|\n#|\Z)", README, re.S | re.M)
    assert len(marked) == 3, marked  # two Hydra commands, one torchrun
    for command in marked:
        words = shlex.split(command.replace("\\\n", " "))
        overrides = [w for w in words if "=" in w or w.startswith("--")]
        missing = [w for w in overrides if f'"{w}"' not in cli_tests and f"'{w}'" not in cli_tests]
        missing = [w for w in missing if w not in ("--nproc-per-node",)]  # torchrun's own flag: cli_torchrun.py
        assert not missing, f"README command not run by tests/test_cli.py as written: {missing} in {command!r}"


def test_every_module_the_readme_runs_exists() -> None:
    """Each ``python -m X`` / ``torchrun ... -m X`` of the README names an importable module (the tests run them)."""
    import importlib.util

    modules = set(re.findall(r"(?:python|torchrun[^\n]*?) -m ([\w.]+)", README))
    assert {"lightning_3d.train", "lightning_3d.checkpoint", "benchmarks", "pytest"} <= modules, modules
    for name in modules:
        assert importlib.util.find_spec(name) is not None, f"README runs python -m {name}, which does not exist"
