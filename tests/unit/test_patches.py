"""Patches: each install undoes the one before under its name; teardown undoes them all, newest first."""

from __future__ import annotations

import pytest

from lightning_3d.core.patches import Patches


def _patch(log: list[str], name: str) -> object:
    log.append(f"+{name}")
    return lambda: log.append(f"-{name}")


def test_install_undoes_the_patch_under_the_same_name_before_patching_again() -> None:
    log: list[str] = []
    patches = Patches()
    patches.install("a", _patch, log, "a1")
    patches.install("b", _patch, log, "b1")
    patches.install("a", _patch, log, "a2")  # a second fit: the old patch is lifted before the new one goes on
    assert log == ["+a1", "+b1", "-a1", "+a2"]
    assert patches.names() == ["b", "a"] and "a" in patches


def test_a_patch_that_changed_nothing_is_not_held() -> None:
    patches = Patches()
    patches.install("a", lambda: None)
    assert "a" not in patches
    patches.lift("a")  # lifting what is not there does nothing


def test_lift_all_undoes_newest_first_once() -> None:
    log: list[str] = []
    patches = Patches()
    for name in ("a", "b", "c"):
        patches.install(name, _patch, log, name)
    patches.lift_all()
    patches.lift_all()
    assert log == ["+a", "+b", "+c", "-c", "-b", "-a"] and patches.names() == []


def test_a_failing_undo_does_not_stop_the_others() -> None:
    log: list[str] = []
    patches = Patches()
    patches.install("a", _patch, log, "a")

    def broken() -> object:
        def undo() -> None:
            raise RuntimeError("undo failed")

        return undo

    patches.install("b", broken)
    patches.install("c", _patch, log, "c")
    with pytest.raises(RuntimeError, match="undo failed"):
        patches.lift_all()
    assert log == ["+a", "+c", "-c", "-a"] and patches.names() == []


def test_lift_all_keeps_what_it_is_told_to_keep() -> None:
    log: list[str] = []
    patches = Patches()
    for name in ("a", "b"):
        patches.install(name, _patch, log, name)
    patches.lift_all(keep=("a",))
    assert log == ["+a", "+b", "-b"] and patches.names() == ["a"]
