"""Fail fast: when one rank fails, every rank of the job stops within about a second.

Without help, a distributed job whose rank fails can hang: the other ranks wait in a collective or a
pipeline receive until the process-group timeout, and a rank that is not communicating at that moment
(busy, or stuck itself) never notices. Lightning's launcher polls its child processes every 5 s, but only
from rank 0's process, and nobody watches when rank 0 itself fails or when an external launcher started
the processes.

``FailureWatch`` runs one daemon thread per rank that polls the job's rendezvous store (the TCPStore every
rank already has):

* A rank whose trainer call raises (Lightning calls ``Strategy.on_exception``) prints its traceback, each
  line prefixed with its rank and mesh coordinates, and posts a failure record to the store (the first
  record wins, so it names the root cause, not the ranks that failed after it).
* Every watcher that sees a record posted by another rank prints why it stops and where its main thread
  is (a one-rank "py-spy dump"), and ends its process with exit code 1. On rank 0 under Lightning's
  launcher it first lets the child ranks stop the same way, then SIGKILLs any that are left.
* Peers on the same host are also watched by process id: a rank that vanishes without a report (SIGKILL,
  OOM killer, segfault) is posted as failed by whichever watcher notices first.
* If the store stops answering (it lives in rank 0's process), the watcher stops its rank too.

Errors that every rank raises together at the same point (``is_agreed``: a non-finite loss under
``on_nonfinite="raise"``, a configuration mismatch, data-parallel divergence) post no record: each rank
raises the same error by itself, and no rank is stopped before it can print it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..core import torch_compat
from ..core.agreed import is_agreed

ABORT_EXIT_CODE = 1


def _chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    return chain


def summarize(exc: BaseException) -> str:
    """``Type: first line`` of the root cause (torch's pipeline re-raises stage errors with a multi-line message)."""
    root = _chain(exc)[-1]
    first = next((line.strip() for line in str(root).splitlines() if line.strip()), "")
    return f"{type(root).__name__}: {first}"[:500]


def is_communication_error(exc: BaseException) -> bool:
    """A failure of a collective or point-to-point operation: most often the consequence of a peer's failure."""
    needles = ("Connection closed by peer", "Timed out waiting", "Connection reset", "gloo", "NCCL", "watchdog")
    for e in _chain(exc):
        if isinstance(e, getattr(dist, "DistError", ())):
            return True
        if isinstance(e, RuntimeError) and any(n in str(e) for n in needles):
            return True
    return False


_VANISHED = "ended without reporting an error (killed by a signal such as SIGKILL or the OOM killer, or crashed)"
_HAS_PROC = os.path.exists("/proc/self/stat")


def _proc_start_time(pid: int) -> str | None:
    """Start time of a live (non-zombie) process, ``None`` if it is gone; ``""`` when /proc cannot tell."""
    if not _HAS_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except OSError:
            pass
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return None if fields[0] in ("Z", "X") else fields[19]


def _is_alive(pid: int, started: str) -> bool:
    now = _proc_start_time(pid)
    return now is not None and (not started or not now or now == started)


def _main_thread_frames() -> list[traceback.FrameSummary]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return list(traceback.extract_stack(frame)) if frame is not None else []


def _main_thread_stack(limit: int = 12) -> str:
    frames = _main_thread_frames()
    return "".join(traceback.format_list(frames[-limit:])).rstrip() if frames else "  (main thread not found)"


def _position(frames: list[traceback.FrameSummary]) -> dict[str, Any]:
    """Where the main thread is: its innermost frame, and whether it is waiting on communication."""
    if not frames:
        return {"at": "?", "comm": False}
    last = frames[-1]
    comm = f"{os.sep}distributed{os.sep}" in last.filename or last.name == "_wait_p2p"
    return {"at": f"{last.filename}:{last.lineno} in {last.name}: {last.line or ''}".strip(), "comm": comm}


def _install_prompt_exit(timeout: float = 10.0) -> None:
    """After a failure: once the uncaught exception's traceback is printed, run the ``atexit`` handlers (for at
    most ``timeout`` seconds) and end the process with exit code 1, skipping the interpreter's finalisation
    (destroying a process group whose peers are gone can take seconds). A caught exception changes nothing."""
    previous = sys.excepthook
    if getattr(previous, "_lightning_3d", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(kind, value, tb)
        finally:
            runner = threading.Thread(target=atexit._run_exitfuncs, daemon=True)
            runner.start()
            runner.join(timeout)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ABORT_EXIT_CODE)

    hook._lightning_3d = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class _GuardedStore:
    """A store client that, once one operation has failed (the store's host is gone), fails every further
    operation at once instead of reconnecting and logging a C++ stack trace each time."""

    def __init__(self, store: Any, dead: list[bool]) -> None:
        self._store, self._dead = store, dead

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if self._dead[0]:
                raise ConnectionError("the rendezvous store no longer answers")
            try:
                return method(*args)
            except Exception:
                self._dead[0] = True
                raise

        return call


class FailureWatch:
    """Per-rank watcher thread that ends this rank as soon as another rank of the job has failed.

    Args:
        rank: global rank of this process.
        world_size: number of ranks.
        describe: ``describe(rank)`` returns the rank's mesh coordinates as text, for messages.
        children: returns the child processes this process launched (Lightning's launcher on rank 0).
        interval: seconds between polls of the store.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        describe: Callable[[int], str],
        children: Callable[[], list[subprocess.Popen]],
        interval: float = 0.5,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.describe, self.children = describe, children
        self.interval = interval
        self._store: Any = None
        self._thread_store: Any = None
        self._prefix = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, tuple[int, str]] = {}  # same-host ranks: pid, start time
        self._peers_loaded = False
        self._dead = [False]  # shared by both store clients: the store no longer answers

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Register this process in the store and start the thread (every rank calls this the same number of times)."""
        self.stop()
        base = torch_compat.default_store()
        # Which trainer call on this store this is: counted per rank in the store itself, so a process that
        # took part in an earlier job (another store) does not disagree with freshly started ranks.
        generation = base.add(f"lightning_3d/starts/{self.rank}", 1)
        self._prefix = f"lightning_3d/watch{generation}"
        self._dead = dead = [False]
        self._store, self._thread_store = _GuardedStore(base.clone(), dead), _GuardedStore(base.clone(), dead)
        for store in (self._store, self._thread_store):
            store.set_timeout(timedelta(seconds=30))
        start_time = _proc_start_time(os.getpid()) or ""
        self._store.set(self._key(f"proc/{self.rank}"), f"{socket.gethostname()} {os.getpid()} {start_time}")
        keys = [self._key(f"proc/{r}") for r in range(self.world_size)]
        self._store.wait(keys)  # every rank has registered (they all call start() at the same point)
        self._peers, self._peers_loaded = {}, False
        self._load_peers(self._store)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_3d-failure-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (at the end of a successful trainer call, before the final barrier)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self._thread = None

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    # ------------------------------------------------------------------ reporting (main thread)
    def report(self, exc: BaseException, where: str) -> None:
        """Print this rank's failure and tell the other ranks (``Strategy.on_exception``).

        The root cause gets its full traceback. A communication error is usually a consequence: of a rank
        that has already reported its failure, or of a peer on this host that vanished without a report
        (SIGKILL, OOM killer, segfault), which is then named as the failing rank.
        """
        agreed = is_agreed(exc)
        head = f"lightning_3d: rank {self.rank} ({self.describe(self.rank)}) failed {where}"
        comm = not agreed and is_communication_error(exc)
        earlier = self._record() if comm else None
        dead = self._wait_for_dead_peer() if comm and earlier is None else []
        record: dict[str, Any] | None = None
        if agreed and self.rank == 0:
            self._print(f"{head} with the error every rank raised: {type(exc).__name__}: {exc}")
        elif agreed:  # the same error as rank 0's: one line here, the whole message there
            self._print(f"{head} with the error every rank raised (in full on rank 0): {summarize(exc)}")
        elif earlier is not None and earlier.get("rank") != self.rank:
            self._print(f"{head}: {summarize(exc)}\n(a consequence: {self._who(earlier)} had failed first)")
        elif dead:
            names = ", ".join(text for _, text in dead)
            self._print(f"{head}: {summarize(exc)}\n(a consequence: {names} {_VANISHED})")
            record = {"rank": dead[0][0], "where": "", "what": _VANISHED}
        else:
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            self._print(f"{head}:\n{trace}")
            what = summarize(exc)
            if comm and "timed out" in what.lower():
                what = f"it timed out waiting for its peers ({what}): some rank is stuck or far behind"
            record = {"rank": self.rank, "where": where, "what": what}
        _install_prompt_exit()
        if self._store is None:
            return
        try:
            self._store.set(self._key(f"exiting/{self.rank}"), "1")
        except Exception:
            pass
        first = False  # whether this rank's record is the one that stands (the job's first failure)
        if agreed:
            self.stop()  # every rank stops by itself; nobody needs to be told
        elif record is not None:
            first = self._post(record).get("rank") == record["rank"] == self.rank
            if comm and not dead and "timed out" in str(_chain(exc)[-1]).lower():
                self._name_stuck_ranks()
        self.reap_children()
        if not agreed:
            self.linger(self._store, first=first)

    def _record(self) -> dict[str, Any] | None:
        try:
            if self._store is not None and self._store.check([self._key("failed")]):
                return json.loads(self._store.get(self._key("failed")))
        except Exception:
            pass
        return None

    def _who(self, record: dict[str, Any]) -> str:
        rank = record.get("rank", "?")
        return f"rank {rank} ({self.describe(rank)})" if isinstance(rank, int) else f"rank {rank}"

    def _post(self, record: dict[str, Any]) -> dict[str, Any]:
        """Post a failure record unless one exists; returns the record that stands."""
        store = self._store if threading.current_thread() is threading.main_thread() else self._thread_store
        try:
            got = store.compare_set(self._key("failed"), "", json.dumps(record))
            return json.loads(got)
        except Exception:
            return record

    def reap_children(self, grace: float | None = None) -> None:
        """On rank 0 under Lightning's launcher: give the child ranks ``grace`` seconds to stop, then SIGKILL them."""
        procs = [p for p in self.children() if p.poll() is None]
        if not procs:
            return
        deadline = time.monotonic() + (grace if grace is not None else max(5.0, 6 * self.interval))
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                self._print(f"lightning_3d: killing child process {p.pid} (still running after the job failed)")
                p.send_signal(signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _wait_for_dead_peer(self, seconds: float = 1.0) -> list[tuple[int, str]]:
        """A peer's sockets close a moment before its process is seen to be gone: look again for up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            dead = self.dead_peers()
            if dead or time.monotonic() > deadline or self._record() is not None:
                return dead
            time.sleep(0.05)

    def dead_peers(self) -> list[tuple[int, str]]:
        """Ranks on this host whose process is gone without having reported an exception: ``(rank, description)``.

        Once rank 0's process (the store's host) is gone, whether the others had reported cannot be read any
        more: rank 0 is then named alone.
        """
        try:
            self._load_peers(self._store)
        except Exception:
            pass
        dead = [
            (rank, f"rank {rank} ({self.describe(rank)}, pid {pid})")
            for rank, (pid, started) in sorted(self._peers.items())
            if not _is_alive(pid, started) and not self._check(self._store, f"exiting/{rank}")
        ]
        if self._dead[0]:
            if not dead or dead[0][0] == 0:
                return [(0, f"rank 0 ({self.describe(0)}, which hosted the rendezvous store)")]
        return dead

    def _print(self, text: str) -> None:
        prefix = f"[rank {self.rank}] "
        sys.stderr.write("".join(prefix + line + "\n" for line in text.splitlines()))
        sys.stderr.flush()

    # ------------------------------------------------------------------ the thread
    def _check(self, store: Any, name: str) -> bool:
        try:
            return bool(store.check([self._key(name)]))
        except Exception:
            return False

    def _load_peers(self, store: Any) -> None:
        """Learn the process ids of same-host ranks once all have registered (pids in another namespace are skipped)."""
        if self._peers_loaded or store is None:
            return
        keys = [self._key(f"proc/{r}") for r in range(self.world_size)]
        if not store.check(keys):
            return
        host, peers = socket.gethostname(), {}
        for rank, raw in enumerate(store.multi_get(keys)):
            name, pid, started = [*raw.decode().split(" "), ""][:3]
            if rank != self.rank and name == host and _is_alive(int(pid), started):
                peers[rank] = (int(pid), started)
        self._peers, self._peers_loaded = peers, True

    def _run(self) -> None:
        store, errors = self._thread_store, 0
        while not self._stop.wait(self.interval):
            try:
                if store.check([self._key("failed")]):
                    record = json.loads(store.get(self._key("failed")))
                    if record.get("rank") != self.rank:
                        self._abort(record)
                    return
                self._load_peers(store)
                for rank, (pid, started) in list(self._peers.items()):
                    if not _is_alive(pid, started) and not self._check(store, f"exiting/{rank}"):
                        self._abort(self._post({"rank": rank, "where": "", "what": f"(pid {pid}) {_VANISHED}"}))
                        return
                errors = 0
            except Exception as err:
                errors += 1
                if errors >= 2 and not self._stop.is_set():
                    self._abort(
                        {
                            "rank": 0,
                            "where": "",
                            "what": f"the job's rendezvous store (hosted by rank 0's process) stopped answering "
                            f"({type(err).__name__}: {str(err)[:200]}); rank 0 has probably died",
                        }
                    )
                    return

    def _abort(self, record: dict[str, Any]) -> None:
        if self._stop.is_set():
            return
        who = self._who(record)
        where = f" {record['where']}" if record.get("where") else ""
        self._print(
            f"lightning_3d: stopping rank {self.rank} ({self.describe(self.rank)}) because {who} failed{where}: "
            f"{record.get('what', '')}\nThe first failure's traceback is in that rank's output. This rank's main "
            f"thread was at:\n{_main_thread_stack()}"
        )
        try:
            self._thread_store.set(self._key(f"state/{self.rank}"), json.dumps(_position(_main_thread_frames())))
            self._thread_store.set(self._key(f"exiting/{self.rank}"), "aborted")
        except Exception:
            pass
        self.reap_children(grace=4 * self.interval + 1)
        self.linger(self._thread_store)
        sys.stdout.flush()
        os._exit(ABORT_EXIT_CODE)

    def linger(self, store: Any, first: bool = False) -> None:
        """Before exiting, wait (a few polls at most) until every other rank has seen the failure record or is
        gone: on rank 0, whose process hosts the rendezvous store, so that nobody loses the store first and blames
        rank 0; and on the rank that failed first (``first``), because under Lightning's launcher rank 0's process
        SIGKILLs every child as soon as one has exited with an error, which would cut the others off before they
        say why they stop."""
        if (self.rank != 0 and not first) or store is None:
            return
        deadline = time.monotonic() + 4 * self.interval + 1
        pending = {r for r in range(self.world_size) if r != self.rank}
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                peer = self._peers.get(rank)
                if self._check(store, f"exiting/{rank}") or (peer is not None and not _is_alive(*peer)):
                    pending.discard(rank)
            time.sleep(0.02)

    def _name_stuck_ranks(self) -> None:
        """After a timeout: collect where the other ranks' main threads were as they stopped, and name those
        that were not waiting on communication (the likely stuck ones)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + 4 * self.interval + 1
        states: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(states) < len(others):
            for rank in others:
                if rank not in states and self._check(self._store, f"state/{rank}"):
                    states[rank] = json.loads(self._store.get(self._key(f"state/{rank}")))
            time.sleep(0.05)
        busy = [f"rank {r} ({self.describe(r)}) at {s['at']}" for r, s in sorted(states.items()) if not s["comm"]]
        silent = [str(r) for r in others if r not in states]
        lines = []
        if busy:
            lines.append("ranks that were NOT waiting on communication (likely stuck or far behind):")
            lines += [f"  {text}" for text in busy]
        if silent:
            lines.append(f"ranks that did not answer: {', '.join(silent)} (stuck without releasing the GIL, or dead)")
        if lines:
            self._print("\n".join(lines))
