"""Lightning's ``BasePredictionWriter`` writes each data-parallel replica's predictions once.

Under DDP each rank is a replica: a writer that names its file by ``trainer.global_rank`` (Lightning's documented
example) writes each prediction once across the files. Under tensor and pipeline parallelism a replica spans
``tp * pp`` ranks, and every one of them holds the replica's predictions (``predict_step``'s outputs are returned on
every stage), so such a writer wrote each prediction ``tp * pp`` times, in as many files. :func:`write_once_per_replica`
lets one rank of each replica write (its first pipeline rank and first tensor-parallel rank: global rank 0 for
replica 0) and turns the writers' ``write_on_batch_end`` / ``write_on_epoch_end`` into no-ops on the others, for
the duration of a run. The files are then named by the writing ranks' global ranks, one per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter

from .patches import Undo

_WRITE_METHODS = ("write_on_batch_end", "write_on_epoch_end")


def _skip(*args: Any, **kwargs: Any) -> None:
    """A writer's write method on a rank that does not write: another rank of the replica writes the same
    predictions."""


def write_once_per_replica(callbacks: Sequence[Any], writes: bool) -> Undo | None:
    """Silence the ``BasePredictionWriter`` callbacks' write methods unless this rank ``writes`` for its replica.

    Returns:
        The undo (``None``: nothing changed: this rank writes, or there is no writer).
    """
    writers = [c for c in callbacks if isinstance(c, BasePredictionWriter)]
    if writes or not writers:
        return None
    saved = [(w, name, w.__dict__[name]) for w in writers for name in _WRITE_METHODS if name in w.__dict__]
    for writer in writers:
        for name in _WRITE_METHODS:
            setattr(writer, name, _skip)

    def undo() -> None:
        for writer in writers:
            for name in _WRITE_METHODS:
                writer.__dict__.pop(name, None)
        for writer, name, value in saved:
            setattr(writer, name, value)

    return undo
