"""A Hugging Face ``LlamaForCausalLM``, unchanged, as a byte-level LightningModule.

The model is built from a config (nothing is downloaded) with a 256-byte vocabulary for
:class:`~lightning_3d_examples.text_data.ByteTextDataModule`, and trained with Hugging Face's own loss:
``training_step`` returns ``self.model(input_ids=x, labels=y, shift_labels=y).loss``. The datamodule yields
``(x, y)`` with ``y`` = ``x`` shifted by one byte, so ``y`` is passed as ``shift_labels`` (labels already
aligned with the logits, the way transformers' Trainer passes pre-shifted labels): the loss is the mean
next-byte cross-entropy over all ``T`` positions, the same as :class:`~lightning_3d_examples.GPT`'s. (Passing
``labels=x`` alone would make Hugging Face shift them itself and drop the last position.)

Under ``ThreeDStrategy`` the model's own tensor-parallel plan (``LlamaConfig.base_model_tp_plan``) applies,
see :mod:`lightning_3d.core.tensor_parallel.hf_plan`. transformers is imported only when the model is built,
so importing ``lightning_3d_examples`` does not need it.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningModule
from torch import Tensor, nn

from lightning_3d_examples.gpt import _warmup_cosine
from lightning_3d_examples.text_data import VOCAB_SIZE

# Llama shapes (Hugging Face LlamaConfig fields). num_key_value_heads < num_attention_heads: grouped-query
# attention. Head and kv-head counts, intermediate_size and the vocabulary divide by tp = 1, 2 (and 4 for
# "small"'s intermediate size 344 = 8 * 43).
HF_LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 2 layers, seconds per run on one CPU.
    "tiny": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # About the size of GPT "small" (0.79M parameters with the 256-byte vocabulary).
    "small": dict(
        hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
}


class HFCausalLM(LightningModule):
    """A Hugging Face causal language model built from a config, trained on bytes.

    Args:
        preset: name of a shape in ``HF_LLAMA_PRESETS`` ("tiny", "small").
        model_type: Hugging Face model type (``"llama"``; any causal LM type whose config takes the given fields).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay, on matrices and embeddings only (``dim() >= 2``).
        warmup_steps: linear warm-up length in optimizer steps (used only with ``max_steps``).
        max_steps: when given, warm-up then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``; else constant.
        min_lr_ratio: floor of the cosine decay, as a fraction of ``lr``.
        block_size: context length the data uses; the model's ``max_position_embeddings``.
        example_batch: sequences in one micro-batch; when given, ``example_input_array`` is that many zero
            sequences of ``block_size`` tokens (what ``partitioner="compute"`` / ``"memory"`` run on, and what the
            strategy checks the stage boundaries on at setup). The training app passes its micro-batch.
        **config: Hugging Face config fields that replace the preset's (``num_hidden_layers=6``,
            ``tie_word_embeddings=True``, ...); ``vocab_size`` defaults to 256 (bytes).

    Example:
        >>> model = HFCausalLM("tiny")
        >>> model.configure_model()
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(
        self,
        preset: str = "small",
        model_type: str = "llama",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        block_size: int = 64,
        example_batch: int | None = None,
        **config: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if preset not in HF_LLAMA_PRESETS:
            raise ValueError(f"HFCausalLM: unknown preset {preset!r}; choose one of {sorted(HF_LLAMA_PRESETS)}.")
        self.model_type = model_type
        # KV cache off: training recomputes the whole sequence; the cache would only cost memory. Bytes have no
        # special tokens: no bos / eos (an eos byte would stop generation early).
        self.hf_config_kwargs: dict[str, Any] = {
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": None,
            "eos_token_id": None,
            **HF_LLAMA_PRESETS[preset],
            "max_position_embeddings": block_size,
            **config,
            "use_cache": False,
        }
        if example_batch:
            self.example_input_array = torch.zeros(example_batch, block_size, dtype=torch.long)
        # No layers here: configure_model() builds them (on the meta device when a strategy shards the model).

    def hf_config(self) -> Any:
        """The Hugging Face config of the model (``AutoConfig.for_model``)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.hf_config_kwargs)

    def configure_model(self) -> None:
        """Build the Hugging Face model. Idempotent: Lightning, the strategy and load_from_checkpoint may call it."""
        if hasattr(self, "model"):
            return
        from transformers import AutoModelForCausalLM

        self.model: nn.Module = AutoModelForCausalLM.from_config(self.hf_config())

    def forward(self, input_ids: Tensor) -> Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        # labels= asks Hugging Face for the loss; shift_labels=y gives it the targets already aligned with the
        # logits (y is x shifted by one byte), so every one of the T positions counts.
        return self.model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the Hugging Face config, so ``python -m lightning_3d.checkpoint export-hf`` needs no --config."""
        from lightning_3d.checkpoint.hf import HF_CONFIG_KEY, hf_configs

        checkpoint[HF_CONFIG_KEY] = hf_configs(self)

    def configure_optimizers(self) -> Any:
        """AdamW with weight decay on ``dim() >= 2`` parameters, plus an optional warm-up + cosine LR schedule."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # RMSNorm weights
        ]
        groups = [g for g in groups if g["params"]]  # a pipeline stage may hold no norms at all
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95))
        if hp.max_steps is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _warmup_cosine(hp.warmup_steps, hp.max_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def generate(
    model: HFCausalLM,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` bytes with Hugging Face's ``generate`` (same signature as the GPT example's).

    Args:
        model: the module (``configure_model`` is called if needed).
        idx: prompt token ids, ``(B, T)`` or ``(T,)``.
        max_new_tokens: number of tokens to append.
        temperature: softmax temperature; ``0`` means greedy decoding.
        top_k: sample only among the ``top_k`` most likely tokens.
        generator: seeds the sampling (Hugging Face samples from torch's global generator, which is forked
            and restored around the call).

    Returns:
        ``(B, T + max_new_tokens)`` token ids (``(T + max_new_tokens,)`` for a 1-D prompt).
    """
    model.configure_model()
    squeeze = idx.dim() == 1
    if squeeze:
        idx = idx.unsqueeze(0)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            sampling = temperature > 0
            out = model.model.generate(
                idx,
                attention_mask=torch.ones_like(idx),
                max_new_tokens=max_new_tokens,
                do_sample=sampling,
                temperature=temperature if sampling else None,
                top_k=top_k if sampling else None,
                top_p=None,
                pad_token_id=0,
                use_cache=True,
            )
    finally:
        model.train(was_training)
    return out.squeeze(0) if squeeze else out
