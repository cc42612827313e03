"""Bad configuration is refused with one clear message before any rank waits on another.

Errors that depend only on the layout are raised when the Trainer is built, in the launching process,
before any rank starts. Errors that depend on the model are raised in ``setup`` by every rank alike (no
collective has been issued yet); those run as real multi-process jobs that must exit non-zero quickly with
the message, leaving no rank behind (the harness kills the job's session on timeout, failing the test).
"""

from __future__ import annotations

import lightning as L
import pytest

from lightning_3d import ThreeDStrategy

from launch import run_lightning, run_ranks


def _trainer(devices: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=ThreeDStrategy(**kwargs), logger=False)


def test_tp_times_pp_must_divide_world():
    with pytest.raises(ValueError) as err:
        _trainer(6, tp=4, pp=1)
    message = str(err.value)
    assert "tp * pp = 4 * 1 = 4 does not divide the world size 6" in message
    assert "(tp=2, pp=3, dp=1)" in message and "(tp=1, pp=1, dp=6)" in message


def test_explicit_dp_must_match_world():
    with pytest.raises(ValueError, match=r"dp=3 does not match the world.*dp=2"):
        _trainer(8, tp=2, pp=2, dp=3)


def test_micro_batches_below_pp_under_1f1b():
    with pytest.raises(ValueError, match=r"micro_batches=2 < pp=4.*micro_batches >= 4.*gpipe"):
        ThreeDStrategy(pp=4, micro_batches=2)
    assert ThreeDStrategy(pp=4, micro_batches=2, schedule="gpipe").micro_batches == 2


def test_unknown_schedule_and_stage_count():
    with pytest.raises(ValueError, match="Unknown schedule"):
        ThreeDStrategy(schedule="zigzag")
    with pytest.raises(ValueError, match="stages_per_rank"):
        ThreeDStrategy(pp=2, stages_per_rank=2, schedule="1f1b")


def test_v_and_zero_bubble_schedules_refused_before_any_rank_starts():
    """The V schedules run two stages per rank and a micro-batch per stage; refused when the Trainer is built."""
    with pytest.raises(ValueError, match=r"places exactly two stages per rank in a V.*stages_per_rank=4"):
        _trainer(2, pp=2, stages_per_rank=4, schedule="zbvzerobubble", micro_batches=8)
    with pytest.raises(ValueError, match=r"micro_batches=2 < 2 \* pp = 4 under schedule='dualpipev'"):
        _trainer(2, pp=2, stages_per_rank=2, schedule="dualpipev", micro_batches=2)
    with pytest.raises(ValueError, match=r"2 rounds .* micro_batches=4 or 6"):
        _trainer(2, pp=2, stages_per_rank=2, schedule="interleavedzerobubble", micro_batches=5)
    with pytest.raises(ValueError, match="is a base class in torch, not a schedule"):
        _trainer(2, pp=2, stages_per_rank=2, schedule="PipelineScheduleMulti")


def test_registered_under_short_name():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="3d", logger=False)
    assert isinstance(trainer.strategy, ThreeDStrategy)


SETUP_ERRORS = {
    "no_body": "NoBody has no block container to split into pipeline stages: searched for a Hugging Face",
    "outside_parameter": "OutsideParameter owns parameters directly (['scale'])",
    "too_few_layers": "4 layers with parameters (7 entries) but 5 pipeline stages",
    "no_reset_parameters": "body.0 (RawParameter: weight)",
    "batch_not_divisible": "has 6 samples per data-parallel replica, which micro_batches=4 does not divide",
    "body_not_called": "training_step returned without calling the body 'body'",
    "heads_not_divisible": "tp values that work: 1, 5",
    "skip_across_stages": (
        "a skip connection crosses the stage boundary between transformer.h.1 and transformer.h.2 (in the input of "
        "transformer.h.2)",
        "(found before the first training step, on every rank, by running training_step",
    ),
    "residual_outside_blocks": "a skip connection crosses the stage boundary between transformer.h.1 and "
    "transformer.h.2",
    "skip_found_at_setup": (
        "a skip connection crosses the stage boundary between transformer.h.1 and transformer.h.2 (in the input of "
        "transformer.h.2)",
        "(found at setup by running forward(example_input_array) on fake tensors)",
    ),
    "no_container": "ThreeDStrategy(blocks='attribute.path'), or use pp=1",
    "kv_heads_not_divisible": "num_key_value_heads = 2 is not divisible by tp=4. tp values that work: 1, 2",
    "batch_per_world_rank": (
        "the ranks of data-parallel replica 0 got different batches in their first training_step (batch 1 on "
        "rank 0; batch 2 on rank 1",
        "trainer.strategy.distributed_sampler_kwargs (here num_replicas=1)",
    ),
}


# cases started as one process per rank (each rank's own log): every rank must raise the message itself, not be
# stopped by another rank's failure (no example_input_array: checked before the first step's schedule runs)
EVERY_RANK = {"skip_across_stages": 2}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SETUP_ERRORS))
def test_model_errors_stop_every_rank(case):
    if case in EVERY_RANK:
        result = run_ranks("bad_config.py", EVERY_RANK[case], [case], timeout=150, check=False)
        logs = result.output.split("----- rank ")[1:]
        assert len(logs) == EVERY_RANK[case], result.tail()
    else:
        result = run_lightning("bad_config.py", [case], timeout=150, check=False)
        logs = [result.output]
    assert result.returncode != 0, result.tail()
    expected = SETUP_ERRORS[case]
    for log in logs:
        for part in expected if isinstance(expected, tuple) else (expected,):
            assert part in log, result.tail(40)
    assert result.seconds < 120
