"""Schedules by name: which the project runs, where each places its stages, and how many micro-batches each needs."""

from __future__ import annotations

import pytest

from lightning_3d.core import pipeline
from lightning_3d.settings import ThreeDSettings


def _error(**kwargs) -> str:
    with pytest.raises(ValueError) as err:
        ThreeDSettings(**kwargs)
    return str(err.value)


def test_v_placement_puts_stage_i_and_its_mirror_on_rank_i():
    # written out by hand: down the ranks, then back up
    assert pipeline.stage_ranks("zbvzerobubble", 2, 2) == [0, 1, 1, 0]
    assert pipeline.stage_ranks("DualPipeV", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    for pp in (1, 2, 3, 4):
        ranks = pipeline.stage_ranks("dualpipev", pp, 2)
        assert all(ranks[i] == ranks[2 * pp - 1 - i] == i for i in range(pp))


def test_other_schedules_loop_over_the_ranks():
    assert pipeline.stage_ranks("interleaved1f1b", 2, 2) == [0, 1, 0, 1]
    assert pipeline.stage_ranks("interleavedzerobubble", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert pipeline.stage_ranks("1f1b", 4, 1) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "zbvzerobubble", "DUALPIPEV", "loopedbfs"])
def test_new_schedules_are_accepted_with_two_stages_per_rank(name):
    s = ThreeDSettings(pp=2, stages_per_rank=2, schedule=name, micro_batches=4)
    assert s.schedule == name and s.micro_batches == 4


def test_v_schedules_default_to_two_micro_batches_per_rank():
    assert ThreeDSettings(pp=2, stages_per_rank=2, schedule="zbvzerobubble").micro_batches == 4
    assert ThreeDSettings(pp=4, stages_per_rank=2, schedule="dualpipev").micro_batches == 8
    assert ThreeDSettings(pp=2, stages_per_rank=2, schedule="interleavedzerobubble").micro_batches == 2


def test_interleaved_zero_bubble_runs_with_one_stage_per_rank_too():
    """torch's interleaved zero-bubble schedule over one stage per rank is ZB-H1: 1F1B's order with each backward
    split into ``I`` and a ``W`` that fills the bubble. Its action list (built by torch) keeps each stage on its own
    rank, has the bubble ``(p - 1) / (3 m + p - 1)`` (1F1B: ``(p - 1) / (m + p - 1)``) and keeps at most ``pp``
    micro-batches in flight on a rank; the other multi-stage schedules still need two stages per rank."""
    s = ThreeDSettings(pp=4, schedule="interleavedzerobubble", micro_batches=8)
    assert s.stages_per_rank == 1 and pipeline.splits_backward(s.schedule)
    assert pipeline.stage_ranks(s.schedule, 4, 1) == [0, 1, 2, 3]
    assert ThreeDSettings(pp=2, schedule="interleavedzerobubble").micro_batches == 2  # one per stage in flight
    for pp, m in [(2, 4), (2, 8), (4, 8), (4, 16)]:
        order = pipeline.schedule_actions("interleavedzerobubble", pp, 1, m)
        length = max(len(row) for row in order.values())
        idle = sum(length - sum(a is not None for a in row) for row in order.values()) / (length * pp)
        assert idle == pytest.approx((pp - 1) / (3 * m + pp - 1))
        for rank, row in order.items():
            actions = [a for a in row if a is not None]
            assert {a.stage_index for a in actions} == {rank}
            assert sorted(str(a.computation_type.value) for a in actions) == ["F"] * m + ["I"] * m + ["W"] * m
            live, peak = set(), 0  # micro-batches between their forward and their W
            for a in actions:
                kind = str(a.computation_type.value)
                if kind == "F":
                    live.add(a.microbatch_index)
                elif kind == "W":
                    live.discard(a.microbatch_index)
                peak = max(peak, len(live))
            assert peak <= pp
    assert "needs stages_per_rank >= 2" in _error(pp=2, schedule="interleaved1f1b", micro_batches=4)


@pytest.mark.parametrize("name", ["zbvzerobubble", "dualpipev"])
@pytest.mark.parametrize("stages_per_rank", [1, 3])
def test_v_schedule_needs_exactly_two_stages_per_rank(name, stages_per_rank):
    text = _error(pp=2, stages_per_rank=stages_per_rank, schedule=name, micro_batches=8)
    assert "places exactly two stages per rank in a V" in text
    assert f"got stages_per_rank={stages_per_rank}. Use stages_per_rank=2." in text


@pytest.mark.parametrize("name", ["zbvzerobubble", "dualpipev"])
def test_v_schedule_needs_a_micro_batch_per_stage(name):
    text = _error(pp=2, stages_per_rank=2, schedule=name, micro_batches=3)
    assert "micro_batches=3 < 2 * pp = 4" in text and "micro_batches >= 4" in text
    assert "gpipe" not in text


@pytest.mark.parametrize("name", ["interleaved1f1b", "interleavedzerobubble"])
def test_interleaved_schedules_need_whole_rounds(name):
    # pp=2, m=5: torch runs 5 // 2 = 2 rounds and refuses 5 % 2 != 0 in the first step; refused here instead
    text = _error(pp=2, stages_per_rank=2, schedule=name, micro_batches=5)
    assert "runs micro-batches in 2 rounds" in text and "micro_batches=4 or 6" in text
    assert ThreeDSettings(pp=2, stages_per_rank=2, schedule=name, micro_batches=6).micro_batches == 6


def test_micro_batch_problem_matches_torchs_round_rule():
    for pp in (2, 3, 4):
        for m in range(pp, 4 * pp):
            rounds = max(1, m // pp)
            ok = pipeline.micro_batch_problem("interleavedzerobubble", pp, m) is None
            assert ok == (m % rounds == 0), (pp, m)


@pytest.mark.parametrize("name", ["PipelineScheduleMulti", "pipelineschedulesingle"])
def test_torch_base_classes_are_not_schedules(name):
    text = _error(pp=2, stages_per_rank=2, schedule=name)
    assert "is a base class in torch, not a schedule" in text and "'dualpipev'" in text


def test_unknown_name_lists_runnable_schedules():
    text = _error(schedule="zigzag")
    assert "Unknown schedule name 'zigzag'" in text
    assert all(repr(n) in text for n in pipeline.RUNNABLE_SCHEDULES)


def _nano(tie: bool):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import MODELS

    return MODELS["nanotied" if tie else "nano"](build="init")


def test_split_model_follows_the_v_placement():
    from lightning_3d.core.parallelize import plan_model

    plan = plan_model(_nano(tie=False), tp=1, pp=2, stages_per_rank=2, schedule="zbvzerobubble")
    assert plan.split.stage_to_rank == [0, 1, 1, 0] and plan.stage_plan.stage_to_rank == [0, 1, 1, 0]
    plan = plan_model(_nano(tie=False), tp=1, pp=2, stages_per_rank=2, schedule="interleavedzerobubble")
    assert plan.split.stage_to_rank == [0, 1, 0, 1]


def test_v_schedule_with_weights_tied_across_ends_puts_both_ends_on_rank_0():
    """Embedding and head tied under a V: planned (no refusal), both ends on pp rank 0, the tie recorded so that the
    build gives each end stage its copy there when tp or dp > 1 (``core/tied.py``, tested in ``test_tied.py``)."""
    from lightning_3d.core.parallelize import plan_model

    plan = plan_model(_nano(tie=True), tp=1, pp=2, stages_per_rank=2, schedule="dualpipev")
    assert plan.split.tied and plan.split.stage_to_rank[0] == plan.split.stage_to_rank[-1] == 0
    assert any(name.endswith("lm_head.weight") for group in plan.split.tied for name in group)


def test_sequential_body_follows_the_v_placement():
    from torch import nn

    from lightning_3d.core import partition

    body = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    ref = partition.BodyRef(parent=nn.Module(), attr="body", fqn="body", module=body)
    placement = pipeline.stage_ranks("dualpipev", 2, 2)
    plan = partition.plan_stages(ref, 2, partition.UniformPartitioner(), 2, placement)
    assert plan.stage_to_rank == [0, 1, 1, 0] and plan.layer_names == [["0"], ["1"], ["2"], ["3"]]


@pytest.mark.parametrize("stages_per_rank", [1, 2])
def test_csv_schedules_that_do_not_fit_are_refused_at_construction(tmp_path, stages_per_rank):
    """CSV action lists run (tests/unit/test_csv_schedule.py); one that is missing or does not fit the settings
    is refused with what to change."""
    actions = tmp_path / "actions.csv"
    actions.write_text("0F0,0F1,0B0,0B1\n,1F0,1F1,1B0,1B1\n")  # a GPipe list of 2 micro-batches, one stage per rank
    text = _error(pp=2, stages_per_rank=stages_per_rank, schedule=str(actions), micro_batches=4)
    want = "runs exactly 2 micro-batches" if stages_per_rank == 1 else "Use stages_per_rank=1"
    assert want in text, text
    text = _error(pp=2, stages_per_rank=stages_per_rank, schedule="missing/Actions.CSV", micro_batches=4)
    assert "no such file" in text and "CSV action list" in text
