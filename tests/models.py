"""Tiny LightningModules for the strategy's tests, written as single-device code (the user contract).

``build="configure"`` creates the layers in ``configure_model`` (meta device under ThreeDStrategy);
``build="init"`` creates them in ``__init__``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


class _Base(L.LightningModule):
    def __init__(self, build: str = "configure", lr: float = 0.05, optimizer: str = "adam", scheduler: bool = True):
        super().__init__()
        self.build, self.lr, self.optimizer_name, self.use_scheduler = build, lr, optimizer, scheduler
        if build == "init":
            self.configure_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TinyMLP(_Base):
    """Seven entries: four Linear layers with ReLUs between them (four layers with parameters)."""

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("correct", (logits.argmax(-1) == y).sum().to(loss.dtype), reduce_fx="sum")
        self.log("max_logit", logits.max(), reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss


class PlainMLP(_Base):
    """No block container and no ``nn.Sequential``: layers as attributes, a forward of the user's own (a residual
    MLP). Only pp = 1 applies; tensor parallelism analyses the whole module."""

    def configure_model(self) -> None:
        if hasattr(self, "head"):
            return
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(self.norm(h))

    training_step = TinyMLP.training_step
    validation_step = TinyMLP.validation_step


class Embed(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a per-query constant), and Adam
        # would turn round-off noise into full-size steps, making float32 parameters incomparable.
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim, bias=False),
            nn.Linear(dim, dim),
        )
        self.out_proj = nn.Linear(dim, dim)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        h = self.ln1(x)
        q = self.q_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class TinyGPT(_Base):
    """Embedding, two pre-norm attention blocks, head: four layers."""

    vocab, block, dim, heads, layers = 32, 8, 16, 2, 2

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        self.body = nn.Sequential(
            Embed(self.vocab, self.block, self.dim),
            *[Block(self.dim, self.heads) for _ in range(self.layers)],
            Head(self.dim, self.vocab),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss


class NanoGPT(_Base):
    """nanoGPT's layout: blocks in an nn.ModuleList inside an nn.ModuleDict, embeddings and head around them,
    a forward that loops over the blocks. ``tie=True`` ties the head to the token embedding (as nanoGPT does).
    ``example=True`` sets an ``example_input_array``: the tensor-parallel analysis then runs the whole forward and
    shards the embeddings and the head (tied or not) on the vocabulary too, and the stage boundaries are checked at
    setup; without one, only the blocks are sharded and the boundaries are checked at the first step."""

    vocab, block, dim, heads, layers = 32, 8, 16, 2, 4

    def __init__(self, tie: bool = False, example: bool = False, checkpointed: bool = False, **kwargs):
        self.tie, self.checkpointed = tie, checkpointed
        super().__init__(**kwargs)
        if example:
            self.example_input_array = torch.zeros(2, self.block, dtype=torch.long)

    def configure_model(self) -> None:
        if hasattr(self, "transformer"):
            return
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(self.vocab, self.dim),
                "wpe": nn.Embedding(self.block, self.dim),
                "drop": nn.Dropout(0.0),
                "h": nn.ModuleList(Block(self.dim, self.heads) for _ in range(self.layers)),
                "ln_f": nn.LayerNorm(self.dim),
            }
        )
        self.lm_head = nn.Linear(self.dim, self.vocab, bias=False)
        if self.tie:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            # ``checkpointed``: each block called through torch's non-reentrant checkpoint, as some forwards do
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed and self.training else block(x)
        return self.lm_head(self.transformer.ln_f(x))

    training_step = TinyGPT.training_step
    validation_step = TinyGPT.validation_step


class SkippingGPT(NanoGPT):
    """NanoGPT skipping blocks while training as LayerDrop does (``continue`` in the loop), by a pattern of the
    step instead of a draw, so that one device skips the same ones: none, then block 1, blocks 2 and 3, blocks 0
    and 1 (at pp2: a stage's last block, all of the last stage's, all of the first's)."""

    PATTERN = ((), (1,), (2, 3), (0, 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        skip = self.PATTERN[self.global_step % len(self.PATTERN)] if self.training else ()
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            if i not in skip:
                x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def rotary_tables(head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary position embeddings, ``(length, head_dim // 2)``."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class RotaryBlock(nn.Module):
    """A torchtitan / litgpt style block: RMSNorm, attention with rotary embeddings, SwiGLU; the model's forward
    hands it the rotary tables, ``block(x, cos, sin)``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        h = self.attn_norm(x)
        q, k, v = (w(h).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RotaryGPT(_Base):
    """Blocks in an ``nn.ModuleList`` that take more than the hidden states (the rotary tables, buffers of the
    model); no learned positions. Its ``example_input_array`` lets the tensor-parallel analysis see what the
    forward passes the blocks."""

    vocab, block, dim, heads, layers = 32, 8, 16, 2, 4

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.tok = nn.Embedding(self.vocab, self.dim)
        self.blocks = nn.ModuleList(RotaryBlock(self.dim, self.heads) for _ in range(self.layers))
        self.norm = nn.RMSNorm(self.dim)
        self.out = nn.Linear(self.dim, self.vocab, bias=False)
        cos, sin = rotary_tables(self.dim // self.heads, self.block)
        self.register_buffer("cos", cos.to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("sin", sin.to(torch.get_default_dtype()), persistent=False)
        self.example_input_array = torch.zeros(2, self.block, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        return self.out(self.norm(x))

    training_step = TinyGPT.training_step
    validation_step = TinyGPT.validation_step


_GPT_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
# Each family's tiny settings: the name of its layer count and the rest; others get the shared tiny decoder.
_HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "gpt2": ("n_layer", {"n_embd": 16, "n_head": 2, "n_positions": 16, **_GPT_NO_DROPOUT}),
    # OPT's decoder registers its final norm and output projection before its layers and calls them after;
    # project_in / project_out map the 8-wide embeddings to the 16-wide layers; no biases (an attention key
    # bias gets a zero gradient, which Adam turns into steps of round-off)
    "opt": (
        "num_hidden_layers",
        {"hidden_size": 16, "ffn_dim": 32, "word_embed_proj_dim": 8, "num_attention_heads": 4,
         "max_position_embeddings": 16, "enable_bias": False, "dropout": 0.0, "pad_token_id": 1, "bos_token_id": 2,
         "eos_token_id": 2},
    ),
    # Falcon's Linears are a subclass with a forward of its own (input @ weight.T + bias); the new decoder
    # architecture packs each key/value group's queries, key and value in one fused projection
    "falcon": (
        "num_hidden_layers",
        {"hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 4, "num_kv_heads": 2,
         "new_decoder_architecture": True, "max_position_embeddings": 16, "hidden_dropout": 0.0,
         "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0},
    ),
    # its rotary table is a non-persistent buffer computed in the default dtype: built on the meta device, it is
    # computed again at materialisation, which must happen in the precision's dtype (64-true: float64)
    "gptj": (
        "n_layer",
        {"n_embd": 16, "n_head": 4, "rotary_dim": 4, "n_inner": 32, "n_positions": 16, "bos_token_id": 0,
         "eos_token_id": 0, **_GPT_NO_DROPOUT},
    ),
}  # fmt: skip
_TINY_DECODER = (
    "num_hidden_layers",
    {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
     "max_position_embeddings": 16},
)  # fmt: skip


def hf_config(arch: str, vocab: int = 32, layers: int = 4, tied: bool = False):
    """A tiny Hugging Face config of a causal LM family, dropout off and no KV cache (built offline); ``tied``: the
    LM head tied to the input embedding (GPT-2 always ties them)."""
    from transformers import AutoConfig

    layers_key, sizes = _HF_CONFIGS.get(arch, _TINY_DECODER)
    tie = {} if arch == "gpt2" else {"tie_word_embeddings": tied}
    return AutoConfig.for_model(arch, vocab_size=vocab, use_cache=False, **{layers_key: layers}, **sizes, **tie)


class HFCausalLM(_Base):
    """A LightningModule holding an unmodified Hugging Face causal LM; the loss comes from ``labels=``."""

    def __init__(self, arch: str = "llama", lr: float = 0.01, tied: bool = False, **kwargs):
        # (a smaller step than the other test models: at 0.05, Adam turns float32 round-off in a tiny LLM into
        # 1e-4 parameter differences within 20 steps, whatever computes the gradients)
        from torchmetrics.classification import MulticlassAccuracy

        self.arch, self.tied = arch, tied
        super().__init__(lr=lr, **kwargs)
        self.val_acc = MulticlassAccuracy(num_classes=hf_config(arch).vocab_size, average="micro")  # in __init__:
        # metric states are not layers, Lightning's configure_model would create them on the meta device

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(hf_config(self.arch, tied=self.tied), attn_implementation="eager")

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        out = self.model(input_ids=x, labels=x)
        self.val_acc.update(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        self.log("val_loss", out.loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc)
        return out.loss


_ENCODER_SIZES = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4}
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# Encoder and vision families: (the Auto class, the config's settings besides the sizes)
_HF_ENCODERS: dict[str, tuple[str, dict]] = {
    "bert": ("AutoModelForSequenceClassification", {"max_position_embeddings": 16, "num_labels": 3, **_NO_DROPOUT}),
    # (no q/k/v biases: a key bias gets a zero gradient, and its round-off alone is compared against one device's)
    "vit": ("AutoModelForImageClassification", {"image_size": 4, "patch_size": 2, "num_channels": 3, "num_labels": 3,
                                                "qkv_bias": False, **_NO_DROPOUT}),
    # its stages (the blocks split over the pipeline) return tuples that its encoder unpacks; they cannot run alone,
    # so tensor parallelism keeps them whole
    "swin": ("AutoModelForImageClassification", {"embed_dim": 8, "depths": [2, 2], "num_heads": [2, 4],
                                                 "image_size": 4, "patch_size": 1, "window_size": 2, "num_channels": 3,
                                                 "num_labels": 3, "drop_path_rate": 0.0, **_NO_DROPOUT}),
    # encoder-decoders: the decoder's blocks read the encoder's output (cross-attention) and, in T5, the position
    # biases its first block returns; BART registers its decoder's embedding norm after the layers and runs it first
    "t5": ("AutoModelForSeq2SeqLM", {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_decoder_layers": 4,
                                     "num_heads": 4, "dropout_rate": 0.0, "relative_attention_num_buckets": 8,
                                     "decoder_start_token_id": 0, "pad_token_id": 0}),
    # T5 v1.1 / FLAN-T5: a gated MLP (wi_0, wi_1 -> wo) and a head not tied to the embedding
    "flant5": ("AutoModelForSeq2SeqLM", {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2,
                                         "num_decoder_layers": 4, "num_heads": 4, "dropout_rate": 0.0,
                                         "relative_attention_num_buckets": 8, "decoder_start_token_id": 0,
                                         "pad_token_id": 0, "feed_forward_proj": "gated-gelu",
                                         "tie_word_embeddings": False}),
    "bart": ("AutoModelForSeq2SeqLM", {"d_model": 16, "encoder_layers": 2, "decoder_layers": 4,
                                       "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                       "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 16,
                                       "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                                       "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                       "decoder_start_token_id": 2, "forced_eos_token_id": None}),
    # BART's layout with LayerDrop (M2M100's and NLLB's configs default to 0.05), drawn so that it is the same on one
    # device: every decoder layer skipped while training (the encoder's output then reaches no block), none in eval
    "m2m_100": ("AutoModelForSeq2SeqLM", {"d_model": 16, "encoder_layers": 2, "decoder_layers": 4,
                                          "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                          "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 16,
                                          "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                                          "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                          "decoder_start_token_id": 2, "encoder_layerdrop": 0.0,
                                          "decoder_layerdrop": 1.0}),
    # its layers alternate global and local attention, which its forward reads from each layer (attention_type);
    # the MLM head's decoder is tied to the token embedding (across the pipeline's ends)
    "modernbert": ("AutoModelForMaskedLM", {"max_position_embeddings": 16, "local_attention": 4, "pad_token_id": 0,
                                            "bos_token_id": 2, "eos_token_id": 1, "cls_token_id": 2,
                                            "sep_token_id": 1}),
}  # fmt: skip


_HF_TYPES = {"flant5": "t5"}  # test names that are not Hugging Face model types


class HFEncoder(_Base):
    """A LightningModule holding an unmodified Hugging Face encoder or vision model: a sequence classifier (the
    label: the first token modulo 3), an image classifier (pixels made from the tokens) or a masked LM (every
    position's next token as its label); SGD (their attention-key biases get round-off gradients, which Adam would
    turn into steps)."""

    def __init__(self, arch: str, lr: float = 0.01, **kwargs):
        self.arch = arch
        super().__init__(lr=lr, optimizer="sgd", **kwargs)

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        import transformers
        from transformers import AutoConfig

        auto, settings = _HF_ENCODERS[self.arch]
        sizes = {} if self.arch in ("swin", "t5", "flant5", "bart", "m2m_100") else _ENCODER_SIZES
        config = AutoConfig.for_model(_HF_TYPES.get(self.arch, self.arch), vocab_size=32, **sizes, **settings)
        self.model = getattr(transformers, auto).from_config(config, attn_implementation="eager")

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.arch in ("vit", "swin"):  # a 3 x 4 x 4 image per sample
            pixels = torch.sin(x.to(torch.get_default_dtype())).repeat(1, 6)[:, :48].reshape(-1, 3, 4, 4)
            loss = self.model(pixel_values=pixels, labels=x[:, 0] % 3).loss
        elif self.arch == "bert":
            loss = self.model(input_ids=x, labels=x[:, 0] % 3).loss
        else:
            loss = self.model(input_ids=x, labels=y).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss


class HiddenStates(_Base):
    """An unmodified Hugging Face base model (BERT or Llama) whose step reads ``outputs.hidden_states``: a classifier
    on the mean of every layer's hidden states (the embedding's included; the label: the first token modulo 3).
    Transformers 5 records them with forward hooks on the layers, so under pipeline parallelism the stand-ins for
    other stages' layers must record them too (``core/hf_outputs.py``), with the values carried from those stages."""

    def __init__(self, arch: str = "bert", lr: float = 0.01, attentions: bool = False, **kwargs):
        self.arch, self.attentions = arch, attentions
        super().__init__(lr=lr, optimizer="sgd", **kwargs)

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from transformers import AutoConfig, AutoModel

        if self.arch == "bert":
            settings = {"max_position_embeddings": 16, **_ENCODER_SIZES, **_NO_DROPOUT}
            config = AutoConfig.for_model("bert", vocab_size=32, **settings)
        else:
            config = hf_config(self.arch)
        self.model = AutoModel.from_config(config, attn_implementation="eager")
        self.head = nn.Linear(config.hidden_size, 3)

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=x, output_hidden_states=True, output_attentions=self.attentions)
        hidden = out.hidden_states
        assert len(hidden) == self.model.config.num_hidden_layers + 1, len(hidden)
        loss = F.cross_entropy(self.head(torch.stack(hidden).mean(0).mean(1)), x[:, 0] % 3)
        if self.attentions:  # a penalty on peaked attention, every layer's (recorded inside the layers)
            assert len(out.attentions) == self.model.config.num_hidden_layers, len(out.attentions)
            loss = loss + torch.stack(out.attentions).square().mean()
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch[0]), sync_dist=True)


class RouterAux(HFCausalLM):
    """An unmodified Hugging Face Mixtral whose config asks for the routers' logits (``output_router_logits=True``):
    its loss adds the load-balancing loss over every layer's router logits, which transformers 5 records with hooks
    on the routers inside the layers; under pipeline parallelism those of other stages' layers are carried to the
    last stage (``core/hf_outputs.py``). A large coefficient, so a missing layer would show. Experts as
    ``batched_mm`` (the default ``grouped_mm`` takes no float64 on the CPU).

    That loss is a product of two means over the tokens it sees, not a mean over samples: like gradient accumulation
    on one device, a pipeline computes it per micro-batch. So the step computes it per ``chunk`` samples (the
    batch's consecutive micro-batches at dp = 1), which makes one process with the whole batch a reference."""

    # the families' names for the number of experts and the MoE MLP's width (every layer sparse)
    MOE = {
        "mixtral": {"num_local_experts": 4},
        "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
        "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 16},
        "olmoe": {"num_experts": 4},
        "gpt_oss": {"num_local_experts": 4},
        "granitemoe": {"num_local_experts": 4},
        "phimoe": {"num_local_experts": 4},
    }

    def __init__(self, arch: str = "mixtral", chunk: int = 2, **kwargs):
        super().__init__(arch, **kwargs)
        self.chunk = chunk

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.model(input_ids=c, labels=c).loss for c in x.split(self.chunk)]).mean()

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch[0]), prog_bar=True, sync_dist=True)

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from transformers import AutoModelForCausalLM

        config = hf_config(self.arch)
        config.output_router_logits, config.router_aux_loss_coef, config.num_experts_per_tok = True, 0.5, 2
        for key, value in self.MOE[self.arch].items():
            setattr(config, key, value)
        self.model = AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", experts_implementation="batched_mm"
        )


MODELS = {
    "mlp": TinyMLP,
    "gpt": TinyGPT,
    "nano": NanoGPT,
    "nanotied": lambda **kw: NanoGPT(tie=True, example=True, **kw),
    "nanockpt": lambda **kw: NanoGPT(checkpointed=True, **kw),
    "llama": lambda **kw: HFCausalLM("llama", **kw),
    "llamatied": lambda **kw: HFCausalLM("llama", tied=True, **kw),
    "qwen3": lambda **kw: HFCausalLM("qwen3", **kw),
    "gpt2": lambda **kw: HFCausalLM("gpt2", **kw),
    "opt": lambda **kw: HFCausalLM("opt", tied=True, **kw),  # as OPT's checkpoints: the head tied to the embedding
    "stablelm": lambda **kw: HFCausalLM("stablelm", **kw),  # no tensor-parallel plan of its own
    # its plan leaves out the MLP's learned activation (xIELU's alpha_p / alpha_n), which acts on sharded features
    "apertus": lambda **kw: HFCausalLM("apertus", **kw),
    "gptj": lambda **kw: HFCausalLM("gptj", **kw),
    "falcon": lambda **kw: HFCausalLM("falcon", **kw),  # no plan of its own; Linear subclasses; grouped fused qkv
    # a plan of its own for the embedding and the head only: the blocks get the automatic plan
    "hunyuan": lambda **kw: HFCausalLM("hunyuan_v1_dense", **kw),
    "rotary": RotaryGPT,
    "plain": PlainMLP,
    "bertcls": lambda **kw: HFEncoder("bert", **kw),
    "vit": lambda **kw: HFEncoder("vit", **kw),
    "modernbert": lambda **kw: HFEncoder("modernbert", **kw),
    "swin": lambda **kw: HFEncoder("swin", **kw),
    "t5": lambda **kw: HFEncoder("t5", **kw),
    "flant5": lambda **kw: HFEncoder("flant5", **kw),
    "m2m_100": lambda **kw: HFEncoder("m2m_100", **kw),
    "skipgpt": SkippingGPT,
    "bert-hs": lambda **kw: HiddenStates("bert", **kw),
    "llama-hs": lambda **kw: HiddenStates("llama", **kw),
    "llama-attn": lambda **kw: HiddenStates("llama", attentions=True, **kw),
    "mixtral-aux": RouterAux,
    "bart": lambda **kw: HFEncoder("bart", **kw),
}
TOKEN_MODELS = {
    "gpt",
    "nano",
    "nanotied",
    "nanockpt",
    "llama",
    "llamatied",
    "qwen3",
    "gpt2",
    "opt",
    "stablelm",
    "apertus",
}
TOKEN_MODELS |= {
    "gptj",
    "falcon",
    "hunyuan",
    "rotary",
    "bertcls",
    "vit",
    "modernbert",
    "swin",
    "t5",
    "flant5",
    "bart",
    "m2m_100",
    "skipgpt",
    "bert-hs",
    "llama-hs",
    "llama-attn",
    "mixtral-aux",
}


def dataset(model: str, n: int = 64, seed: int = 0) -> Dataset:
    """Deterministic synthetic data for a model name."""
    g = torch.Generator().manual_seed(seed)
    if model not in TOKEN_MODELS:
        x = torch.randn(n, 16, generator=g)
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return TensorDataset(x, y)
    tokens = torch.randint(0, TinyGPT.vocab, (n, TinyGPT.block + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loader(model: str, batch_size: int, n: int = 64) -> DataLoader:
    return DataLoader(dataset(model, n), batch_size=batch_size, shuffle=False)


class OrderedData(L.LightningDataModule):
    """Unshuffled data, split over data-parallel replicas with the strategy's sampler arguments.

    Lightning's own distributed sampler shuffles training data; parity with a single-device run needs the
    same order, so the tests build the ``DistributedSampler`` themselves (use_distributed_sampler=False).
    Replica r reads samples r, r + dp, ...: the union of the replicas' i-th batches is the reference's i-th.
    """

    def __init__(self, model: str, batch_size: int, n: int = 64, val_n: int = 0):
        super().__init__()
        self.model, self.batch_size, self.n, self.val_n = model, batch_size, n, val_n

    def _loader(self, ds: Dataset) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(dataset(self.model, self.n))

    def val_dataloader(self) -> DataLoader:
        return self._loader(dataset(self.model, self.val_n, seed=1))

    def test_dataloader(self) -> DataLoader:
        return self._loader(dataset(self.model, self.val_n, seed=2))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(dataset(self.model, self.val_n, seed=2))


def same_start(model: nn.Module, init: Path) -> None:
    """Give every run of a comparison the same initial weights: the first run saves its model's to ``init``, the
    later ones (one device and each layout) load them."""
    if init.exists():
        model.load_state_dict(torch.load(init))
    else:
        torch.save(model.state_dict(), init)


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU ``Trainer`` for the test scripts: no logger, progress bar, checkpointing, model summary or sanity
    validation; ``kwargs`` add to or override these."""
    settings = dict(
        accelerator="cpu",
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


class LossSteps(L.LightningModule):
    """Steps around a subclass's ``_loss(batch)``: training logs and returns it and keeps each step's logged value
    (``train_losses``), validation logs it; AdamW over the trainable parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.train_losses: list[float] = []

    def _loss(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.train_losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)


class MetricMLP(TinyMLP):
    """TinyMLP with torchmetrics accuracy in training (logged per step and epoch) and evaluation."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from torchmetrics.classification import MulticlassAccuracy

        self.train_acc = MulticlassAccuracy(num_classes=4, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=4, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=4, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.test_acc.update(logits, y)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).softmax(-1)


class CutInsideBlocks:
    """Puts every stage boundary inside a layer (after a block's attention half, or between the head's norm and its
    projection), where the compute partitioner puts one when that balances the stages better (``pieces.py``)."""

    split_layers = True

    def __call__(self, units, num_stages):
        cuts = [i + 1 for i, (name, _) in enumerate(units) if name.endswith("#0-1")]
        assert len(cuts) >= num_stages - 1, f"{[n for n, _ in units]}: too few cuts for {num_stages} stages"
        chosen = [cuts[round(k * (len(cuts) - 1) / max(num_stages - 2, 1))] for k in range(num_stages - 1)]
        bounds = [0, *sorted(set(chosen)), len(units)]
        assert len(bounds) == num_stages + 1, bounds
        return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
