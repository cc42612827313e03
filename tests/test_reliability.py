"""Reliability: no silent hangs, no training on garbage, clear errors for bad input.

The "Faults" and "determinism" rows of notes/reliability-catalogue.md, as real multi-process jobs
(scripts/fault_run.py) with a hard wall-clock limit each (tests/launch.py):

* a rank killed (SIGKILL) or raising in the middle of a step (first stage, last stage, a tensor-parallel
  peer), under Lightning's own launcher and with externally started processes: the job exits non-zero well
  within ``train_timeout + 30 s`` (fail-fast takes a few seconds), no process is left, and the output names
  the failing rank (with its traceback when it raised);
* a rank stuck forever: the others fail on the (short) process-group timeout, the stuck rank is named and
  stopped;
* NaN in the loss (last stage) or in one stage's gradients: every rank raises the same ``NonFiniteError``
  at the same step and no optimizer step is taken, or, with ``on_nonfinite="skip"``, every rank skips that
  step (under gradient accumulation too);
* a configuration that differs between ranks: ``ConsistencyError`` naming the keys and ranks;
* data-parallel replicas that diverge: ``DPConsistencyCheck`` names the parameter;
* the same run twice (tp2 x pp2 x dp2) gives bitwise-identical losses and parameters, and the
  process groups switch from the setup timeout to ``train_timeout`` after the first step.

Measured fault-to-end times are printed as ``FAULT-TIMING`` lines (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_3d import ThreeDStrategy
from lightning_3d.core import torch_compat
from lightning_3d.reliability import _P2PTimeout, _ranks_text
from lightning_3d.tools.dp_check import bit_checksum
from lightning_3d.tools.failure_watch import is_communication_error, summarize

from launch import JobResult, run_lightning, run_ranks

FAIL_FAST = 20.0  # seconds from the fault to the end of the job when nothing has to time out
TRAIN_TIMEOUT = 60.0  # for the crash tests: ending within FAIL_FAST shows nobody waited for a timeout
STUCK_TIMEOUT = 3.0


# ---------------------------------------------------------------------------------------------- helpers
def _fault_time(output: str) -> float:
    match = re.search(r"FAULT_AT (\d+\.\d+)", output)
    assert match, "the fault was never injected:\n" + output[-4000:]
    return float(match.group(1))


def _lightning_job(
    tmp_path: Path, *args: object, timeout: float = 150, env: dict[str, str] | None = None
) -> tuple[JobResult, dict[str, object]]:
    """One job under Lightning's launcher, through the supervisor that reports leftover ranks (its processes forked
    from the test zygote, or fresh interpreters with ``env={"L3D_TEST_SPAWN": "1"}``: scripts/fault_supervise.py)."""
    result = run_lightning("fault_supervise.py", [*args, "--out", tmp_path], timeout=timeout, check=False, env=env)
    line = re.search(
        r"SUPERVISOR main_rc=(-?\d+) main_exit=([\d.]+) all_exit=([\d.]+) leftover=\[(.*?)\]", result.output
    )
    assert line, result.tail(60)
    info = {
        "main_rc": int(line.group(1)),
        "main_exit": float(line.group(2)),
        "all_exit": float(line.group(3)),
        "leftover": [int(r) for r in line.group(4).split(",") if r.strip()],
    }
    return result, info


def _external_job(tmp_path: Path, nprocs: int, *args: object, timeout: float = 150) -> tuple[JobResult, float]:
    result = run_ranks(
        "fault_run.py", nprocs, [*args, "--launcher", "external", "--out", tmp_path], timeout=timeout, check=False
    )
    return result, time.time()


def _timing(name: str, seconds: float, extra: str = "") -> None:
    print(f"\nFAULT-TIMING {name}: {seconds:.2f} s from the fault to the end of the job {extra}".rstrip())


def _where(rank: int, tp: int, pp: int = 2) -> str:
    return f"dp {rank // (tp * pp)}, stage {(rank // tp) % pp} of {pp}, tp {rank % tp}"


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------- unit checks
def test_helpers():
    assert _ranks_text([0, 1, 2, 5]) == "ranks 0-2, 5"
    assert _ranks_text([3]) == "rank 3"
    t = torch.arange(16, dtype=torch.float32)
    flipped = t.clone()
    flipped.view(torch.int32)[7] ^= 1  # one bit of one element
    assert not torch.equal(bit_checksum(t), bit_checksum(flipped))
    assert not torch.equal(bit_checksum(t), bit_checksum(t.flip(0)))
    assert torch.equal(bit_checksum(t), bit_checksum(t.clone()))
    try:
        try:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as inner:
            raise RuntimeError("\n   [Stage 1] failed to run forward:\nargs: ...") from inner
    except RuntimeError as outer:
        assert is_communication_error(outer)
        assert summarize(outer) == "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"
    original = torch_compat.current_wait_batch_p2p()
    waited: list[tuple] = []

    class Work:
        def wait(self, *args):
            waited.append(args)

    _P2PTimeout.install(timedelta(seconds=1))
    try:
        assert torch_compat.current_wait_batch_p2p() is not original
        torch_compat.current_wait_batch_p2p()([Work(), Work()])  # what the schedules call now
        assert waited == [(timedelta(seconds=1),)] * 2
    finally:
        _P2PTimeout.remove()
    assert torch_compat.current_wait_batch_p2p() is original
    assert torch_compat.p2p_functions_are_torchs()


def test_constructor_arguments():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        ThreeDStrategy(on_nonfinite="ignore")
    strategy = ThreeDStrategy(timeout=600, train_timeout=30)
    assert strategy._reliability.setup_timeout.total_seconds() == 600
    assert strategy._reliability.train_timeout.total_seconds() == 30


# ---------------------------------------------------------------------------------------------- faults
# (kind, tp, pp, rank, what the rank is): under Lightning's launcher rank 0 is the launching process
LIGHTNING_FAULTS = [
    ("kill", 1, 2, 1, "last stage, a child process"),
    ("kill", 1, 2, 0, "first stage, the launching process"),
    ("raise", 2, 2, 1, "tensor-parallel peer of stage 0"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "tp", "pp", "rank", "what"), LIGHTNING_FAULTS, ids=[f[0] + str(f[3]) for f in LIGHTNING_FAULTS]
)
def test_fault_under_lightning_launcher(tmp_path, kind, tp, pp, rank, what):
    # The launching process SIGKILLed: its children are orphaned as a user's are, in a tree of fresh interpreters
    # (the other faults run as forks of the test zygote, whose ranks are the job process's children)
    env = {"L3D_TEST_SPAWN": "1"} if (kind, rank) == ("kill", 0) else None
    result, info = _lightning_job(
        tmp_path, "--tp", tp, "--pp", pp, "--fault", kind, "--rank", rank, "--train-timeout", TRAIN_TIMEOUT, env=env
    )
    fault = _fault_time(result.output)
    _timing(
        f"lightning launcher, {kind} rank {rank} ({what}), tp{tp} pp{pp}",
        info["all_exit"] - fault,
        f"(launching process ended after {info['main_exit'] - fault:.2f} s)",
    )
    assert info["main_rc"] != 0, result.tail()
    if not (kind == "kill" and rank == 0):  # a SIGKILLed launcher cannot take its children along
        assert info["leftover"] == [], f"ranks {info['leftover']} outlived the launching process:\n{result.tail()}"
    assert info["all_exit"] - fault < FAIL_FAST, result.tail(80)  # every rank ended by itself
    if kind == "raise":
        assert (
            f"[rank {rank}] lightning_3d: rank {rank} (dp 0, stage 0 of 2, tp 1) failed at global step 2:"
            in result.output
        )
        assert f"[rank {rank}] RuntimeError: injected fault on rank {rank} at step 2" in result.output
        others = [r for r in range(tp * pp) if r != rank]
        for r in others:  # each other rank says why it stops: the failing rank, by name
            stopped = f"[rank {r}] lightning_3d: stopping rank {r} ({_where(r, tp)}) because rank {rank} "
            consequence = f"[rank {r}] (a consequence: rank {rank} "
            assert stopped in result.output or consequence in result.output, result.tail(80)
    else:
        assert re.search(
            rf"rank {rank} \(dp 0, stage {rank if pp == 2 else 0} of 2, tp 0.*ended without reporting an error",
            result.output,
        ), result.tail(80)


@pytest.mark.slow
def test_fault_with_on_exception_checkpoint(tmp_path):
    """Lightning runs the callbacks' ``on_exception`` before ``Strategy.on_exception``: with
    ``OnExceptionCheckpoint`` the failing last-stage rank went into the checkpoint's collectives while the first stage
    waited for it in the pipeline, and the job hung until ``train_timeout`` (60 s here) without naming the fault.
    Now the save reports the failure first and is skipped with a line saying so; every rank ends within FAIL_FAST,
    and no checkpoint folder is left."""
    result, info = _lightning_job(
        tmp_path, "--fault", "raise", "--rank", 1, "--train-timeout", TRAIN_TIMEOUT, "--on-exception-checkpoint"
    )
    fault = _fault_time(result.output)
    _timing("lightning launcher, raise rank 1 with OnExceptionCheckpoint", info["all_exit"] - fault)
    assert info["main_rc"] != 0 and info["leftover"] == [], result.tail(80)
    assert info["all_exit"] - fault < FAIL_FAST, result.tail(80)
    assert "[rank 1] lightning_3d: rank 1 (dp 0, stage 1 of 2, tp 0) failed at global step 2:" in result.output
    assert "[rank 1] RuntimeError: injected fault on rank 1 at step 2" in result.output
    assert "[rank 1] lightning_3d: checkpoint" in result.output and "not saved: this rank failed" in result.output
    assert not list((tmp_path / "exc").glob("*")) if (tmp_path / "exc").exists() else True


# (kind, tp, pp, rank, what)
EXTERNAL_FAULTS = [
    ("raise", 1, 2, 0, "first stage"),
    ("kill", 2, 2, 3, "tensor-parallel peer of the last stage"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "tp", "pp", "rank", "what"), EXTERNAL_FAULTS, ids=[f[0] + str(f[3]) for f in EXTERNAL_FAULTS]
)
def test_fault_with_external_launch(tmp_path, kind, tp, pp, rank, what):
    world = tp * pp
    result, end = _external_job(
        tmp_path, world, "--tp", tp, "--pp", pp, "--fault", kind, "--rank", rank, "--train-timeout", TRAIN_TIMEOUT
    )
    fault = _fault_time(result.output)
    _timing(f"external launch, {kind} rank {rank} ({what}), tp{tp} pp{pp}", end - fault)
    assert result.returncode != 0, result.tail()
    assert end - fault < FAIL_FAST, result.tail(80)  # every process has exited (run_ranks waits for all)
    if kind == "raise":
        assert f"[rank {rank}] RuntimeError: injected fault on rank {rank} at step 2" in result.output
    else:
        assert re.search(rf"rank {rank} \(dp 0, stage 1 of 2, tp 1.*ended without reporting an error", result.output), (
            result.tail(80)
        )


@pytest.mark.slow
def test_stuck_rank_fails_on_the_timeout(tmp_path):
    """Rank 1 (last stage) sleeps forever inside its step; rank 0 waits on a pipeline receive. With
    train_timeout=3 s rank 0 times out, names rank 1 as not communicating, and rank 1 is stopped."""
    result, end = _external_job(
        tmp_path, 2, "--pp", 2, "--fault", "sleep", "--rank", 1, "--train-timeout", STUCK_TIMEOUT, timeout=120
    )
    fault = _fault_time(result.output)
    _timing(f"external launch, rank 1 stuck (train_timeout={STUCK_TIMEOUT:.0f} s), pp2", end - fault)
    assert result.returncode != 0, result.tail()
    assert STUCK_TIMEOUT <= end - fault < STUCK_TIMEOUT + 30, result.tail(80)
    assert "Timed out waiting 3000ms" in result.output, result.tail(80)
    assert re.search(
        r"NOT waiting on communication.*\n.*rank 1 \(dp 0, stage 1 of 2, tp 0\) at .*fault_run\.py.*sleep",
        result.output,
    ), result.tail(80)
    assert "[rank 1] lightning_3d: stopping rank 1" in result.output


# ---------------------------------------------------------------------------------------------- numbers
@pytest.mark.slow
def test_nan_loss_raises_on_every_rank(tmp_path):
    result, info = _lightning_job(tmp_path, "--pp", 2, "--fault", "nan_loss", "--step", 2)
    assert info["main_rc"] != 0 and info["leftover"] == [], result.tail()
    expected = "NonFiniteError: ThreeDStrategy: non-finite numbers at global step 2 (epoch 0, batch 2): the loss is nan"
    for r, rec in enumerate(_records(tmp_path, 2)):
        assert rec["exception"].startswith(expected[len("NonFiniteError: ") :]) or expected in rec["exception"], rec
        assert "gradients of pipeline stage(s) [0, 1] (of 2) are not finite" in rec["exception"]
        assert rec["steps"] == [1, 2], rec["steps"]  # steps 0 and 1 completed, none after
        assert rec["after_exception"] == rec["before"][-1], f"rank {r} changed its parameters"
        assert f"[rank {r}] lightning_3d: rank {r}" in result.output


@pytest.mark.slow
def test_nan_gradient_on_one_stage_is_skipped_everywhere(tmp_path):
    """NaN gradients on stage 0 of tensor-parallel rank 1 only, during both batches of optimizer step 2
    (accumulate_grad_batches=2): every rank skips exactly that optimizer step."""
    result, _ = _external_job(
        tmp_path, 4, "--tp", 2, "--pp", 2, "--fault", "nan_grad", "--rank", 1, "--step", 2,
        "--on-nonfinite", "skip", "--accumulate", 2, "--steps", 4, "--batch", 4,
    )  # fmt: skip
    assert result.returncode == 0, result.tail()
    assert "gradients of pipeline stage(s) [0] (of 2) are not finite" in result.output
    for r, rec in enumerate(_records(tmp_path, 4)):
        assert rec["skipped"] == [2], (r, rec["skipped"])
        assert rec["final_step"] == 4
        batches = list(zip(rec["steps"], rec["before"], rec["after"]))
        # the last batch of each window is where the optimizer steps: window of step 2 -> batches 4, 5
        assert batches[5][0] == 3 and batches[5][1] == batches[5][2], f"rank {r} updated at the skipped step"
        assert batches[3][1] != batches[3][2] and batches[7][1] != batches[7][2], f"rank {r} did not train"
        assert rec["adam_steps"][5] == [2.0] and rec["adam_steps"][7] == [3.0], rec["adam_steps"]


# ---------------------------------------------------------------------------------------------- consistency
@pytest.mark.slow
def test_config_mismatch_is_named(tmp_path):
    result, info = _lightning_job(tmp_path, "--pp", 2, "--fault", "mismatch", "--rank", 1)
    assert info["main_rc"] != 0 and info["leftover"] == [], result.tail()
    out = result.output
    assert "ConsistencyError: ThreeDStrategy: the ranks of this job do not agree" in out
    assert "strategy.micro_batches: 2 on rank 0; 4 on rank 1" in out
    assert (
        "model.body.0.weight: parameter (32, 16) torch.float32 on rank 0; parameter (40, 16) torch.float32 on rank 1"
        in out
    )
    assert "[rank 1] lightning_3d: rank 1 (dp 0, stage 1 of 2, tp 0) failed during setup" in out


@pytest.mark.slow
def test_partitioner_mismatch_is_named_before_the_timing_collective(tmp_path):
    """A rank asking for partitioner="compute" (which times the layers and all-gathers the table) among ranks asking
    for "uniform": the settings are compared before that collective, so every rank names the difference instead of
    meeting the others in a different collective."""
    result, info = _lightning_job(
        tmp_path, "--pp", 2, "--fault", "partition", "--rank", 1, "--timeout", 60, timeout=150
    )
    assert info["main_rc"] != 0 and info["leftover"] == [], result.tail()
    out = result.output
    assert "ConsistencyError: ThreeDStrategy: the ranks of this job do not agree" in out, result.tail()
    assert "strategy.partitioner: 'uniform' on rank 0; 'compute' on rank 1" in out, result.tail()
    for rec in _records(tmp_path, 2):
        assert "ConsistencyError" in rec["exception"], rec


@pytest.mark.slow
def test_dp_divergence_is_named(tmp_path):
    result, _ = _external_job(
        tmp_path, 2, "--pp", 1, "--dp", 2, "--fault", "diverge", "--rank", 1, "--step", 2, "--dp-check", 2
    )
    assert result.returncode != 0, result.tail()
    assert "DPDivergenceError: DPConsistencyCheck: data-parallel replicas diverged at global step 2" in result.output
    assert "body.0.weight (stage 0, tp 0: data-parallel ranks [0] vs [1] differ)" in result.output
    for rec in _records(tmp_path, 2):
        assert rec["steps"] == [1, 2] and "DPDivergenceError" in rec["exception"]


# ---------------------------------------------------------------------------------------------- determinism
@pytest.mark.slow
def test_same_run_twice_is_bitwise_identical(tmp_path):
    """tp2 x pp2 x dp2, 6 steps, DPConsistencyCheck every 2 steps: losses and parameter bits equal between two
    launches, one of fresh interpreters (each with its own hash seed and allocator history) and one of forks of the
    test zygote; replicas identical throughout; all process groups on train_timeout after the first step."""
    runs = []
    for i, env in enumerate(({"L3D_TEST_SPAWN": "1"}, None)):
        out = tmp_path / f"run{i}"
        result, info = _lightning_job(
            out, "--tp", 2, "--pp", 2, "--dp", 2, "--steps", 6, "--dp-check", 2, "--timeout", 300,
            "--train-timeout", 45, timeout=200, env=env,
        )  # fmt: skip
        assert info["main_rc"] == 0 and info["leftover"] == [], result.tail()
        runs.append(_records(out, 8))
    first, second = runs
    for r in range(8):
        assert first[r]["loss"] == second[r]["loss"], f"rank {r}: {first[r]['loss']} vs {second[r]['loss']}"
        assert first[r]["after"] == second[r]["after"], f"rank {r}: parameters differ between the runs"
        assert first[r]["loss"] == first[0]["loss"]  # every rank saw the same relayed loss
        assert len(set(first[r]["loss"])) > 1  # and it changes: it trains
        assert set(first[r]["timeouts_setup"].values()) == {300.0}, first[r]["timeouts_setup"]
        assert set(first[r]["timeouts_train"].values()) == {45.0}, first[r]["timeouts_train"]
