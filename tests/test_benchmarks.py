"""The benchmarks' plumbing, at a tiny size and without timing anything.

B5 (communication audit), B4 (state bytes) and B3 (saved-tensor bytes) are pure counts, so at any size they
must match their formulas; they run as ``python -m benchmarks ID --tiny`` through the harness with a hard time
limit. The timed benchmarks (B0, B1, B2, B6, B7) are only checked for their interface here.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from types import ModuleType

import pytest

from launch import ROOT, run_lightning


def _import(name: str) -> ModuleType:
    """Import a module of the ``benchmarks`` package (at the repository root, not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def _bench(tmp_path, *ids: str, timeout: float = 240) -> dict[str, dict]:
    run_lightning("bench_run.py", [*ids, "--tiny", "--out", tmp_path], timeout=timeout)
    return {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in ids}


def _check_keys(record: dict) -> None:
    for key in ("measured", "baseline", "ideal", "ratio", "environment", "details"):
        assert key in record, key
    env = record["environment"]
    assert env["cpu_count"] and env["torch"] and isinstance(env["loadavg_start"], list)


@pytest.mark.slow
def test_b5_communication_counts_match_the_formulas(tmp_path):
    record = _bench(tmp_path, "B5")["B5"]
    _check_keys(record)
    checks = record["details"]["checks"]
    assert record["details"]["unexplained_in_schedule"] == []
    for name in (
        "p2p elements per boundary",
        "p2p calls per boundary",
        "TP all-reduces per layer per micro-batch (fwd)",
        "TP all-reduce elements (fwd)",
        "TP all-reduce elements (bwd)",
        "TP all-reduces per layer per micro-batch (bwd)",
        "TP embedding all-reduces per micro-batch (fwd)",
        "TP embedding all-reduce elements per micro-batch",
        "TP head all-gathers per micro-batch (fwd)",
        "TP head all-gather input elements",
        "TP head all-reduces per micro-batch (bwd)",
        "DDP all-reduce calls per step",
        "DDP all-reduce elements",
    ):
        assert checks[name]["ratio"] == 1.0, (name, checks[name])
    # Backward: Megatron's 2 per layer although q, k and v are separate Linears (they share one input conversion).
    assert checks["TP all-reduces per layer per micro-batch (bwd)"]["measured"] == 2.0


@pytest.mark.slow
def test_b4_state_bytes_are_exactly_the_share(tmp_path):
    record = _bench(tmp_path, "B4")["B4"]
    _check_keys(record)
    ranks = record["details"]["ranks"]
    assert len(ranks) == 8
    for r in ranks:
        assert r["total_bytes"] == r["exact_bytes"], r
        assert r["param_bytes"] == r["exact_param_bytes"] == r["grad_bytes"]
        assert r["optimizer_bytes"] == 2 * r["param_bytes"] + 4 * r["owned_tensors"]
    assert record["ratio"] == 1.0


@pytest.mark.slow
def test_b3_saved_bytes_follow_the_schedules(tmp_path):
    record = _bench(tmp_path, "B3")["B3"]
    _check_keys(record)
    # GPipe keeps m micro-batches per stage, 1F1B p - s: ratio 1 up to the batch-wide input/target storages
    # that all micro-batches share (counted once)
    for stage, ratio in record["details"]["ratios_per_stage"].items():
        assert 0.98 <= ratio <= 1.0, (stage, ratio)


def test_every_benchmark_module_has_the_interface():
    benchmarks = _import("benchmarks")
    assert list(benchmarks.BENCHMARKS) == [f"B{i}" for i in range(8)]
    for bench_id, name in benchmarks.BENCHMARKS.items():
        module = _import(f"benchmarks.{name}")
        assert module.ID == bench_id and module.TITLE and callable(module.run) and module.__doc__


def test_record_json_and_formatting(tmp_path):
    common = _import("benchmarks.common")
    fmt = common.fmt
    record = common.Record("BX", "test", 2.0, 4.0, 1.0, 0.5, "ms", {"k": 1}, ["a line"])
    data = common.report(record, tmp_path, common.environment(), 1.0)
    on_disk = json.loads((tmp_path / "BX.json").read_text())
    assert on_disk["ratio"] == data["ratio"] == 0.5 and on_disk["details"] == {"k": 1}
    assert fmt(None) == "-" and fmt(0.12345) == "0.123" and "values" in fmt({str(i): i for i in range(9)})


def test_gpt_shard_rule():
    gpt_local_numel = _import("benchmarks.common").gpt_local_numel
    assert gpt_local_numel("body.1.attn.q_proj.bias", (256,), 2) == 128
    assert gpt_local_numel("body.1.attn.out_proj.bias", (256,), 2) == 256
    assert gpt_local_numel("body.1.ln_1.weight", (256,), 2) == 256
    assert gpt_local_numel("body.9.lm_head.weight", (2048, 256), 2) == math.prod((2048, 256)) // 2
