"""Callbacks of the main job (``lightning_3d.train``): throughput, validation print-outs, a text sample.

They work with any strategy. Under ``ThreeDStrategy`` they rely on two of its properties: rank 0 sees the
logged metrics (relayed from the last pipeline stage), and ``full_state_dict()`` gathers the whole model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

log = logging.getLogger(__name__)


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many different batches one optimizer step consumes (the data-parallel size).

    Under tensor and pipeline parallelism only the data-parallel ranks read different samples, so the world
    size would over-count by ``tp * pp``; the strategy's sampler arguments know the true number.
    """
    try:
        kwargs = trainer.strategy.distributed_sampler_kwargs  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # single-device strategies, or before the mesh exists
        return 1
    return int(kwargs.get("num_replicas", 1)) if kwargs else 1


def _batch_items(batch: Any) -> tuple[int, str]:
    """Tokens in a batch of token ids (integer tensor of rank >= 2), otherwise samples."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(x, Tensor):
        if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
            return x.numel(), "tokens"
        return x.shape[0], "samples"
    return 0, "samples"


class Throughput(Callback):
    """Items (tokens for language models, samples otherwise) per second of the GLOBAL batch.

    The time of a step is measured on every rank from ``on_train_batch_start`` to ``on_train_batch_end``
    (forward, backward and optimizer step; validation and data loading excluded). The items of a step are
    this rank's batch times the data-parallel size. The progress bar shows the mean over the last ``window``
    steps as ``tokens_per_sec``; rank 0 logs a summary at the end, without the first step (it builds the
    pipeline schedule).

    Args:
        window: number of steps averaged for the progress bar.
    """

    def __init__(self, window: int = 10) -> None:
        self.window = max(1, window)
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.window)
        self._start = 0.0
        self._unit = "samples"
        self.total_items = 0
        self.total_seconds = 0.0
        self.steps = 0

    @property
    def rate(self) -> float:
        """Items per second over the whole run so far, first step excluded."""
        return self.total_items / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def unit(self) -> str:
        """``"tokens"`` or ``"samples"``."""
        return self._unit

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, _o: Any, batch: Any, *_: Any
    ) -> None:
        seconds = time.perf_counter() - self._start
        items, self._unit = _batch_items(batch)
        items *= data_parallel_replicas(trainer)
        self.steps += 1
        if self.steps == 1:
            return
        self.total_items += items
        self.total_seconds += seconds
        self._recent.append((items, seconds))
        rate = sum(i for i, _ in self._recent) / max(sum(s for _, s in self._recent), 1e-9)
        # Every rank logs its own (nearly equal) value: no collective (sync_dist=False), the same key on every
        # rank, and only rank 0's reaches the loggers and the progress bar.
        pl_module.log(f"{self._unit}_per_sec", rate, prog_bar=True, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.total_seconds > 0:
            log.info(
                "throughput: %.0f %s/s (global batch, %d steps, %.1f s of training steps)",
                self.rate,
                self._unit,
                self.steps - 1,
                self.total_seconds,
            )


class ValidationPrinter(Callback):
    """Rank 0 prints the validation metrics (keys starting with ``val_``) after each validation run.

    The values are kept in :attr:`history` as ``(global_step, {name: value})``.
    """

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        values = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_") and _is_scalar(v)}
        if values:
            self.history.append((trainer.global_step, values))
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()))
            log.info("step %d: %s", trainer.global_step, shown)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, Tensor) or value.numel() == 1


class SampleText(Callback):
    """At the end of training, rank 0 samples text from a single-device copy of the trained GPT (or HFCausalLM).

    Every rank takes part in gathering the weights (``strategy.full_state_dict()`` is a collective under
    ``ThreeDStrategy``); rank 0 then builds the same GPT on one device, loads them and calls
    ``lightning_3d_examples.gpt.generate``.

    Args:
        prompt: text the sample continues.
        max_new_tokens: bytes to generate.
        temperature: softmax temperature (0: greedy).
        top_k: sample among the ``top_k`` most likely bytes (None: all).
        seed: seed of the sampling generator (the same weights give the same text).
    """

    def __init__(
        self,
        prompt: str = "def ",
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 40,
        seed: int = 0,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.text: str | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_3d_examples.gpt import GPT, generate
        from lightning_3d_examples.hf_llama import HFCausalLM
        from lightning_3d_examples.hf_llama import generate as hf_generate
        from lightning_3d_examples.text_data import decode, encode

        gather = getattr(trainer.strategy, "full_state_dict", None)
        state = gather() if callable(gather) else pl_module.state_dict()
        if not trainer.is_global_zero or state is None:
            return
        # Same hyperparameters (preset and shape overrides) as the trained module, built on one CPU device.
        hf = isinstance(pl_module, HFCausalLM)
        model = (HFCausalLM if hf else GPT)(**dict(pl_module.hparams))
        model.configure_model()
        model.load_state_dict({k: v.float() for k, v in state.items()})
        generator = torch.Generator().manual_seed(self.seed)
        prompt = encode(self.prompt)
        sample = hf_generate if hf else generate
        tokens = sample(model, prompt, self.max_new_tokens, self.temperature, self.top_k, generator=generator)
        self.text = decode(tokens)
        log.info(
            "sample (temperature %s, top_k %s) after %d steps:\n%s\n%s\n%s",
            self.temperature,
            self.top_k,
            trainer.global_step,
            "-" * 72,
            self.text,
            "-" * 72,
        )
