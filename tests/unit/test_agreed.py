"""Agreed errors: marked on the exception itself and recognised through ``raise ... from``."""

from __future__ import annotations

import pytest

from lightning_3d.core.agreed import is_agreed, mark_agreed, on_rank0_told


def test_mark_returns_the_same_exception_marked() -> None:
    error = ValueError("config differs")
    assert not is_agreed(error)
    assert mark_agreed(error) is error
    assert is_agreed(error)
    assert not is_agreed(ValueError("config differs"))  # a fresh exception of the same type is not marked


def test_raise_from_an_agreed_error_is_agreed() -> None:
    with pytest.raises(RuntimeError) as info:
        try:
            raise mark_agreed(FloatingPointError("nan loss"))
        except FloatingPointError as agreed:
            raise RuntimeError("stage 3 failed") from agreed
    assert is_agreed(info.value)


def test_agreed_cause_deep_in_the_chain() -> None:
    root = mark_agreed(KeyError("missing"))
    top: BaseException = root
    for i in range(5):
        wrapper = RuntimeError(f"wrap {i}")
        wrapper.__cause__ = top
        top = wrapper
    assert is_agreed(top)


def test_an_error_raised_while_handling_an_agreed_one_is_not_agreed() -> None:
    """Only ``raise ... from`` (``__cause__``) carries the mark; implicit context does not."""
    with pytest.raises(RuntimeError) as info:
        try:
            raise mark_agreed(ValueError("agreed"))
        except ValueError:
            raise RuntimeError("a new, independent failure")  # noqa: B904
    assert info.value.__context__ is not None
    assert not is_agreed(info.value)


def test_a_chain_without_a_mark_is_not_agreed() -> None:
    plain = RuntimeError("outer")
    plain.__cause__ = ValueError("inner, not marked")
    assert not is_agreed(plain)


def test_base_exceptions_can_be_marked() -> None:
    assert is_agreed(mark_agreed(KeyboardInterrupt()))


def test_rank0_writes_and_every_rank_hears_of_its_failure() -> None:
    """A one-object broadcast stands for rank 0's: rank 0 runs the write and raises its own error; another rank
    runs nothing and raises one that quotes it; without a failure rank 0 gets the result and the others None."""
    sent: list[object] = []

    def from_rank0(obj: object) -> object:  # rank 0's object as every rank receives it
        return sent[0] if sent else obj

    assert on_rank0_told(True, from_rank0, lambda: 7, "write x") == 7
    assert on_rank0_told(False, from_rank0, lambda: pytest.fail("runs on rank 0 only"), "write x") is None

    def broken() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        on_rank0_told(True, lambda obj: sent.append(obj) or obj, broken, "write x")
    with pytest.raises(RuntimeError, match="lightning_3d: rank 0 failed to write x: OSError: disk full"):
        on_rank0_told(False, from_rank0, lambda: None, "write x")
