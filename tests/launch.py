"""Run test scripts in fresh processes with a hard wall-clock limit.

Every multi-process test goes through here so that a hang fails the test instead of stalling the
suite. Two ways to start a job:

* ``run_lightning(script, args)`` starts ONE process; the script builds a ``Trainer(devices=N)``
  and Lightning's own launcher starts the other ranks (the path a user takes).
* ``run_ranks(script, nprocs, args)`` starts N processes with the torchrun environment
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), for scripts that use
  ``torch.distributed`` directly or that test the "processes created externally" path.

Each job runs in its own session; on timeout the whole session is killed, so no rank survives.
"""

from __future__ import annotations

import os
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
    return _run([cmd], [base_env(extra)], timeout=timeout, check=check)


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
    return _run([cmd] * nprocs, envs, timeout=timeout, check=check)


def _run(cmds: list[list[str]], envs: list[dict[str, str]], *, timeout: float, check: bool) -> JobResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{i}.log", "w+") for i in range(len(cmds))]
        procs = [
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for cmd, env, log in zip(cmds, envs, logs)
        ]
        timed_out = False
        deadline = start + timeout
        try:
            for proc in procs:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    proc.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for proc in procs:
                _kill_session(proc)
            for proc in procs:
                proc.wait()
        outputs = []
        for i, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            log.close()
            outputs.append(text if len(logs) == 1 else f"----- rank {i} -----\n{text}")
        output = "\n".join(outputs)
    seconds = time.monotonic() - start
    codes = [p.returncode for p in procs]
    returncode = next((c for c in codes if c != 0), 0)
    if timed_out:
        raise AssertionError(f"job timed out after {timeout:.0f}s (killed); output tail:\n" + output[-6000:])
    result = JobResult(returncode, output, seconds)
    if check and returncode != 0:
        raise AssertionError(f"job failed with exit code {returncode}; output tail:\n" + output[-8000:])
    return result


def run_commands(
    cmds: list[list[str]], envs: list[dict[str, str]], *, timeout: float = 240, check: bool = True
) -> JobResult:
    """Start several commands at once (e.g. two torchrun "nodes"), each in its own session, with one time limit.

    ``envs`` are complete environments (start from :func:`base_env`). The output is every command's log in
    turn, headed ``----- rank i -----`` where ``i`` is the command's index.
    """
    return _run(cmds, envs, timeout=timeout, check=check)
