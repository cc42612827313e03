"""The pipeline timeline's arithmetic on hand-made timelines: bubble breakdown per pipeline rank, representative
ranks, the Chrome trace layout, and the recorder's event naming."""

from __future__ import annotations

import json
from dataclasses import asdict
from itertools import count
from pathlib import Path

import pytest

from lightning_3d.tools import timeline as tl

MS = 1_000_000


def event(name: str, cat: str, start: float, end: float, stage: int | None, **kw: object) -> tl.TimelineEvent:
    return tl.TimelineEvent(name, cat, stage, kw.pop("mb", None), int(start * MS), int(end * MS), **kw)  # type: ignore[arg-type]


def rank_timeline(rank: int, stages: list[int], events: list[tuple], **kw: object) -> tl.RankTimeline:
    """``events``: ``(name, cat, start_ms, end_ms[, extra fields])``; all on the rank's first stage."""
    evs = []
    for name, cat, start, end, *extra in events:
        evs.append(event(name, cat, start, end, None if cat == "step" else stages[0], **(extra[0] if extra else {})))
    fields = {"num_stages": 2, "pp": 2, "n_micro": 2, "schedule": "Schedule1F1B"} | kw
    return tl.RankTimeline(rank=rank, stages=stages, events=evs, **fields)  # type: ignore[arg-type]


FIRST = rank_timeline(
    0,
    [0],
    [
        ("F0", "forward", 0, 1, {"cpu_ns": int(0.5 * MS)}),  # half of F0 off the CPU
        ("F1", "forward", 1, 2),
        ("post send F1", "post", 2, 3),
        ("wait send F1", "send", 3, 4),
        ("B0", "backward", 5, 7),
        ("B1", "backward", 7, 9),
        ("step", "step", 0, 10),
    ],
)
LAST = rank_timeline(
    1,
    [1],
    [
        ("wait recv F0", "recv", 1, 2),
        ("F0", "forward", 2, 3),
        ("loss0", "loss", 3, 3.5),
        ("B0", "backward", 3.5, 4.5),
        ("F1", "forward", 4.5, 5.5),
        ("loss1", "loss", 5.5, 6),
        ("B1", "backward", 6, 7),
        ("reduce grad", "reduce_grad", 7, 8),
        ("step", "step", 1, 9),
    ],
)
REPLICA = rank_timeline(2, [0], [("F0", "forward", 0, 50), ("step", "step", 0, 100)])  # dp 1's stage 0


def test_bubble_breakdown_by_hand() -> None:
    stats = tl.bubble_stats([LAST, REPLICA, FIRST])
    assert stats["span_ms"] == pytest.approx(10.0)  # first step start to last step end
    assert set(stats["ranks"]) == {"0", "1"}
    first, last = stats["ranks"]["0"], stats["ranks"]["1"]
    assert first["global_rank"] == 0 and first["stages"] == [0]  # the replica (rank 2) is not the representative
    expected_first = {
        "compute_ms": 6.0, "forward_ms": 2.0, "backward_ms": 4.0, "loss_ms": 0.0, "recv_wait_ms": 0.0,
        "send_ms": 2.0, "reduce_grad_ms": 0.0, "descheduled_ms": 0.5, "other_ms": 2.0, "fill_ms": 0.0,
        "stall_ms": 3.0, "drain_ms": 1.0, "bubble": 0.4,
    }  # fmt: skip
    expected_last = {
        "compute_ms": 5.0, "forward_ms": 2.0, "backward_ms": 2.0, "loss_ms": 1.0, "recv_wait_ms": 1.0,
        "send_ms": 0.0, "reduce_grad_ms": 1.0, "descheduled_ms": 0.0, "other_ms": 3.0, "fill_ms": 2.0,
        "stall_ms": 0.0, "drain_ms": 3.0, "bubble": 0.5,
    }  # fmt: skip
    for key, want in expected_first.items():
        assert first[key] == pytest.approx(want), key
    for key, want in expected_last.items():
        assert last[key] == pytest.approx(want), key
    assert stats["measured"] == pytest.approx(0.45)
    assert stats["theory"] == pytest.approx(1 / 3)
    assert (stats["schedule"], stats["pp"], stats["stages_per_rank"], stats["n_micro"]) == ("Schedule1F1B", 2, 1, 2)


def test_weight_events_count_as_backward_and_overlaps_once() -> None:
    zb = rank_timeline(0, [0], [("B0", "backward", 0, 2), ("W0", "weight", 1, 3), ("step", "step", 0, 4)])
    ranks = tl.bubble_stats([zb])["ranks"]["0"]
    assert ranks["backward_ms"] == pytest.approx(3.0) and ranks["compute_ms"] == pytest.approx(3.0)
    assert ranks["bubble"] == pytest.approx(0.25)


def test_without_step_events_the_span_covers_every_event() -> None:
    a = rank_timeline(0, [0], [("F0", "forward", 2, 3)])
    b = rank_timeline(1, [1], [("F0", "forward", 3, 6)])
    stats = tl.bubble_stats([a, b])
    assert stats["span_ms"] == pytest.approx(4.0)
    assert stats["ranks"]["0"]["bubble"] == pytest.approx(0.75)
    assert stats["ranks"]["1"]["fill_ms"] == pytest.approx(1.0)


def test_no_timelines_no_stats() -> None:
    assert tl.bubble_stats([]) == {}
    assert tl.representative_ranks([rank_timeline(0, [], [])]) == {}


def test_interleaved_theory_uses_the_stages_per_rank() -> None:
    kw = {"num_stages": 4, "pp": 2, "n_micro": 4, "schedule": "ScheduleInterleaved1F1B"}
    a = rank_timeline(0, [0, 2], [("F0", "forward", 0, 1), ("step", "step", 0, 2)], **kw)
    b = rank_timeline(1, [1, 3], [("F0", "forward", 1, 2), ("step", "step", 0, 2)], **kw)
    stats = tl.bubble_stats([a, b])
    assert stats["stages_per_rank"] == 2
    assert stats["theory"] == pytest.approx(1 / 9)  # (2 - 1) / (2 * 4 + 2 - 1)
    assert set(stats["ranks"]) == {"0", "1"}


def test_representative_ranks_pick_the_lowest_rank_per_first_stage() -> None:
    reps = tl.representative_ranks([REPLICA, LAST, FIRST, rank_timeline(3, [1], [])])
    assert list(reps) == [0, 1]
    assert reps[0] is FIRST and reps[1] is LAST


@pytest.mark.parametrize(
    ("pp", "m", "v", "theory"), [(1, 8, 1, 0.0), (2, 2, 1, 1 / 3), (4, 8, 1, 3 / 11), (4, 8, 2, 3 / 19)]
)
def test_theoretical_bubble(pp: int, m: int, v: int, theory: float) -> None:
    assert tl.theoretical_bubble(pp, m, v) == pytest.approx(theory)


def test_union_of_intervals() -> None:
    assert tl._union_ns([]) == 0
    assert tl._union_ns([(5, 7), (0, 2), (1, 3), (6, 6)]) == 5  # [0, 3] and [5, 7]
    assert tl._union_ns([(0, 10), (2, 3)]) == 10  # contained


# ------------------------------------------------------------------------------------ chrome trace
def test_chrome_trace_layout() -> None:
    last = rank_timeline(1, [1], [("F0", "forward", 2, 3, {"mb": 0, "cpu_ns": MS}), ("step", "step", 1, 9)])
    last.coords = {"dp": 0, "pp": 1, "tp": 0}
    trace = tl.chrome_trace([FIRST, last])
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] == 1]
    assert {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1: stage 1"}} in meta
    assert {"ph": "M", "name": "process_labels", "pid": 1, "args": {"labels": "dp 0, pp 1, tp 0"}} in meta
    assert not any(e["name"] == "process_labels" for e in trace["traceEvents"] if e["pid"] == 0)
    spans = {(e["pid"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X"}
    f0 = spans[(1, "F0")]
    assert (f0["ts"], f0["dur"], f0["tid"]) == (2000.0, 1000.0, 1)  # microseconds from the earliest event
    assert f0["args"] == {"micro_batch": 0, "thread_cpu_ms": 1.0}
    assert spans[(1, "step")]["tid"] == -1
    assert len(spans) == len(FIRST.events) + 2


def test_write_chrome_trace_embeds_the_bubble(tmp_path: Path) -> None:
    path = tl.write_chrome_trace([FIRST, LAST], tmp_path / "sub" / "t.json")
    data = json.loads(path.read_text())
    assert data["otherData"]["bubble"]["measured"] == pytest.approx(0.45)


def test_rank_timeline_round_trips_through_a_dict() -> None:
    assert tl.RankTimeline.from_dict(asdict(LAST)) == LAST


# ------------------------------------------------------------------------------------ recorder
def test_timed_wrapper_names_events_by_micro_batch_and_records_failures() -> None:
    ticks = count(0, 10)
    recorder = tl.ScheduleRecorder(clock=lambda: next(ticks))

    def forward_one_chunk(fwd_chunk_id: int, args: object = None) -> str:
        if fwd_chunk_id == 2:
            raise RuntimeError("boom")
        return "out"

    wrapped = recorder._timed(forward_one_chunk, "forward", 1, "F", "fwd_chunk_id")
    assert wrapped(0) == "out"
    assert wrapped(fwd_chunk_id=1) == "out"
    with pytest.raises(RuntimeError):
        wrapped(2)
    names = [(e.name, e.cat, e.stage, e.micro_batch, e.start_ns, e.end_ns) for e in recorder.events]
    assert names == [("F0", "forward", 1, 0, 0, 10), ("F1", "forward", 1, 1, 20, 30), ("F2", "forward", 1, 2, 40, 50)]
    recorder.clear()
    assert recorder.events == []


def test_p2p_labels() -> None:
    assert tl._label([("recv", "F", 3, 1), ("send", "B", 2, 1)]) == "recv F3 + send B2"


def _order(*rows: str) -> dict:
    """An action list from CSV-like rows: one string per pp rank, cells separated by commas ("" idles)."""
    from lightning_3d.core import torch_compat

    return torch_compat.parse_schedule_actions([row.split(",") for row in rows])


def _idle_as_written(order: dict) -> dict[int, float]:
    """Each rank's ``None`` slots (and the slots past the end of a shorter list) over the longest list."""
    total = max(len(actions) for actions in order.values())
    return {rank: (total - sum(a is not None for a in actions)) / total for rank, actions in order.items()}


def _names(actions: list) -> list[str | None]:
    return [None if a is None else str(a) for a in actions]


def test_an_action_list_is_played_in_unit_slots() -> None:
    # 1F1B at pp 2, m 2, written without idle slots (as a CSV file usually is): rank 0 waits twice for the last
    # stage's backward, rank 1 once for the first forward and once past its end: (p - 1) / (m + p - 1) each
    compact = _order("0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1")
    assert _idle_as_written(compact) == {0: 0.0, 1: 0.0}
    played = tl.played_order(compact)
    assert _names(played[0]) == ["0F0", "0F1", None, "0B0", None, "0B1"]
    assert _names(played[1]) == [None, "1F0", "1B0", "1F1", "1B1"]
    assert tl.order_bubbles(compact) == {0: pytest.approx(2 / 6), 1: pytest.approx(2 / 6)}
    # written with those idle slots, the list is played as written
    assert tl.played_order(_order("0F0,0F1,,0B0,,0B1", ",1F0,1B0,1F1,1B1")) == played
    # split backwards: an input gradient waits for the next stage's, a weight gradient for its own input gradient
    assert _names(tl.played_order(_order("0F0,0I0,0W0", "1F0,1I0,1W0"))[0]) == ["0F0", None, None, "0I0", "0W0"]
    # a list that cannot run: stage 0's backward first, waiting for a gradient that needs stage 0's forward
    with pytest.raises(ValueError, match="cannot run"):
        tl.order_bubbles(_order("0B0,0F0", "1F0,1B0"))


def test_torchs_own_action_lists_keep_their_idle_slots_when_played() -> None:
    """torch builds its multi-stage schedules' lists with their idle slots in place: playing them must change no
    rank's idle share (the theory reported for them before lists were played)."""
    from lightning_3d.core.pipeline import schedule_actions

    for name, stages_per_rank in [
        ("interleavedzerobubble", 1),
        ("interleavedzerobubble", 2),
        ("zbvzerobubble", 2),
        ("dualpipev", 2),
        ("interleaved1f1b", 2),
        ("loopedbfs", 2),
    ]:
        for pp, m in [(2, 4), (2, 8), (4, 8), (4, 16)]:
            order = schedule_actions(name, pp, stages_per_rank, m)
            assert order is not None
            assert tl.order_bubbles(order) == pytest.approx(_idle_as_written(order)), (name, pp, m)


def test_zero_bubble_theory_comes_from_the_action_list() -> None:
    # three stages on two ranks, one micro-batch: rank 0 runs stages 0 and 2 (4 actions), rank 1 stage 1 (2):
    # 6 slots, rank 0 idle 2, rank 1 idle 4 (one of them past the end of its shorter list)
    order = _order("0F0,,2F0,2B0,,0B0", ",1F0,,,1B0")
    assert tl.order_bubbles(order) == {0: pytest.approx(2 / 6), 1: pytest.approx(4 / 6)}
    assert tl.rank_of_stage(order, 2) == 0 and tl.rank_of_stage(order, 1) == 1 and tl.rank_of_stage(order, 9) is None

    class ScheduleZBVZeroBubble:  # the class name marks a zero-bubble schedule
        pipeline_order = order

    class ScheduleInterleaved1F1B:
        pipeline_order = order

    assert tl.schedule_order_bubble(ScheduleZBVZeroBubble(), 1) == pytest.approx(4 / 6)
    assert tl.schedule_order_bubble(ScheduleInterleaved1F1B(), 1) is None  # the formula holds there

    kw = {"num_stages": 4, "pp": 2, "n_micro": 4, "schedule": "ScheduleZBVZeroBubble"}
    a = rank_timeline(0, [0, 3], [("F0", "forward", 0, 1), ("step", "step", 0, 2)], order_bubble=2 / 8, **kw)
    b = rank_timeline(1, [1, 2], [("F0", "forward", 1, 2), ("step", "step", 0, 2)], order_bubble=3 / 8, **kw)
    stats = tl.bubble_stats([a, b])
    assert stats["theory_source"] == "action list"
    assert stats["theory"] == pytest.approx(5 / 16)  # not the formula's 1 / 9
    assert stats["ranks"]["0"]["theory"] == pytest.approx(2 / 8) and stats["ranks"]["1"]["theory"] == pytest.approx(
        3 / 8
    )
    stats = tl.bubble_stats([rank_timeline(0, [0], [("F0", "forward", 0, 1)]), rank_timeline(1, [1], [])])
    assert stats["theory_source"] == "formula" and stats["ranks"]["1"]["theory"] == pytest.approx(1 / 3)


def test_timeline_callback_says_when_there_is_no_pipeline_to_record():
    import types

    from lightning_3d.tools.timeline import PipelineTimeline

    callback = PipelineTimeline(gantt=False)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(settings=types.SimpleNamespace(pp=1)))
    with pytest.warns(UserWarning, match="pp=1, there is no pipeline schedule to record"):
        callback.setup(trainer, None, "fit")
    trainer.strategy.settings.pp = 2
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.setup(trainer, None, "fit")
