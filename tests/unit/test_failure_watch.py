"""Pure helpers of the fail-fast watch: the one-line summary, communication errors, process liveness."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import traceback

import pytest
import torch.distributed as dist

from lightning_3d.tools.failure_watch import (
    _chain,
    _is_alive,
    _position,
    _proc_start_time,
    is_communication_error,
    summarize,
)


def chained(*errors: BaseException) -> BaseException:
    """``errors[0]`` raised from ``errors[1]`` raised from ... (the last is the root cause)."""
    for outer, inner in itertools.pairwise(errors):
        outer.__cause__ = inner
    return errors[0]


def test_summarize_names_the_root_cause_and_its_first_line() -> None:
    exc = chained(RuntimeError("stage 2 failed:\nsee below"), ValueError("\n\n  shape (3,) vs (4,)  \nmore"))
    assert summarize(exc) == "ValueError: shape (3,) vs (4,)"
    assert summarize(KeyError("k")) == "KeyError: 'k'"
    assert summarize(RuntimeError()) == "RuntimeError: "


def test_summarize_is_cut_at_500_characters() -> None:
    assert summarize(ValueError("x" * 2000)) == ("ValueError: " + "x" * 2000)[:500]


def test_chain_is_bounded() -> None:
    errors = [RuntimeError(str(i)) for i in range(40)]
    exc = chained(*errors)
    assert len(_chain(exc)) == 16
    assert _chain(exc)[-1] is errors[15]


@pytest.mark.parametrize(
    "message",
    [
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
        "Timed out waiting 1800000ms for recv operation to complete",
        "Connection reset by peer",
        "NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error",
        "[Rank 1] watchdog caught collective operation timeout",
    ],
)
def test_communication_errors(message: str) -> None:
    assert is_communication_error(RuntimeError(message))


def test_communication_error_as_a_cause() -> None:
    assert is_communication_error(chained(ValueError("step failed"), RuntimeError("gloo: connection refused")))


def test_dist_error_is_a_communication_error() -> None:
    assert is_communication_error(dist.DistError("anything"))


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
        ValueError("NCCL"),  # only runtime errors carry transport failures
        KeyError("gloo"),
    ],
)
def test_other_errors_are_not_communication_errors(exc: BaseException) -> None:
    assert not is_communication_error(exc)


def test_own_process_is_alive_and_a_reaped_one_is_not() -> None:
    started = _proc_start_time(os.getpid())
    assert started  # Linux: the start time from /proc
    assert _is_alive(os.getpid(), started)
    assert _is_alive(os.getpid(), "")  # unknown start time: alive by pid
    assert not _is_alive(os.getpid(), str(int(started) + 1))  # same pid, another process (pid reuse)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _proc_start_time(child.pid) is None
    assert not _is_alive(child.pid, "")


def test_position_tells_communication_waits_apart() -> None:
    assert _position([]) == {"at": "?", "comm": False}
    wait = traceback.FrameSummary(f"{os.sep}x{os.sep}distributed{os.sep}c10d.py", 10, "wait", line="work.wait()")
    busy = traceback.FrameSummary("/home/user/model.py", 42, "forward", line="y = x @ w")
    assert _position([busy, wait]) == {"at": f"{wait.filename}:10 in wait: work.wait()", "comm": True}
    assert _position([wait, busy]) == {"at": "/home/user/model.py:42 in forward: y = x @ w", "comm": False}
    p2p = traceback.FrameSummary("/x/reliability.py", 1, "_wait_p2p", line="")
    assert _position([p2p])["comm"] is True


def test_the_first_failing_rank_lingers_until_the_others_have_said_why_they_stop() -> None:
    """Under Lightning's launcher rank 0's process SIGKILLs every child once one has exited with an error: the rank
    that failed first waits (a few polls at most) until every other rank has marked itself exiting; a rank whose
    failure was a consequence, not rank 0, does not wait."""
    import time

    import torch.distributed as dist

    from lightning_3d.tools.failure_watch import FailureWatch

    store = dist.HashStore()
    watch = FailureWatch(1, 3, lambda r: f"stage {r}", lambda: [], interval=0.1)
    budget = 4 * watch.interval + 1  # what linger waits at the most
    start = time.monotonic()
    watch.linger(store)  # not the first failure, not rank 0: no wait
    assert time.monotonic() - start < 0.2
    start = time.monotonic()
    watch.linger(store, first=True)  # nobody has said anything: waits its whole budget
    assert budget - 0.05 <= time.monotonic() - start < budget + 1.0
    for rank in (0, 2):
        store.set(f"/exiting/{rank}", "1")
    start = time.monotonic()
    watch.linger(store, first=True)  # both others have: no wait
    assert time.monotonic() - start < 0.2
