"""B2's fixed cost at tp1 pp1, in one process: ``python -m benchmarks.b2_fixed_tp1 [raise|skip|off] [--clip]``.

The strategy's CPU time around the schedule per step (thread CPU time of ``training_step`` + ``backward`` less the
pipeline runtime's ``run``; the median over 32 steps after 8 of warm-up) for the benchmark GPT (7.4M parameters,
batch 8, one micro-batch) with ``ThreeDStrategy(tp=1, pp=1)``. Thread CPU time barely moves with the load of other
processes, so this is the figure to compare before / after a change on a shared machine (B2 itself needs two
processes and its wall clock follows the load). Not registered with ``python -m benchmarks``: a developer's probe.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def fixed_cost(on_nonfinite: str = "raise", clip: bool = False, steps: int = 40, warmup: int = 8) -> list[float]:
    """The per-step fixed CPU cost in ms, one value per step after ``warmup``."""
    import lightning as L
    import torch

    from lightning_3d import ThreeDStrategy
    from lightning_3d.core import pipeline

    from .common import fit_3d, model_config

    torch.set_num_threads(1)
    acc = {"step": 0.0, "backward": 0.0, "schedule": 0.0}
    originals: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)
        originals.append((owner, name, real))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                acc[key] += time.thread_time() - start

        setattr(owner, name, wrapper)

    timed(ThreeDStrategy, "training_step", "step")
    timed(ThreeDStrategy, "backward", "backward")
    timed(pipeline.PipelineRuntime, "run", "schedule")
    fixed: list[float] = []

    class Window(L.Callback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            for key in acc:
                acc[key] = 0.0

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            fixed.append((acc["step"] + acc["backward"] - acc["schedule"]) * 1e3)

    try:
        fit_3d(
            model_config(False),
            Window(),
            tp=1,
            pp=1,
            micro_batches=1,
            batch=8,
            steps=steps,
            devices=1,
            on_nonfinite=on_nonfinite,
            trainer_kwargs={"gradient_clip_val": 1.0} if clip else None,
        )
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)
    return fixed[warmup:]


if __name__ == "__main__":
    mode = next((a for a in sys.argv[1:] if not a.startswith("--")), "raise")
    values = sorted(fixed_cost(mode, clip="--clip" in sys.argv))
    n = len(values)
    print(
        f"tp1 pp1 fixed CPU cost per step (on_nonfinite={mode!r}{', clipping' if '--clip' in sys.argv else ''}): "
        f"median {values[n // 2]:.2f} ms (p25 {values[n // 4]:.2f}, p75 {values[3 * n // 4]:.2f})"
    )
