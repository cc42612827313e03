"""Small model bodies for the tensor-parallel tests (plan tests and the multi-process numerics).

Every body is an ``nn.Sequential`` written the way a user writes single-device code; attention
never hard-codes the global head count (``view(B, T, -1, head_dim)``), except in the model that
tests that the analysis catches it.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    """Token + position embedding."""

    def __init__(self, vocab: int, block: int, dim: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.wpe = nn.Embedding(block, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Attention(nn.Module):
    """Separate q/k/v/out projections, causal SDPA; GQA when ``kv_heads < heads``."""

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int | None = None,
        manual: bool = False,
        hard_coded: str = "",
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        # per-head RMSNorm of q and k with learned weights (Qwen3, OLMo 2): their gradients summed over tp
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.head_dim)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.head_dim)
        self.out_proj = nn.Linear(dim, dim)
        self.manual, self.hard_coded = manual, hard_coded
        self.layout = (heads, self.kv_heads)  # "literal": counts the analysis cannot trace to a head-count attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        if self.hard_coded:  # the view takes the whole head counts: from attributes ("attr", OPT-like) or not
            heads, kv_heads = (self.heads, self.kv_heads) if self.hard_coded == "attr" else self.layout
            q = self.q_proj(x).view(B, T, heads, -1).transpose(1, 2)
            k = self.k_proj(x).view(B, T, kv_heads, -1).transpose(1, 2)
            v = self.v_proj(x).view(B, T, kv_heads, -1).transpose(1, 2)
        else:
            q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.transpose(1, 2)).transpose(1, 2)
            k = self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        if self.manual:  # nanoGPT's explicit attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


class FusedAttention(nn.Module):
    """GPT-2 style fused qkv projection (``c_attn``) split into q, k, v."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GatedMLP(MLP):
    """An MLP whose hidden features are scaled by a learned scalar: its gradient is summed over tp."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)) * self.gate)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block with residuals."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
        inplace: bool = False,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = attn if attn is not None else Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = mlp if mlp is not None else MLP(dim, hidden)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        if self.inplace:  # Falcon's `mlp_output += attention_output`: the row-parallel output modified in place
            out = self.mlp(self.ln_2(x))
            out += x
            return out
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt(
    vocab: int = 32,
    block: int = 8,
    dim: int = 16,
    heads: int = 4,
    hidden: int = 32,
    layers: int = 2,
    kv_heads: int | None = None,
    manual: bool = False,
    padding_idx: int | None = None,
    fused: bool = False,
    hard_coded: str = "",
    qk_norm: bool = False,
    gated: bool = False,
) -> nn.Sequential:
    """``Sequential(Embed, Block * layers, Head)``."""

    def attn() -> nn.Module:
        if fused:
            return FusedAttention(dim, heads)
        return Attention(dim, heads, kv_heads, manual=manual, hard_coded=hard_coded, qk_norm=qk_norm)

    blocks = [
        Block(dim, heads, hidden, attn=attn(), mlp=GatedMLP(dim, hidden) if gated else None) for _ in range(layers)
    ]
    return nn.Sequential(Embed(vocab, block, dim, padding_idx), *blocks, Head(dim, vocab))


def mlp_chain(dims: tuple[int, ...] = (8, 16, 16, 8)) -> nn.Sequential:
    """``Sequential(Linear, ReLU, Linear, ReLU, ..., Linear)``."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class InOut(nn.Module):
    """Linear(dim -> dim) on (B, T, dim) float features: the first layer of a body without embedding."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def swiglu_model(dim: int = 16, hidden: int = 32, layers: int = 2) -> nn.Sequential:
    """Feature projection, pre-norm SwiGLU residual blocks (llama style MLP), head."""
    blocks = [Block(dim, 4, hidden, attn=Attention(dim, 4), mlp=SwiGLU(dim, hidden)) for _ in range(layers)]
    return nn.Sequential(Embed(32, 8, dim), *blocks, Head(dim, 32))
