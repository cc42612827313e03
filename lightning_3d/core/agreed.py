"""Errors that every rank raises alike, at the same point, by design.

A configuration mismatch, a checkpoint of another model, a non-finite loss under ``on_nonfinite="raise"``,
data-parallel divergence: each rank detects the problem itself and raises the same error. Such an error is
*agreed*; it is not one rank failing alone, so the fail-fast watch (``lightning_3d.tools.failure_watch``) must
not stop the other ranks for it (they may still be inside the collective that lets them raise it too).
"""

from __future__ import annotations

from typing import TypeVar

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
