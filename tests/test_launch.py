"""The test launcher (``tests/launch.py``) and its pre-imported zygote (``tests/zygote.py``).

Every multi-process test runs its ranks as forks of one process that imported torch and Lightning once; these
check that a fork sees what a fresh ``python script args`` would (its own argv, ``__main__``, ``sys.path[0]``,
environment, Lightning's rank, fresh random seeds), that Lightning's launcher still builds its children's
commands and that those children are forks too, that exit codes and signals come back as before, and that a
hanging job is still killed at its time limit.
"""

from __future__ import annotations

import json
import time

import pytest

from launch import SCRIPTS, forking, run_lightning, run_ranks


def _views(output: str) -> list[dict]:
    return [json.loads(line.split("PROBE ", 1)[1]) for line in output.splitlines() if line.startswith("PROBE {")]


@pytest.mark.slow
def test_forked_ranks_see_what_a_fresh_process_sees():
    job = run_ranks("launch_probe.py", 3, ["ranks", "x y"], env={"L3D_PROBE": "yes"}, timeout=120)
    views = sorted(_views(job.output), key=lambda v: v["rank_env"])
    assert [v["rank_env"] for v in views] == ["0", "1", "2"], job.tail()
    for v in views:
        assert v["argv"] == ["ranks", "x y"] and v["name"] == "__main__" and v["path0"] == str(SCRIPTS)
        assert v["probe_env"] == "yes" and v["nvml_check"] == "1"  # Lightning's import-time setting, as fresh
        assert v["rank_zero_only"] == int(v["rank_env"])  # Lightning reads it at import: re-read per rank
    assert len({v["torch_seed"] for v in views}) == 3 and len({v["py_random"] for v in views}) == 3
    if forking():
        assert len({v["ppid"] for v in views}) == 1  # one parent: the zygote


@pytest.mark.slow
def test_lightning_launcher_children_are_forks_with_their_own_rank():
    job = run_lightning("launch_probe.py", ["lightning"], timeout=180)
    views = _views(job.output)
    assert len(views) == 3, job.tail()
    assert sorted(v["rank_env"] or "0" for v in views) == ["0", "1", "2"]
    assert sorted(v["rank_zero_only"] for v in views) == [0, 1, 2]
    assert all(v["argv"] == ["lightning"] for v in views)
    assert sorted(line for line in job.output.splitlines() if line.startswith("PROBE-DONE")) == [
        f"PROBE-DONE rank {r}" for r in range(3)
    ]
    if forking():
        launcher = next(v for v in views if v["rank_env"] is None)
        children = [v for v in views if v is not launcher]
        assert {v["ppid"] for v in children} == {launcher["ppid"]}  # the zygote, not the launching rank


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "text"),
    [(["exit", "3"], 3, None), (["raise"], 1, "RuntimeError: probe failure"), (["kill"], -9, None)],
)
def test_exit_codes_come_back(args, code, text):
    job = run_ranks("launch_probe.py", 2, args, timeout=120, check=False)
    assert job.returncode == code, job.tail()
    if text is not None:
        assert text in job.output


@pytest.mark.slow
def test_a_hanging_job_is_killed_at_its_time_limit():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 8s"):
        run_ranks("launch_probe.py", 2, ["hang"], timeout=8)
    assert time.monotonic() - start < 40


def test_a_failed_job_names_every_reported_failure_before_its_tail():
    """The first failing rank's report and its error's last line head the message, even when later ranks' tracebacks
    push them out of the tail it shows."""
    from launch import _failure_lines

    output = "\n".join(
        [
            "[rank2]: Traceback (most recent call last):",
            '[rank2]:   File "train.py", line 3, in <module>',
            "[rank2]: ValueError: the first failure",
            "[rank 2] lightning_3d: rank 2 (dp 2, stage 0 of 1, tp 0) failed at global step 10:",
            *["[rank3]:   a long traceback line"] * 500,
            "[rank3]: RuntimeError: Connection reset by peer",
            "[rank3]: RuntimeError: Connection reset by peer",
        ]
    )
    lines = _failure_lines(output).splitlines()
    assert lines == [
        "failures reported:",
        "[rank2]: ValueError: the first failure",
        "[rank 2] lightning_3d: rank 2 (dp 2, stage 0 of 1, tp 0) failed at global step 10:",
        "[rank3]: RuntimeError: Connection reset by peer",
    ]
    assert _failure_lines("all fine\n") == ""
