"""``ThreeDStrategy(compile=...)`` against one eager process, and the GPU check script on a machine without GPU.

The parity launches use ``backend="aot_eager"`` (dynamo and AOT autograd as with inductor, the backend's graphs
run op by op): inductor compiles C++ for minutes on a loaded 2-core machine. It was run by hand (README).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_3d.core import torch_compat

from launch import ROOT, run_lightning
from parity_check import compare, load

SINGLE = ["nano32", "gpt32", "llama32"]  # nn.ModuleList blocks, an nn.Sequential body, a Hugging Face Llama
MULTI = [
    ("nano32", "1f1b"),
    ("gpt32", "1f1b"),
    ("nano32", "gpipe"),
    ("nano32", "interleaved1f1b"),
    ("gpt32", "1f1b+ac"),  # with activation checkpointing (every other block) around the compiled blocks
    ("nano32", "zbvzerobubble"),  # backwards in two passes: torch refuses donated buffers there
    ("llama32", "1f1b"),  # the model's own tp plan: the embedding's all-reduce still pending at the first layer
]
if torch_compat.compiled_split_backward_problem() is not None:  # refused at setup on this torch (unit-tested)
    MULTI.remove(("nano32", "zbvzerobubble"))
# Blocks compiled on each rank of tp 2 x pp 2 (ranks 0, 1: pp rank 0; ranks 2, 3: pp rank 1)
BLOCKS = {
    "nano32": "transformer.h.{}",
    "gpt32": "body.{}",
    "llama32": "model.model.layers.{}",
}
EXPECTED_BLOCKS = {
    ("nano32", "1f1b"): ([0, 1], [2, 3]),
    ("nano32", "gpipe"): ([0, 1], [2, 3]),
    ("nano32", "interleaved1f1b"): ([0, 2], [1, 3]),  # stages 0, 2 on pp rank 0; 1, 3 on pp rank 1
    ("gpt32", "1f1b"): ([1], [2]),  # body: embedding, block, block, head; only the blocks
    ("gpt32", "1f1b+ac"): ([1], [2]),
    ("nano32", "zbvzerobubble"): ([0, 3], [1, 2]),  # the V: stages 0, 3 on pp rank 0; 1, 2 on pp rank 1
    ("llama32", "1f1b"): ([0, 1], [2, 3]),
}


def _names(case: str, indices: list[int]) -> list[str]:
    return [BLOCKS[case].format(i) for i in indices]


@pytest.mark.slow
def test_compiled_blocks_match_one_eager_process(tmp_path: Path) -> None:
    """tp1 pp1 (one process) and tp2 x pp2 under 1F1B, GPipe, interleaved 1F1B and ZB-V, with each block compiled (and
    under 1F1B once more with activation checkpointing around the compiled blocks; and a Hugging Face Llama under its
    own tensor-parallel plan):
    float32 losses, gradients, norms and parameters as one eager process (the final parameters at tp 2 within 2e-4,
    see ``parity_check.TOL``); dropout's masks as eager's."""
    single = run_lightning("compile_run.py", ["--phase", "single", "--out", tmp_path], timeout=600)
    assert "compile: 4 blocks on this rank with torch.compile(backend='aot_eager')" in single.output
    # rank 0 reports the compile time after the first step
    assert "s compiling since setup (rank 0); first training step" in single.output
    problems = []
    for case in SINGLE:
        got = tmp_path / f"{case}.tp1"
        problems += [f"{case} tp1 pp1: {p}" for p in compare(load(tmp_path, case), load(got, case), "32")]
        compiled = torch.load(got / "compiled.pt")
        expected = _names(case, [1, 2] if case == "gpt32" else [0, 1, 2, 3])
        assert compiled == [expected], f"{case}: compiled blocks {compiled}"
    multi = run_lightning("compile_run.py", ["--phase", "multi", "--out", tmp_path], timeout=900)
    assert "compile: 2 blocks on this rank" in multi.output
    for case, schedule in MULTI:
        got = tmp_path / f"{case}.{schedule}"
        problems += [f"{case} {schedule}: {p}" for p in compare(load(tmp_path, case), load(got, case), "32tp_compiled")]
        first, last = EXPECTED_BLOCKS[(case, schedule)]
        expected = [_names(case, first)] * 2 + [_names(case, last)] * 2
        assert torch.load(got / "compiled.pt") == expected, f"{case} {schedule}: wrong blocks compiled"
    assert not problems, "\n".join(problems)
    eager, compiled = torch.load(tmp_path / "drop.eager.pt"), torch.load(tmp_path / "drop.compiled.pt")
    checkpointed = torch.load(tmp_path / "drop.compiled_ac.pt")
    assert len(eager) == len(compiled) == len(checkpointed) == 4
    # The same masks (the streams swapped in around compiled code and at graph breaks, and replayed when a
    # checkpointed block's compiled forward runs again in the backward): float32 round-off only; a different
    # mask would move the loss by far more.
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(checkpointed), torch.tensor(eager), rtol=1e-5, atol=0)


def test_gpu_check_skips_cleanly_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "gpu_check: skipped: no CUDA device" in capsys.readouterr().out
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["skipped"] == "no CUDA device" and record["id"] == "GPU"


def test_gpu_check_busy_time_is_the_union_of_gpu_intervals() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import busy_seconds

    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},  # overlaps the first: 0..15
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "ts": 30, "dur": 100},  # host work: not GPU time
        {"ph": "X", "cat": "kernel", "ts": 21, "dur": 2},  # inside the copy
    ]
    assert busy_seconds({"traceEvents": events}) == pytest.approx(20e-6)


@pytest.mark.slow
def test_gpu_check_dry_run_exercises_every_run_on_cpu(tmp_path: Path) -> None:
    """``--dry-run-cpu``: every run of the table, without and with compile, on a tiny GPT (nothing timed)."""
    result = run_lightning(ROOT / "benchmarks" / "gpu_check.py", ["--dry-run-cpu", "--out", tmp_path], timeout=600)
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["dry_run_cpu"] is True and "skipped" not in record, result.tail()
    runs = record["results"][0]["runs"]
    names = ["lightning_auto", "threed_tp1pp1", "threed_tp1pp1_nocheck", "threed_interleaved"]
    names += ["hand_full", "hand_accum4", "hand_interleaved"]
    assert sorted(runs) == sorted(names + [f"{n}+compile" for n in names])
    for name, run in runs.items():
        assert "error" not in run, f"{name}: {run.get('error')}"
        assert run["step_ms"] > 0 and run["tokens_per_s"] > 0 and run["gpu_idle_ms_per_step"] is None, name
        # the tiny GPT's 4 blocks, compiled by the strategy or by hand exactly when the run says so
        assert run["compiled_blocks"] == (4 if name.endswith("+compile") else 0), name
    # a hand-written loop reads nothing back to the host; Lightning reads its loss once per step at least
    assert runs["hand_full"]["host_syncs_per_step"] == 0
    assert runs["lightning_auto"]["host_syncs_per_step"] >= 1
    assert set(record["results"][0]["ratios"]) >= {"tp1pp1_vs_lightning", "interleaved_vs_torch_schedule+compile"}
