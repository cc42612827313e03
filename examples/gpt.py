"""A byte-level GPT written as an ordinary LightningModule, in the spirit of nanoGPT.

Nothing in this file knows about parallelism. It follows the user contract of ``ThreeDStrategy``
(``shared/notes/user-contract.md``) so that the same module trains on one CPU and under
``Trainer(strategy=ThreeDStrategy(tp=2, pp=4))``:

* the whole model is ONE ``nn.Sequential`` called ``body`` (embedding first, head last), so the
  strategy can cut it into pipeline stages between any two entries;
* the layers are created in ``configure_model()`` (called on the meta device by the strategy) and
  every module of ours re-initialises its own layers in ``reset_parameters()``, because the
  constructor's initialisation is lost on the meta device;
* attention keeps separate ``q_proj``/``k_proj``/``v_proj``/``out_proj`` linears and reshapes with the
  head dimension, never the head count, so column/row-wise tensor parallelism (which leaves each rank
  with ``n_head / tp`` heads) needs no change here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning import LightningModule
from torch import Tensor, nn


@dataclass
class GPTConfig:
    """Shape of a GPT. Defaults are the ``small`` preset."""

    vocab_size: int = 256  # bytes: no tokenizer, nothing to download
    block_size: int = 64  # longest context the position embedding covers
    n_layer: int = 4  # transformer blocks; the pipeline splits the body between them
    n_head: int = 4  # must be divisible by the tensor-parallel size
    n_embd: int = 128  # must be divisible by n_head
    dropout: float = 0.0  # 0.0 keeps runs bit-comparable across layouts
    bias: bool = True  # bias in the Linear and LayerNorm layers (lm_head never has one)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"pick n_head among {[h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]}."
            )


# From the test model to the one that only fits when built sharded. Parameter counts (vocab 256, bias=True):
# tiny 43k, small 0.87M, medium 6.5M, large 85.8M, xl 1.21B.
PRESETS: dict[str, GPTConfig] = {
    # Unit and multi-process tests: 4 heads so tp=1, 2 or 4 divide it; override n_layer for deeper pipelines.
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32),
    # The default CPU job: a few minutes on 2 cores with 8 processes.
    "small": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=256),
    "large": GPTConfig(block_size=512, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small's shape
    # About 1.2B parameters: 19 GB of fp32 weights + Adam state; build it sharded (configure_model on meta).
    "xl": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}
PRESETS["1b"] = PRESETS["xl"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate projections (tensor-parallel friendly)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.dropout_p = config.dropout
        # Separate q/k/v (not one fused c_attn) so a column-wise split gives each rank whole heads.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 * n_layer).
        self.resid_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init; runs after the children's own ``reset_parameters`` and overrides them."""
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            _normal_linear(lin, 0.02)
        _normal_linear(self.out_proj, self.resid_std)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # -1 is the number of heads THIS rank holds (n_head / tp under tensor parallelism).
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        # is_causal instead of a mask buffer: no buffer to materialise, shard or checkpoint.
        dropout_p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """Feed-forward block: ``fc`` (n_embd -> 4 n_embd), GELU, ``proj`` back (column- then row-wise)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.resid_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init, with the residual projection scaled down."""
        _normal_linear(self.fc, 0.02)
        _normal_linear(self.proj, self.resid_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings, then dropout. First entry of the body."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) as GPT-2, instead of nn.Embedding's N(0, 1)."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        # Positions computed on the fly rather than kept in a buffer (no buffers anywhere in the model).
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """Final LayerNorm and projection to the vocabulary. Last entry of the body.

    Its weight is NOT tied to the token embedding: under pipeline parallelism the two live on different ranks.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) for the output projection."""
        _normal_linear(self.lm_head, 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def _normal_linear(layer: nn.Linear, std: float) -> None:
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class GPT(LightningModule):
    """Byte-level GPT language model.

    Args:
        preset: name of a config in ``PRESETS`` ("tiny", "small", "medium", "large", "xl"/"1b").
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (``dim() >= 2``).
        warmup_steps: linear warm-up length in optimizer steps (used only with ``max_steps``).
        max_steps: when given, the learning rate follows warm-up then a cosine decay to ``min_lr_ratio * lr``
            at ``max_steps``; when None it stays constant.
        min_lr_ratio: floor of the cosine decay, as a fraction of ``lr``.
        example_batch: sequences in one micro-batch; when given, ``example_input_array`` is that many zero
            sequences of ``block_size`` tokens (what ``partitioner="compute"`` times and ``"memory"`` profiles, and
            what the strategy checks the stage boundaries on at setup). The training app passes its micro-batch.
        **overrides: replace fields of the preset's ``GPTConfig``, e.g. ``n_layer=6, dropout=0.1``.

    Example:
        >>> model = GPT("tiny", n_layer=4)
        >>> model.configure_model()
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(
        self,
        preset: str = "small",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        example_batch: int | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if preset not in PRESETS:
            raise ValueError(f"GPT: unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        if unknown := sorted(set(overrides) - fields):
            raise TypeError(f"GPT: unknown config override(s) {unknown}; GPTConfig has {sorted(fields)}.")
        self.config = dataclasses.replace(PRESETS[preset], **overrides)
        if example_batch:
            self.example_input_array = torch.zeros(example_batch, self.config.block_size, dtype=torch.long)
        # No layers here: configure_model() builds them, on meta when the strategy shards the model.

    def configure_model(self) -> None:
        """Build the layers. Idempotent: Lightning, the strategy and load_from_checkpoint may all call it."""
        if hasattr(self, "body"):
            return
        c = self.config
        self.body = nn.Sequential(Embedding(c), *[Block(c) for _ in range(c.n_layer)], Head(c))

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""
        return self.body(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = _cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = _cross_entropy(self(x), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = _cross_entropy(self(x), y)
        self.log("test_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Logits for the inputs (a batch may be ``x`` or ``(x, y)``)."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        """AdamW with decoupled weight decay on ``dim() >= 2`` parameters, plus an optional LR schedule.

        Only ``self.named_parameters()`` is walked: under pipeline parallelism a rank holds some layers
        only, and under tensor parallelism parameters are DTensors (``.dim()`` is the global one).
        """
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm weights
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]  # a pipeline stage may hold no biases at all
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95))
        if hp.max_steps is None:
            return optimizer
        schedule = _warmup_cosine(hp.warmup_steps, hp.max_steps, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    # Mean over every token of the (micro-)batch: the strategy averages micro-batch losses.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float) -> Any:
    """LR factor: linear ramp to 1 over ``warmup_steps``, cosine down to ``min_ratio`` at ``max_steps``."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if step >= max_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


@torch.no_grad()
def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` continuations from a single-device model.

    Args:
        model: a GPT whose layers are built (``configure_model`` is called if they are not).
        idx: prompt token ids, ``(B, T)`` or ``(T,)``.
        max_new_tokens: number of tokens to append.
        temperature: softmax temperature; ``0`` means greedy decoding.
        top_k: sample only among the ``top_k`` most likely tokens.
        generator: random source; a seeded generator (or ``torch.manual_seed``) makes the output reproducible.

    Returns:
        ``(B, T + max_new_tokens)`` token ids (``(T + max_new_tokens,)`` for a 1-D prompt).
    """
    model.configure_model()
    squeeze = idx.dim() == 1
    if squeeze:
        idx = idx.unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            # Recompute the whole (cropped) context each step: no KV cache, as in nanoGPT.
            logits = model(idx[:, -model.config.block_size :])[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
    finally:
        model.train(was_training)
    return idx.squeeze(0) if squeeze else idx
