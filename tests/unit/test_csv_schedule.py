"""CSV schedules (``schedule="path.csv"``): what the file fixes, and one message per bad file or mismatch."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from torch import nn
from torch.distributed.pipelining import schedules

from lightning_3d.core import csv_schedule, pipeline
from lightning_3d.settings import ThreeDSettings

EXAMPLE = Path(__file__).resolve().parents[2] / "conf" / "schedules" / "zbv_pp2_m4.csv"


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "s.csv"
    path.write_text(text)
    return str(path)


def test_example_is_torchs_zbv_schedule_and_fixes_placement_and_micro_batches():
    read = csv_schedule.read_csv_schedule(EXAMPLE)
    assert (read.pp, read.num_stages, read.micro_batches, read.stages_per_rank) == (2, 4, 4, 2)
    assert read.placement == (0, 1, 1, 0) and read.split_backward
    name = str(EXAMPLE)
    assert pipeline.stage_ranks(name, 2, 2) == [0, 1, 1, 0]
    assert pipeline.min_micro_batches(name, 2) == 4
    assert pipeline.micro_batch_problem(name, 2, 4) is None
    assert "exactly 4" in pipeline.micro_batch_problem(name, 2, 8)
    settings = ThreeDSettings(pp=2, stages_per_rank=2, schedule=name)
    assert settings.micro_batches == 4  # taken from the file


def test_written_list_is_torchs_pipeline_order_without_reductions(tmp_path):
    path = pipeline.write_csv_schedule("interleaved1f1b", 2, 2, 4, tmp_path / "i.csv")
    stand_ins = [
        types.SimpleNamespace(
            num_stages=4, group_size=2, group_rank=0, stage_index=s, is_first=s == 0, is_last=s == 3,
            submod=nn.Identity(), stage_index_to_group_rank={},
        )
        for s in (0, 2)
    ]  # fmt: skip
    order = schedules.ScheduleInterleaved1F1B(stand_ins, 4).pipeline_order
    want = [[str(a) if a else "" for a in order[r] if a is None or a.is_compute_op] for r in range(2)]
    assert [line.split(",") for line in path.read_text().splitlines()] == want
    read = csv_schedule.read_csv_schedule(path)
    assert read.placement == (0, 1, 0, 1) and not read.split_backward


ONE_F_ONE_B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def test_hand_written_one_stage_per_rank_list(tmp_path):
    path = _write(tmp_path, ONE_F_ONE_B)
    read = csv_schedule.read_csv_schedule(path)
    assert (read.pp, read.stages_per_rank, read.micro_batches, read.placement) == (2, 1, 4, (0, 1))
    assert ThreeDSettings(pp=2, schedule=path).micro_batches == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("0F0,0X1\n,1F0\n", "column 2"),
        ("0F0,0SEND_F0,0B0\n1F0,1B0\n", "computation only"),
        ("0B0,0F0\n1F0,1B0\n", "without first running Forward"),
        ("0F0,0F1,0B0\n1F0,1B0\n", "expected 2"),  # stage 1 misses micro-batch 1
        ("0F0,1F0,2F0,2B0,1B0,0B0\n3F0,3B0\n", "as many stages"),
        ("1F0,1B0\n0F0,0B0\n", "stage s must run on pp rank s"),
    ],
    ids=["empty", "bad-cell", "comms", "order", "missing-micro-batch", "uneven-placement", "permuted"],
)
def test_bad_files_are_refused_with_a_message(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        csv_schedule.read_csv_schedule(_write(tmp_path, text))


def test_settings_refuse_what_does_not_fit_the_file(tmp_path):
    name = str(EXAMPLE)
    with pytest.raises(ValueError, match="no such file"):
        ThreeDSettings(pp=2, stages_per_rank=2, schedule=str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match="Use stages_per_rank=2"):
        ThreeDSettings(pp=2, schedule=name)
    with pytest.raises(ValueError, match=r"2 rows .* but pp=4"):
        ThreeDSettings(pp=4, stages_per_rank=2, schedule=name)
    with pytest.raises(ValueError, match="runs exactly 4 micro-batches"):
        ThreeDSettings(pp=2, stages_per_rank=2, schedule=name, micro_batches=8)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_greedy_zero_bubble_list_is_valid_and_has_zb_h1s_bubble(tmp_path, pp, m):
    path = csv_schedule.write_zero_bubble_greedy_csv(pp, m, tmp_path / "zb.csv")
    read = csv_schedule.read_csv_schedule(path)  # torch's validation: every F before its I before its W
    assert (read.pp, read.stages_per_rank, read.micro_batches, read.split_backward) == (pp, 1, m, True)
    rows = [line.split(",") for line in path.read_text().splitlines()]
    idle = sum(cell == "" for row in rows for cell in row) / sum(len(row) for row in rows)
    assert idle == pytest.approx((pp - 1) / (3 * m + pp - 1))  # Qi et al.'s ZB-H1 bubble, F = I = W
    assert idle < (pp - 1) / (m + pp - 1)  # 1F1B's
    for rank, row in enumerate(rows):  # micro-batches between their forward and their weight-gradient
        in_flight = [sum("F" in c for c in row[:t]) - sum("W" in c for c in row[:t]) for t in range(len(row) + 1)]
        assert max(in_flight) <= 2 * pp - rank  # at most twice 1F1B's pp - rank, whatever m
