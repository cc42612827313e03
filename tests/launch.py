"""Run test scripts in fresh processes with a hard wall-clock limit.

Every multi-process test goes through here so that a hang fails the test instead of stalling the
suite. Two ways to start a job:

* ``run_lightning(script, args)`` starts ONE process; the script builds a ``Trainer(devices=N)``
  and Lightning's own launcher starts the other ranks (the path a user takes).
* ``run_ranks(script, nprocs, args)`` starts N processes with the torchrun environment
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), for scripts that use
  ``torch.distributed`` directly or that test the "processes created externally" path.

Each job runs in its own session; on timeout the whole session is killed, so no rank survives.

Both fork rather than start interpreters (``tests/zygote.py``): one server per test session imports torch,
Lightning and this package once, and every rank of every job is a fork of it, Lightning's launcher's children
included (its ``Popen`` of each child is answered by a fork), which takes some 6 s of import CPU off every rank.
``L3D_TEST_SPAWN=1`` starts every rank as a fresh interpreter instead (the path users take, slower).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"


def forking() -> bool:
    """Whether jobs are forked from a pre-imported process (the default) or started fresh."""
    return os.environ.get("L3D_TEST_SPAWN", "0") != "1"


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        # Lightning prints tips and GPU availability lines we do not need in test logs.
        PL_DISABLE_FORK="1",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    if extra:
        env.update(extra)
    return env


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _script_path(script: str | Path) -> Path:
    path = Path(script)
    return path if path.is_absolute() else SCRIPTS / path


def run_lightning(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> JobResult:
    """Start ``python script args`` in one process; Lightning's launcher starts the other ranks."""
    cmd = [sys.executable, str(_script_path(script)), *map(str, args)]
    extra = {"MASTER_PORT": str(free_port()), **(env or {})}
    return _run([cmd], [base_env(extra)], timeout=timeout, check=check, fork=True)


def run_ranks(
    script: str | Path,
    nprocs: int,
    args: list[str] | tuple[str, ...] = (),
    *,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> JobResult:
    """Start ``nprocs`` copies of ``python script args`` with the torchrun environment."""
    port = str(free_port())
    cmd = [sys.executable, str(_script_path(script)), *map(str, args)]
    envs = []
    for rank in range(nprocs):
        extra = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **(env or {}),
        }
        envs.append(base_env(extra))
    return _run([cmd] * nprocs, envs, timeout=timeout, check=check, fork=True)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every process until ``deadline``; kill their sessions either way. True if one timed out."""
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            _kill_session(proc)
        for proc in procs:
            proc.wait()
    return timed_out


def _read_logs(paths: list[Path]) -> str:
    texts = [path.read_text(errors="replace") if path.exists() else "" for path in paths]
    if len(texts) == 1:
        return texts[0]
    return "\n".join(f"----- rank {i} -----\n{text}" for i, text in enumerate(texts))


def _run(
    cmds: list[list[str]], envs: list[dict[str, str]], *, timeout: float, check: bool, fork: bool = False
) -> JobResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        logs = [work / f"rank{i}.log" for i in range(len(cmds))]
        if fork and forking():
            timed_out, codes, extra = _run_forked(cmds, envs, logs, work, start + timeout)
        else:
            files = [open(log, "w") for log in logs]
            procs = [
                subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                for cmd, env, f in zip(cmds, envs, files)
            ]
            timed_out = _wait_all(procs, start + timeout)
            for f in files:
                f.close()
            codes, extra = [p.returncode for p in procs], ""
        output = _read_logs(logs) + extra
    seconds = time.monotonic() - start
    returncode = next((c for c in codes if c != 0), 0)
    if timed_out:
        raise AssertionError(f"job timed out after {timeout:.0f}s (killed); output tail:\n" + output[-6000:])
    result = JobResult(returncode, output, seconds)
    if check and returncode != 0:
        raise AssertionError(
            f"job failed with exit code {returncode}; {_failure_lines(output)}output tail:\n" + output[-8000:]
        )
    return result


_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b.*")


def _failure_lines(output: str, limit: int = 24) -> str:
    """Every rank's failure report (the strategy's ``lightning_3d: rank N (...) failed ...`` lines) and the last
    line of every traceback, from anywhere in the output: the rank that failed first is named even when its
    traceback lies before the tail the message shows."""
    seen: list[str] = []
    for line in output.splitlines():
        line = line.strip()
        if ("lightning_3d: rank" in line and " failed" in line) or _ERROR_LINE.match(line):
            if line not in seen:
                seen.append(line)
    return ("failures reported:\n" + "\n".join(seen[:limit]) + "\n") if seen else ""


class _Zygote:
    """The test session's zygote server (``tests/zygote.py``), started with the first forked job."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="l3d-zygote-"))
        atexit.register(shutil.rmtree, self.dir, True)  # socket, log and exit codes (the server exits with us)
        self.socket = str(self.dir / "server.sock")
        read, self._lifeline = os.pipe()  # the server exits when this end closes (with the test session)
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE), self.socket, str(read)],
            env=base_env(),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(read,),
            start_new_session=True,
        )
        os.close(read)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.socket):  # the server binds its socket once its imports are done
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the test zygote did not start:\n" + (self.dir / "server.log").read_text())
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def _run_forked(
    cmds: list[list[str]], envs: list[dict[str, str]], logs: list[Path], work: Path, deadline: float
) -> tuple[bool, list[int], str]:
    """Run the job's processes as forks of the session's pre-imported zygote. Returns (timed out, exit codes,
    the job process's own log)."""
    from zygote import request_job

    single = len(cmds) == 1  # a Lightning job: its launcher's children write to the same log, as they inherit it
    zlog = logs[0] if single else work / "zygote.log"
    zlog.touch()
    spec = {
        "work": str(work),
        "log": str(zlog),
        "procs": [
            {"argv": cmd, "env": env, "cwd": str(ROOT), "log": None if single else str(log)}
            for cmd, env, log in zip(cmds, envs, logs)
        ],
    }
    server = _zygote()
    pid = request_job(server.socket, spec)  # the job's process, leading a session of its own
    exited = server.dir / "exits" / str(pid)  # written by the server once it has reaped the job's process
    timed_out = False
    while not exited.exists():
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever is left of the job (all of it, on a timeout)
    except (ProcessLookupError, PermissionError):
        pass
    while not exited.exists() and server.alive():  # reaped at once after the kill
        time.sleep(0.02)
    exited.unlink(missing_ok=True)
    result = work / "result.json"
    if result.exists():
        codes = json.loads(result.read_text())["codes"]
    else:
        codes = [1] * len(cmds)
    extra = "" if single or not zlog.stat().st_size else "\n----- zygote -----\n" + zlog.read_text(errors="replace")
    return timed_out, codes, extra


def run_commands(
    cmds: list[list[str]],
    envs: list[dict[str, str]],
    *,
    timeout: float = 240,
    check: bool = True,
    fork: bool = False,
) -> JobResult:
    """Start several commands at once (e.g. two torchrun "nodes"), each in its own session, with one time limit.

    ``envs`` are complete environments (start from :func:`base_env`). The output is every command's log in
    turn, headed ``----- rank i -----`` where ``i`` is the command's index. ``fork``: each ``python script ...``
    command is a fork of the test zygote (as :func:`run_ranks` starts ranks) instead of a fresh interpreter; a
    launcher such as torchrun starts its own interpreters and cannot be forked.
    """
    return _run(cmds, envs, timeout=timeout, check=check, fork=fork)
