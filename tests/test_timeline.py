"""The pipeline timeline: one forward and one backward event per micro-batch and stage, a Chrome trace and
a Gantt chart, and the bubble arithmetic."""

from __future__ import annotations

import json

import pytest

from lightning_3d.tools import timeline as tl

from launch import run_lightning


def _events_by_rank(trace: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(e["pid"], []).append(e)
    return out


def _check_per_stage(trace: dict, n_micro: int, num_stages: int) -> None:
    seen_stages = set()
    for events in _events_by_rank(trace).values():
        stages = {e["tid"] for e in events if e["tid"] >= 0}
        seen_stages |= stages
        for stage in stages:
            mine = [e for e in events if e["tid"] == stage]
            forwards = sorted(e["name"] for e in mine if e["cat"] == "forward")
            backwards = sorted(e["name"] for e in mine if e["cat"] == "backward")
            assert forwards == sorted(f"F{i}" for i in range(n_micro)), (stage, forwards)
            assert backwards == sorted(f"B{i}" for i in range(n_micro)), (stage, backwards)
            losses = [e for e in mine if e["cat"] == "loss"]
            assert len(losses) == (n_micro if stage == num_stages - 1 else 0)
            assert all(e["dur"] >= 0 for e in mine)
        assert sum(1 for e in events if e["cat"] == "step") == 1
    assert seen_stages == set(range(num_stages))


@pytest.mark.slow
def test_timeline_callback_writes_trace_and_gantt(tmp_path):
    run_lightning("timeline_run.py", ["--out", tmp_path, "--pp", 2, "--micro-batches", 4], timeout=240)
    trace = json.loads((tmp_path / "timeline_step1.json").read_text())
    _check_per_stage(trace, n_micro=4, num_stages=2)
    # p2p: every micro-batch's activation reaches stage 1 and its gradient comes back
    waits = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("recv", "send")]
    assert any("recv F3" in w for w in waits) and any("recv B3" in w for w in waits)
    bubble = trace["otherData"]["bubble"]
    assert bubble["theory"] == pytest.approx(1 / 5) and 0.0 < bubble["measured"] < 1.0
    assert json.loads((tmp_path / "summary.json").read_text())[0]["global_step"] == 1
    png = tmp_path / "timeline_step1.png"
    if tl.matplotlib_available():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()


@pytest.mark.slow
def test_timeline_of_an_interleaved_schedule(tmp_path):
    args = ["--out", tmp_path, "--pp", 2, "--micro-batches", 4, "--schedule", "interleaved1f1b"]
    run_lightning("timeline_run.py", [*args, "--stages-per-rank", 2], timeout=240)
    trace = json.loads((tmp_path / "timeline_step1.json").read_text())
    _check_per_stage(trace, n_micro=4, num_stages=4)
    assert trace["otherData"]["bubble"]["theory"] == pytest.approx(1 / (2 * 4 + 1))


@pytest.mark.slow
def test_timeline_of_a_zero_bubble_v_schedule(tmp_path):
    """ZB-V at pp=2: every stage shows F, an input-gradient I (or a whole B) and, for every I, a weight-gradient W
    per micro-batch; the rank that runs stage 0 also runs stage 3 (the V)."""
    args = ["--out", tmp_path, "--pp", 2, "--micro-batches", 4, "--schedule", "zbvzerobubble"]
    run_lightning("timeline_run.py", [*args, "--stages-per-rank", 2], timeout=240)
    trace = json.loads((tmp_path / "timeline_step1.json").read_text())
    kinds = set()
    for events in _events_by_rank(trace).values():
        stages = {e["tid"] for e in events if e["tid"] >= 0}
        assert stages in ({0, 3}, {1, 2}), stages
        for stage in stages:
            mine = [e for e in events if e["tid"] == stage]
            forwards = sorted(e["name"] for e in mine if e["cat"] == "forward")
            assert forwards == sorted(f"F{i}" for i in range(4)), (stage, forwards)
            backs = [e["name"] for e in mine if e["cat"] == "backward"]
            weights = sorted(e["name"][1:] for e in mine if e["cat"] == "weight")
            assert sorted(b[1:] for b in backs) == [str(i) for i in range(4)], (stage, backs)
            assert weights == sorted(b[1:] for b in backs if b.startswith("I")), (stage, backs, weights)
            kinds |= {b[0] for b in backs} | ({"W"} if weights else set())
    assert {"I", "W"} <= kinds, kinds
    bubble = trace["otherData"]["bubble"]  # the zero-bubble theory comes from the schedule's own action list
    assert bubble["theory_source"] == "action list" and 0.0 <= bubble["theory"] < 1 / (2 * 4 + 1)


def _timeline(rank: int, stage: int, events: list[tuple[str, str, int, int]]) -> tl.RankTimeline:
    evs = [tl.TimelineEvent(n, c, stage if c != "step" else None, None, s, e) for n, c, s, e in events]
    return tl.RankTimeline(rank=rank, stages=[stage], num_stages=2, pp=2, n_micro=2, schedule="X", events=evs)


def test_bubble_stats_on_a_synthetic_step():
    ms = 1_000_000
    a = _timeline(
        0,
        0,
        [
            ("F0", "forward", 0, 1 * ms),
            ("F1", "forward", 1 * ms, 2 * ms),
            ("B0", "backward", 3 * ms, 5 * ms),
            ("B1", "backward", 5 * ms, 7 * ms),
            ("step", "step", 0, 8 * ms),
        ],
    )
    b = _timeline(
        1,
        1,
        [
            ("wait recv F0", "recv", 0, 1 * ms),
            ("F0", "forward", 1 * ms, 2 * ms),
            ("B0", "backward", 2 * ms, 3 * ms),
            ("F1", "forward", 3 * ms, 4 * ms),
            ("B1", "backward", 4 * ms, 5 * ms),
            ("step", "step", 0, 6 * ms),
        ],
    )
    stats = tl.bubble_stats([a, b])
    assert stats["span_ms"] == pytest.approx(8.0)
    assert stats["ranks"]["0"]["bubble"] == pytest.approx(1 - 6 / 8)
    assert stats["ranks"]["1"]["bubble"] == pytest.approx(1 - 4 / 8)
    assert stats["ranks"]["1"]["recv_wait_ms"] == pytest.approx(1.0)
    assert stats["theory"] == pytest.approx(1 / 3)
    trace = tl.chrome_trace([a, b])
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert tl.theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)


def test_overlapping_intervals_are_counted_once():
    assert tl._union_ns([(0, 10), (5, 15), (20, 25)]) == 20


def test_gantt_needs_matplotlib_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(tl, "matplotlib_available", lambda: False)
    with pytest.raises(ImportError, match=r"lightning-3d\[plot\]"):
        tl.PipelineTimeline(gantt=True)
    assert tl.PipelineTimeline(gantt=False).gantt is False


def test_gantt_png_from_synthetic_timelines(tmp_path):
    pytest.importorskip("matplotlib")
    a = _timeline(0, 0, [("F0", "forward", 0, 10), ("B0", "backward", 30, 50), ("step", "step", 0, 60)])
    b = _timeline(1, 1, [("wait recv F0", "recv", 0, 10), ("F0", "forward", 10, 20), ("step", "step", 0, 60)])
    path = tl.plot_gantt([a, b], tmp_path / "g.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
