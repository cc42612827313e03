"""``core/prediction_writer.py``: one rank per replica runs the ``BasePredictionWriter`` callbacks' writes."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter, Callback

from lightning_3d.core.prediction_writer import write_once_per_replica


class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.calls: list[str] = []

    def write_on_batch_end(self, *args: Any) -> None:
        self.calls.append("batch")

    def write_on_epoch_end(self, *args: Any) -> None:
        self.calls.append("epoch")


def test_only_the_writing_rank_writes_and_the_undo_restores() -> None:
    writer, other = Writer(), Callback()
    assert write_once_per_replica([writer, other], writes=True) is None  # the writing rank: nothing changed
    undo = write_once_per_replica([other, writer], writes=False)
    assert undo is not None
    writer.write_on_batch_end(None, None, None, None, None, 0, 0)
    writer.write_on_epoch_end(None, None, [], [])
    assert writer.calls == []  # silenced
    undo()
    writer.write_on_batch_end(None, None, None, None, None, 0, 0)
    writer.write_on_epoch_end(None, None, [], [])
    assert writer.calls == ["batch", "epoch"]
    assert "write_on_batch_end" not in writer.__dict__  # the class's methods again


def test_a_method_set_on_the_instance_comes_back() -> None:
    writer = Writer()
    writer.write_on_epoch_end = lambda *args: writer.calls.append("own")  # type: ignore[method-assign]
    undo = write_once_per_replica([writer], writes=False)
    assert undo is not None
    writer.write_on_epoch_end(None, None, [], [])
    undo()
    writer.write_on_epoch_end(None, None, [], [])
    assert writer.calls == ["own"]
    assert write_once_per_replica([Callback()], writes=False) is None  # no writer: nothing to undo
