"""A pre-imported server that forks the test suite's ranks instead of starting a fresh interpreter for each.

Why: on the 2-core test machine every rank of a multi-process test spent about 6 s of CPU importing torch,
Lightning (whose torchmetrics import pulls in transformers) and this package before doing any work, and some
1.5 s more tearing those modules down at exit; an 8-rank job paid it eight times over two cores. One server per
test session (``tests/launch.py`` starts it with the first job: ``python tests/zygote.py SOCKET FD``) imports
them once. For each job it forks a job process, in a session of its own (the harness kills the session on a
timeout), which forks the job's processes, serves their launchers' requests for more, reaps them and writes
their exit codes to ``<work>/result.json``. The server never runs job code, so every fork starts from the same
pristine state. It exits when the test session closes the pipe ``FD``.

Each fork runs its script as ``python script args`` would (``runpy``, ``__name__ == "__main__"``, its own
``sys.argv``, ``sys.path[0]``, environment, working directory, log file, fresh random seeds) and ends as the
interpreter ends a script (non-daemon threads joined, exit handlers run, streams flushed), less the modules'
teardown. Lightning's own launcher stays in the path: the script's ``Trainer(devices=N)`` still runs
``_SubprocessScriptLauncher``, which builds each child's command, environment and working directory as it
always does; only its ``subprocess.Popen`` is answered by a fork (``ForkedPopen``, through the job's Unix
socket) instead of a new interpreter. A command that is not ``python script.py ...`` or ``python -m module
...`` goes to the real ``Popen``.

What a fork does not reproduce: per-process hash randomisation (every rank shares the server's
``PYTHONHASHSEED``); environment variables read at import time by the preloaded modules (imported once, with
the session's environment; Lightning's ``rank_zero_only.rank`` is re-read per rank, and the environment changes
the imports made, such as Lightning's ``PYTORCH_NVML_BASED_CUDA_CHECK``, are applied to each rank's environment
as a fresh import would); and the ``__del__`` of objects still alive at exit. ``L3D_TEST_SPAWN=1`` starts every
rank as a fresh interpreter instead (``tests/launch.py``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {}  # socket path, status folder and the environment delta, inherited by every fork


# --------------------------------------------------------------------------------------------- the forks' side
def _send(sock: socket.socket, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> dict[str, Any]:
    head = _recv_exact(sock, 4)
    (size,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = b""
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("zygote closed the connection")
        chunks += chunk
    return chunks


def _forkable(args: Any) -> bool:
    """``python script.py ...`` or ``python -m module ...`` with this interpreter, nothing else."""
    if not isinstance(args, (list, tuple)) or len(args) < 2 or not all(isinstance(a, str) for a in args):
        return False
    if os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return False
    if args[1] == "-m":
        return len(args) >= 3
    return args[1].endswith(".py") and os.path.isfile(args[1])


class ForkedPopen:
    """The part of ``subprocess.Popen`` that Lightning's launcher and its child-process observer use.

    ``log``: a file the process's stdout and stderr go to (else it inherits the job's). Inside a job, scripts that
    start processes of their own reach this class through the module ``l3d_test_zygote`` in ``sys.modules``
    (registered in the zygote, so present only in its forks)."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None, log: str | None = None
    ) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(_STATE["socket"])
            env = dict(os.environ if env is None else env)
            _send(sock, {"argv": self.args, "env": env, "cwd": cwd, "log": log})
            self.pid: int = _recv(sock)["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            status = Path(_STATE["status"]) / str(self.pid)
            if status.exists():
                self.returncode = int(status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _SubprocessShim:
    """Stands for the ``subprocess`` module inside Lightning's launchers: forks where it can."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(args: Any, *rest: Any, env: dict[str, str] | None = None, cwd: str | None = None, **kwargs: Any) -> Any:
        if rest or kwargs or not _forkable(args):
            return subprocess.Popen(args, *rest, env=env, cwd=cwd, **kwargs)
        return ForkedPopen(args, env=env, cwd=cwd)


def _install_launcher_shim() -> None:
    for name in (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "lightning.fabric.strategies.launchers.subprocess_script",
    ):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "subprocess", None) is subprocess:
            module.subprocess = _SubprocessShim()  # type: ignore[attr-defined]


def _become(argv: list[str], env: dict[str, str], cwd: str | None, log: str | None) -> int:
    """In a fresh fork: set the process up as ``argv`` would find it, run it, return its exit code."""
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    for key, value in _STATE["env_delta"].items():  # what the preloaded imports did to the environment
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if cwd:
        os.chdir(cwd)
    # Fresh interpreters draw their seeds from the OS; the forks would otherwise share the zygote's.
    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:  # read from the environment when Lightning is imported
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[1])
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # an uncaught exception: print it and exit 1, as the interpreter does
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


# ------------------------------------------------------------------------------------------- the zygote's side
def _fork(argv: list[str], env: dict[str, str], cwd: str | None, log: str | None, closing: list[Any]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for item in closing:
            item.close()
        _exit(_become(argv, env, cwd, log))  # never returns into the zygote's loop
    return pid


def _exit(code: int) -> None:
    """End a fork as the interpreter ends a script, less the teardown of its thousands of modules (1.5 s of CPU
    with torch and Lightning loaded, per process): wait for non-daemon threads, run the exit handlers (logging's
    flush among them), flush the standard streams, exit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first at exit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _write_status(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name)
    tmp.write_text(text)
    tmp.rename(path)


def run_job(spec: dict[str, Any]) -> None:
    """In a fork of the server, in the job's own session: fork the job's processes, serve its launchers'
    requests for more, reap them all, and write their exit codes to ``<work>/result.json``."""
    work = Path(spec["work"])
    status_dir = work / "status"
    status_dir.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(work / "job.sock"))
    listener.listen(64)
    _STATE.update(socket=str(work / "job.sock"), status=str(status_dir))

    first = [_fork(p["argv"], p["env"], p.get("cwd"), p.get("log"), [listener]) for p in spec["procs"]]
    live = set(first)
    codes: dict[int, int] = {}
    # As when each process was started fresh: the job ends with its first processes (for a Lightning job, the
    # one that launched the others); whatever of the rest is still running then is killed with the session.
    while any(pid in live for pid in first):
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            request = _recv(conn)
            pid = _fork(request["argv"], request["env"], request["cwd"], request.get("log"), [listener, conn])
            live.add(pid)
            _send(conn, {"pid": pid})
            conn.close()
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                live.clear()
                break
            if pid == 0:
                break
            codes[pid] = _exit_code(status)
            live.discard(pid)
            _write_status(status_dir / str(pid), str(codes[pid]))
    listener.close()
    for pid in live:
        os.kill(pid, signal.SIGKILL)
    for pid in live:
        os.waitpid(pid, 0)
    _write_status(work / "result.json", json.dumps({"codes": [codes.get(pid, 1) for pid in first]}))


def _start_job(spec: dict[str, Any], closing: list[Any]) -> int:
    """Fork the process that runs one job (``run_job``), in a session of its own (killed whole on timeout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    job_pid = os.getpid()
    try:
        for item in closing:
            item.close()
        os.setsid()
        fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        run_job(spec)
        code = 0
    except BaseException:
        if os.getpid() != job_pid:
            raise  # never: a rank ends in _exit
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the server's own exit handlers are not this process's to run


def serve(socket_path: str, lifeline: int) -> int:
    """Import the heavy modules once, then fork a job process per request until ``lifeline`` (a pipe whose
    write end the test session holds) is closed."""
    before = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # the forks import it again and fail there, in their own logs
            traceback.print_exc()
    _install_launcher_shim()
    sys.modules["l3d_test_zygote"] = sys.modules[__name__]  # what a job's own launchers import (ForkedPopen)
    after = dict(os.environ)
    delta: dict[str, str | None] = {k: v for k, v in after.items() if before.get(k) != v}
    delta.update({k: None for k in before if k not in after})
    _STATE["env_delta"] = delta
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # ready: the preloading is done
    exits = Path(socket_path).parent / "exits"  # a job process's exit code, once the server has reaped it
    exits.mkdir(exist_ok=True)
    jobs: dict[int, Path] = {}
    while True:
        ready, _, _ = select.select([listener, lifeline], [], [], 0.05)
        if lifeline in ready:
            break  # the test session has ended
        if listener in ready:
            conn, _ = listener.accept()
            spec = _recv(conn)
            pid = _start_job(spec, [listener, conn])
            jobs[pid] = Path(spec["work"])
            _send(conn, {"pid": pid})
            conn.close()
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if jobs.pop(pid, None) is not None:
                _write_status(exits / str(pid), str(_exit_code(status)))
    listener.close()
    return 0


PRELOAD = ("torch", "lightning.pytorch", "lightning_3d", "hydra", "omegaconf")
"""What the server imports before forking (Lightning brings torchmetrics and, when installed, transformers)."""


def request_job(socket_path: str, spec: dict[str, Any]) -> int:
    """Ask the server at ``socket_path`` to run a job; returns the pid (and session id) of its job process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        _send(sock, spec)
        return _recv(sock)["pid"]


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], int(sys.argv[2])))
