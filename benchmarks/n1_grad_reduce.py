"""N1 numerics of gradient compression: the example GPT's loss curve with bf16 / fp16 gradient reduction against
fp32 reduction (``ThreeDStrategy(grad_reduce_dtype=...)``).

The main job's model (GPT preset ``small``: 4 layers, hidden 128, sequence 64, byte vocabulary 256; AdamW, lr 1e-3,
20 warm-up steps, cosine decay) trained for ``STEPS`` steps at dp2 x pp2 (4 processes, 1F1B with 4 micro-batches,
so each rank sums 4 micro-batches' gradients before the reduction; ``data_parallel="replicate"``,
``--data-parallel fsdp`` for FSDP) on the first bytes of the Python standard library's sources (the main job's
default corpus), 16 sequences per replica, in order (no shuffling), three times: ``grad_reduce_dtype=None``
(fp32, the reference), ``"bf16"`` and ``"fp16"``. Everything else is identical and deterministic, so the loss
differences come from the reduction's dtype alone. Reported per dtype: the largest and the final absolute and
relative difference of the per-step training loss (the dp-mean, as logged) from the fp32 run's.

Not in ``all`` (three 100-step trainings: minutes on 2 shared cores); run by id: ``python -m benchmarks N1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import Record

ID, TITLE = "N1", "gradient compression numerics: loss with bf16 / fp16 reduction vs fp32 reduction (dp2 x pp2)"
STEPS, BATCH, DP, PP, MICRO = 100, 16, 2, 2, 4
DTYPES: tuple[str | None, ...] = (None, "bf16", "fp16")


def worker(grad_reduce_dtype: str | None, steps: int, tiny: bool, data_parallel: str = "replicate") -> list[float]:
    """Runs on the 4 ranks: trains the GPT; returns the per-step logged training loss (rank 0's view)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_3d import ThreeDStrategy
    from lightning_3d_examples.gpt import GPT
    from lightning_3d_examples.text_data import ByteWindows, read_corpus

    from .common import quiet_lightning

    quiet_lightning()
    L.seed_everything(1337, verbose=False)
    preset = "tiny" if tiny else "small"
    model = GPT(preset=preset, lr=1e-3, weight_decay=0.1, warmup_steps=20, max_steps=steps)
    block = model.config.block_size
    corpus = read_corpus(None, max_bytes=(steps * BATCH * DP + 1) * (block + 1))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    loader = DataLoader(ByteWindows(data, block), batch_size=BATCH, shuffle=False, drop_last=True)
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=DP * PP,
        strategy=ThreeDStrategy(
            pp=PP,
            micro_batches=MICRO,
            print_layout=False,
            data_parallel=data_parallel,
            grad_reduce_dtype=grad_reduce_dtype,
        ),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Losses()],
    )
    torch.manual_seed(0)
    trainer.fit(model, loader)
    return losses


def compare(reference: list[float], other: list[float]) -> dict[str, float]:
    """Largest and final absolute / relative differences of ``other``'s losses from ``reference``'s."""
    assert len(reference) == len(other), (len(reference), len(other))
    absolute = [abs(a - b) for a, b in zip(reference, other)]
    relative = [d / abs(a) for d, a in zip(absolute, reference)]
    return {
        "max_abs": max(absolute),
        "max_rel": max(relative),
        "final_abs": absolute[-1],
        "final_rel": relative[-1],
        "max_at_step": absolute.index(max(absolute)),
    }


def run(out: Path, tiny: bool = False, data_parallel: str = "replicate") -> Record:
    """Three trainings (fp32, bf16, fp16 reduction), then the loss differences."""
    from .common import launch

    steps = 10 if tiny else STEPS
    curves: dict[str, list[float]] = {}
    for dtype in DTYPES:
        args = {"grad_reduce_dtype": dtype, "steps": steps, "tiny": tiny, "data_parallel": data_parallel}
        curves[dtype or "fp32"] = launch("n1_grad_reduce:worker", DP * PP, args, timeout=900)
    reference = curves["fp32"]
    diffs = {name: compare(reference, curve) for name, curve in curves.items() if name != "fp32"}
    lines = [
        f"GPT {'tiny' if tiny else 'small'}, dp{DP} x pp{PP} ({data_parallel}, m={MICRO}), {steps} steps, {BATCH} "
        f"sequences per replica; fp32-reduction loss: first {reference[0]:.4f}, last {reference[-1]:.4f}",
        "reduce dtype | max |diff| (step) | max rel | final |diff| | final rel",
    ]
    for name, d in diffs.items():
        lines.append(
            f"{name} | {d['max_abs']:.2e} ({d['max_at_step']}) | {d['max_rel']:.2e} | {d['final_abs']:.2e} | "
            f"{d['final_rel']:.2e}"
        )
    suffix = "" if data_parallel == "replicate" else f"_{data_parallel}"
    return Record(
        f"{ID}{suffix}",
        TITLE,
        {name: round(d["final_rel"] * 1e6, 2) for name, d in diffs.items()},
        {"fp32": 0.0},
        0.0,
        {name: round(d["max_rel"] * 1e6, 2) for name, d in diffs.items()},
        "ppm of the fp32-reduction loss (measured: final step; ratio: largest over the steps)",
        {"curves": curves, "diffs": diffs, "steps": steps, "data_parallel": data_parallel},
        lines,
    )
