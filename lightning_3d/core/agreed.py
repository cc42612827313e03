"""Errors that every rank raises alike, at the same point, by design.

A configuration mismatch, a checkpoint of another model, a non-finite loss under ``on_nonfinite="raise"``,
data-parallel divergence: each rank detects the problem itself and raises the same error. Such an error is
*agreed*; it is not one rank failing alone, so the fail-fast watch (``lightning_3d.tools.failure_watch``) must
not stop the other ranks for it (they may still be inside the collective that lets them raise it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_AGREED_ATTR = "_lightning_3d_agreed"
E = TypeVar("E", bound=BaseException)


def mark_agreed(exc: E) -> E:
    """Mark an exception as raised by every rank at the same point (no fail-fast record is posted)."""
    setattr(exc, _AGREED_ATTR, True)
    return exc


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` (or the exception it was raised ``from``) was raised by every rank together."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            return False
        if getattr(seen, _AGREED_ATTR, False):
            return True
        seen = seen.__cause__
    return False


T = TypeVar("T")


def on_rank0_told(is_rank0: bool, broadcast: Callable[[Any], Any], write: Callable[[], T], what: str) -> T | None:
    """Run ``write`` on rank 0 only, then tell every rank whether it failed (collective: ``broadcast`` sends rank 0's
    object to all), so no rank waits at a later collective for a rank 0 that died: rank 0 raises its own error, the
    others a ``RuntimeError`` quoting it (``what``: what rank 0 failed to do, for that message).

    Returns:
        ``write()``'s result on rank 0, ``None`` elsewhere.
    """
    failure: Exception | None = None
    out: T | None = None
    if is_rank0:
        try:
            out = write()
        except Exception as exc:  # told to the other ranks before it is raised
            failure = exc
    message = broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"lightning_3d: rank 0 failed to {what}: {message}")
    return out
