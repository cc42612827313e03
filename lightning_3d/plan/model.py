"""What the planner knows about a model: its shape, parameter counts, FLOPs per token and per-layer matmuls.

A transformer is described by the few numbers that decide memory and time: layers, hidden size, FFN width, heads,
key-value heads, vocabulary, sequence length, whether the MLP is gated (SwiGLU) and whether the input and output
embeddings are tied. :func:`model_from_config` reads them from the training app's ``model=`` config (the example
GPT's ``n_layer``/``n_embd``/``n_head``/``block_size`` or a Hugging Face ``LlamaConfig``'s
``num_hidden_layers``/``hidden_size``/``intermediate_size``/``num_attention_heads``/``num_key_value_heads``).

FLOPs follow the usual accounting (Kaplan et al. 2020; Narayanan et al. 2021): 2 FLOPs per multiply-add of every
matmul, the attention score and value products (``2 * 2 * s * h`` per token and layer, causal masking not
discounted, as Megatron counts), backward twice the forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Matmul:
    """One matmul of a layer's forward for one token: ``(1 x k) @ (k x n)``; ``sharded`` over tp on ``n`` or ``k``.

    Attributes:
        name: the layer it belongs to (``qkv``, ``out``, ``fc``, ``proj``, ``lm_head``, ...).
        k: reduction size.
        n: output features (whole model, before tensor-parallel sharding).
        shard: ``"n"`` (column-parallel: output features split), ``"k"`` (row-parallel) or ``""`` (replicated).
    """

    name: str
    k: int
    n: int
    shard: str


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as the planner needs it.

    Attributes:
        name: label for tables (``gpt_small``, ``hf_llama``, ...).
        n_layer: transformer blocks (what the pipeline splits).
        hidden: model width ``h``.
        ffn: MLP width (``4 h`` for GPT, ``intermediate_size`` for Llama).
        n_head: attention heads.
        n_kv_head: key-value heads (``n_head`` without grouped-query attention).
        vocab: vocabulary size.
        seq_len: tokens per sample.
        gated_mlp: SwiGLU-style MLP (three matrices: gate, up, down) instead of two.
        tied_embeddings: input and output embedding share one matrix.
        bias: Linear and norm layers have biases (counted in parameters only).
        learned_positions: a learned position embedding (``seq_len x h``) besides the token embedding.
    """

    name: str
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_kv_head: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    tied_embeddings: bool = False
    bias: bool = False
    learned_positions: bool = False

    def __post_init__(self) -> None:
        for field_name in ("n_layer", "hidden", "ffn", "n_head", "n_kv_head", "vocab", "seq_len"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"ModelSpec.{field_name} must be >= 1, got {getattr(self, field_name)}.")
        if self.hidden % self.n_head:
            raise ValueError(f"ModelSpec: hidden={self.hidden} is not divisible by n_head={self.n_head}.")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelSpec: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection's output."""
        return self.n_kv_head * self.head_dim

    def layer_matmuls(self) -> list[Matmul]:
        """The parameter matmuls of one block, with their tensor-parallel split (Megatron's column/row pairs)."""
        h, f = self.hidden, self.ffn
        mm = [Matmul("qkv", h, h + 2 * self.kv_dim, "n"), Matmul("out", h, h, "k")]
        if self.gated_mlp:
            mm += [Matmul("gate_up", h, 2 * f, "n"), Matmul("down", f, h, "k")]
        else:
            mm += [Matmul("fc", h, f, "n"), Matmul("proj", f, h, "k")]
        return mm

    def layer_params(self) -> int:
        """Parameters of one block (matrices, biases, norms)."""
        matrices = sum(m.k * m.n for m in self.layer_matmuls())
        norms = 2 * self.hidden * (2 if self.bias else 1)
        biases = sum(m.n for m in self.layer_matmuls()) if self.bias else 0
        return matrices + norms + biases

    def embedding_params(self) -> int:
        """Token (and learned position) embedding: on the first pipeline stage."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """Final norm and output projection: on the last pipeline stage (a tied head is a second copy there)."""
        return self.hidden * (2 if self.bias else 1) + self.vocab * self.hidden

    def params(self) -> int:
        """Parameters of the whole model (a tied embedding counted once)."""
        head = self.head_params() - (self.vocab * self.hidden if self.tied_embeddings else 0)
        return self.n_layer * self.layer_params() + self.embedding_params() + head

    def layer_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block for ``tokens`` tokens of sequences of ``seq_len``: matmuls + attention."""
        matmuls = sum(2.0 * m.k * m.n for m in self.layer_matmuls()) * tokens
        attention = 2.0 * 2.0 * self.seq_len * self.hidden * tokens  # scores q k^T and the weighted sum of v
        return matmuls + attention

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output projection (the logits)."""
        return 2.0 * self.hidden * self.vocab * tokens

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), attention included, no recomputation."""
        return 3.0 * (self.n_layer * self.layer_forward_flops(1) + self.head_forward_flops(1))

    def describe(self) -> str:
        """One line for the table's header."""
        gqa = f", {self.n_kv_head} kv heads" if self.n_kv_head != self.n_head else ""
        return (
            f"{self.name}: {self.params() / 1e6:,.2f}M parameters, {self.n_layer} layers, hidden {self.hidden}, "
            f"ffn {self.ffn}, {self.n_head} heads{gqa}, vocab {self.vocab}, sequence {self.seq_len}, "
            f"{self.flops_per_token() / 1e6:,.1f} MFLOP per token (training)"
        )


# The example GPT's presets (lightning_3d_examples.gpt.PRESETS), so `model.preset=...` alone resolves. The planner
# must not import the examples (they import Lightning), so the shapes are repeated; tests/unit/test_plan_model.py
# checks them against PRESETS.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(block_size=32, n_layer=2, n_head=4, n_embd=32),
    "small": dict(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "medium": dict(block_size=256, n_layer=8, n_head=8, n_embd=256),
    "large": dict(block_size=512, n_layer=12, n_head=12, n_embd=768),
    "xl": dict(block_size=1024, n_layer=24, n_head=16, n_embd=2048),
}


def model_from_config(cfg: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a training ``model=`` config (GPT example or Hugging Face Llama-like fields).

    Args:
        cfg: the model config: GPT fields (``n_layer``, ``n_embd``, ``n_head``, ``block_size``, ``vocab_size``,
            ``bias``) or Hugging Face fields (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, ``tie_word_embeddings``, and
            ``block_size`` or ``max_position_embeddings`` or ``seq_len`` for the sequence length).
        name: label; defaults to the config's ``_target_`` class name and preset.

    Returns:
        The model's shape.

    Raises:
        ValueError: for a config that is neither.
    """
    c = dict(cfg)
    if "num_hidden_layers" in c:
        hidden = int(c["hidden_size"])
        seq = c.get("seq_len") or c.get("block_size") or c.get("max_position_embeddings") or 2048
        return ModelSpec(
            name=name or str(c.get("model_type", "hf")),
            n_layer=int(c["num_hidden_layers"]),
            hidden=hidden,
            ffn=int(c.get("intermediate_size") or 4 * hidden),
            n_head=int(c["num_attention_heads"]),
            n_kv_head=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
            vocab=int(c.get("vocab_size", 32000)),
            seq_len=int(seq),
            gated_mlp=c.get("hidden_act", "silu") != "gelu" and c.get("gated_mlp", True),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            bias=bool(c.get("attention_bias", False)),
        )
    if "n_layer" in c or "preset" in c:
        base = dict(GPT_PRESETS.get(str(c.get("preset", "small")), GPT_PRESETS["small"]))
        base.update({k: c[k] for k in ("block_size", "n_layer", "n_head", "n_embd") if k in c})
        hidden = int(base["n_embd"])
        return ModelSpec(
            name=name or f"gpt_{c.get('preset', 'custom')}",
            n_layer=int(base["n_layer"]),
            hidden=hidden,
            ffn=4 * hidden,
            n_head=int(base["n_head"]),
            n_kv_head=int(base["n_head"]),
            vocab=int(c.get("vocab_size", 256)),
            seq_len=int(c.get("seq_len") or base["block_size"]),
            bias=bool(c.get("bias", True)),
            learned_positions=True,
        )
    raise ValueError(
        "plan: the model config has neither GPT fields (n_layer, n_embd, n_head, block_size) nor Hugging Face "
        f"fields (num_hidden_layers, hidden_size, num_attention_heads, ...); got keys {sorted(c)}."
    )
