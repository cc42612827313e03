"""What the strategy changes on Lightning's and the user's objects for one fit, each change with its undo.

Several pieces of the strategy patch objects they do not own while a fit runs (a callback's method, a module's
hook, torch.compile's settings, a Hugging Face model's ``save_pretrained``), and each returns the function that
puts things back. ``Patches`` keeps those functions by name: installing a patch under a name first undoes the one
there (a later ``trainer.validate`` or a second ``fit`` of the same Trainer sets them again), and teardown undoes
them all, newest first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

Undo = Callable[[], None]


class Patches:
    """The undo functions of the patches in place, by name, in the order they were put."""

    def __init__(self) -> None:
        self._undo: dict[str, Undo] = {}

    def install(self, name: str, patch: Callable[..., Undo | None], *args: Any) -> None:
        """Undo the patch held under ``name`` (if any), then run ``patch(*args)`` and hold the undo it returns
        (``None``: it changed nothing)."""
        self.lift(name)
        undo = patch(*args)
        if undo is not None:
            self._undo[name] = undo

    def lift(self, name: str) -> None:
        """Undo the patch held under ``name`` now (nothing when there is none)."""
        undo = self._undo.pop(name, None)
        if undo is not None:
            undo()

    def lift_all(self, keep: Collection[str] = ()) -> None:
        """Undo every patch but those named in ``keep``, the newest first. Each is forgotten before its undo runs, so
        a failing undo is not retried and the older ones still run; the first error is raised after all of them
        ran."""
        error: BaseException | None = None
        for name in reversed([n for n in self._undo if n not in keep]):
            try:
                self.lift(name)
            except Exception as exc:  # the others must still be undone
                error = error or exc
        if error is not None:
            raise error

    def __contains__(self, name: str) -> bool:
        return name in self._undo

    def names(self) -> list[str]:
        """The names of the patches in place, oldest first."""
        return list(self._undo)
