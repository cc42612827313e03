"""Every host synchronisation of whole training steps, Lightning's own included: ``python -m
benchmarks.b8_lightning_step plain|3d``.

B8's window ends at ``on_train_batch_end``; this probe counts with the same ``SyncCounter`` from one
``on_train_batch_start`` to the next (Lightning's logging bookkeeping after the batch and the loop's own per-step
work before it included), with stacks deep enough to reach Lightning's sources, for plain Lightning (``plain``) or
``ThreeDStrategy(tp=1, pp=1)`` (``3d``) on the tiny GPT in one process. Not registered with ``python -m
benchmarks``: the README's list of Lightning's synchronisations comes from it.
"""

from __future__ import annotations

import sys
from typing import Any


def count(which: str, steps: int = 6, skip: int = 2) -> dict[str, Any]:
    """The summary (``SyncCounter.summary``) of whole steps ``skip .. steps - 1`` (the last, cut by the end of
    training, is left out)."""
    import lightning as L

    from . import b8_sync
    from .common import fit_3d, model_config

    def deep(depth: int = 10) -> tuple[str, bool, bool]:
        frame, kept, in_optim = sys._getframe(2), [], False
        while frame is not None and len(kept) < depth:
            path = frame.f_code.co_filename.replace("\\", "/")
            in_optim = in_optim or "/torch/optim/" in path
            if "/torch/" not in path and "b8_" not in path and "/contextlib.py" not in path:
                kept.append(f"{'/'.join(path.split('/')[-3:])}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return " <- ".join(kept), False, in_optim

    counter = b8_sync.SyncCounter()

    class Window(L.Callback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            counter.end()
            counter.begin()

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            counter.end()

    real, b8_sync._stack_summary = b8_sync._stack_summary, deep  # type: ignore[assignment]
    try:
        with counter:
            if which == "plain":
                b8_sync._fit_plain(model_config(tiny=True), Window(), steps)
            else:
                fit_3d(model_config(tiny=True), Window(), tp=1, pp=1, micro_batches=1, batch=8, steps=steps, devices=1)
    finally:
        b8_sync._stack_summary = real  # type: ignore[assignment]
    counter.steps = counter.steps[:-1]
    return counter.summary(skip=skip)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "plain"
    result = count(which)
    print(f"{which}: {result['per_step']} per whole step (+{result['optimizer_per_step']} torch.optim step counters)")
    for source, n in result["sources"].items():
        print(f"  {n} x {source}")
