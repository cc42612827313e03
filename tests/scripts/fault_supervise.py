"""Run ``fault_run.py`` under Lightning's launcher and watch what is left when its main process exits.

Usage: ``python fault_supervise.py fault_run.py-arguments... --out DIR``

The job's main process (rank 0, which starts the other ranks) is started by this one (``popen``). When it exits,
the ranks' process ids (``DIR/pid.<rank>``) are checked: any rank still running is an orphan. This script
then waits up to 60 s for every rank to be gone, kills what is left, and prints one line::

    SUPERVISOR main_rc=<code> main_exit=<unix time> all_exit=<unix time> leftover=<ranks alive at main's exit>

and exits with the main process's exit code (128 + signal number when it was killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def popen() -> Any:
    """How the job's main process is started: as Lightning's launcher starts its ranks. Under the test suite's zygote
    (``tests/zygote.py``) that is a fork of the pre-imported server, and so is every other rank of the job;
    ``L3D_TEST_SPAWN=1`` (or no zygote) starts a fresh interpreter, whose launcher then starts fresh interpreters for
    the other ranks (the path users take)."""
    zygote = sys.modules.get("l3d_test_zygote")  # registered by the zygote: present only in its forks
    if zygote is not None and os.environ.get("L3D_TEST_SPAWN", "0") != "1":
        return zygote.ForkedPopen
    return subprocess.Popen


def main() -> None:
    args = sys.argv[1:]
    out = Path(args[args.index("--out") + 1])
    proc = popen()([sys.executable, str(HERE / "fault_run.py"), *args], cwd=os.getcwd())
    rc = proc.wait()
    main_exit = time.time()
    pids = {int(p.name.split(".")[1]): int(p.read_text()) for p in out.glob("pid.*")}
    leftover = sorted(rank for rank, pid in pids.items() if pid != proc.pid and alive(pid))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.05)
    all_exit = time.time()
    for pid in pids.values():
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    print(f"SUPERVISOR main_rc={rc} main_exit={main_exit:.3f} all_exit={all_exit:.3f} leftover={leftover}", flush=True)
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
