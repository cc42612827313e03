"""The Hugging Face Llama the benchmarks B2..B5 also run on (``--model hf_llama`` / ``hf_llama_tied``).

An unchanged ``LlamaForCausalLM`` (grouped-query attention) inside the example's
:class:`lightning_3d_examples.hf_llama.HFCausalLM`, built from a config (nothing downloaded): hidden 256, 8 heads,
4 key/value heads (head dim 32), intermediate 688, vocabulary 2048, 8 layers, sequence 128, fp32. Every size the
Hugging Face tensor-parallel plan splits divides by tp = 2. ``hf_llama_tied`` is the same model with
``tie_word_embeddings=True`` (the LM head shares the input embedding's matrix, held on both end stages).

What a rank holds is computed here independently of the strategy (its stage split and its tensor-parallel plan):
:func:`llama_stage` assigns a parameter to its stage by name (embedding first, layers uniformly, final norm and
head last), :func:`llama_local_numel` applies the plan Llama declares (``LlamaConfig.base_model_tp_plan`` and
``LlamaForCausalLM._tp_plan``): embedding and LM head vocabulary-parallel, q/k/v/gate/up column-parallel (weight
and bias split), o/down row-parallel (weight split, bias whole), RMSNorm weights whole. :func:`llama_comm_formulas`
is the communication one step should do under that plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

MODEL_NAMES: tuple[str, ...] = ("hf_llama", "hf_llama_tied")
"""The ``--model`` values of the Llama variants (``gpt``, the default, is the example GPT)."""

LLAMA_MODEL: dict[str, Any] = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "num_hidden_layers": 8,
    "vocab_size": 2048,
    "block_size": 128,
}
"""The benchmark Llama (``HFCausalLM`` keyword arguments besides ``preset``): GQA, 2 q heads per kv head."""

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "block_size": 16,
}
"""A tiny Llama for the plumbing tests (``--tiny``)."""

COLWISE: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Column-parallel Linears of the Llama plan: weight and bias split on the output features."""
ROWWISE: tuple[str, ...] = ("o_proj", "down_proj")
"""Row-parallel Linears: weight split on the input features, bias whole (added once after the all-reduce)."""
VOCAB: tuple[str, ...] = ("embed_tokens", "lm_head")
"""Vocabulary-parallel: the embedding (``embedding_rowwise``) and the head (``colwise_gather_output``), weight dim 0."""

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def check_model(model: str) -> str:
    """``model`` if it is a Llama variant name; raises ``ValueError`` naming the choices otherwise."""
    if model not in MODEL_NAMES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES)}")
    return model


def llama_config(model: str, tiny: bool = False) -> dict[str, Any]:
    """``HFCausalLM`` keyword arguments of a variant (``preset`` included)."""
    config = dict(TINY_LLAMA if tiny else LLAMA_MODEL)
    config["tie_word_embeddings"] = check_model(model) == "hf_llama_tied"
    return {"preset": "tiny" if tiny else "small", **config}


def build_llama(config: dict[str, Any], seed: int = 0, build: bool = True) -> Any:
    """``HFCausalLM(**config)``, its Llama built (``configure_model``) from ``seed`` when ``build``."""
    import torch

    from lightning_3d_examples.hf_llama import HFCausalLM

    torch.manual_seed(seed)
    module = HFCausalLM(**config)
    if build:
        module.configure_model()
    return module


def reference_parameters(config: dict[str, Any], with_aliases: bool = True) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the unsplit model with its full shape, built on the meta device (nothing is
    allocated); ``with_aliases``: a tied weight under each of its names (else once)."""
    import torch

    module = build_llama(config, build=False)
    with torch.device("meta"):
        module.configure_model()
    return {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=not with_aliases)}


def llama_sizes(config: dict[str, Any]) -> dict[str, int]:
    """Hidden size ``h``, sequence ``s``, vocabulary ``v``, layers ``L``, heads and kv heads of a config."""
    return {
        "h": int(config["hidden_size"]),
        "s": int(config["block_size"]),
        "v": int(config["vocab_size"]),
        "L": int(config["num_hidden_layers"]),
        "heads": int(config["num_attention_heads"]),
        "kv_heads": int(config["num_key_value_heads"]),
        "ffn": int(config["intermediate_size"]),
    }


def llama_stage(name: str, n_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter ``name``: the embedding on the first, layer ``i`` on stage
    ``i // (n_layers / pp)`` (uniform split), the final norm and the LM head on the last."""
    assert n_layers % pp == 0, (n_layers, pp)
    found = _LAYER.search(name)
    if found:
        return int(found.group(1)) // (n_layers // pp)
    module = name.rpartition(".")[0]
    if module.endswith("embed_tokens"):
        return 0
    if module.endswith(("model.norm", "lm_head")):
        return pp - 1
    raise ValueError(f"no stage rule for {name!r}")


def llama_local_numel(name: str, shape: Sequence[int], tp: int) -> int:
    """Elements one tensor-parallel rank holds of parameter ``name`` under Llama's own plan."""
    full = math.prod(shape)
    module, _, leaf = name.rpartition(".")
    kind = module.rpartition(".")[2]
    sharded = kind in COLWISE or kind in VOCAB or (kind in ROWWISE and leaf == "weight")
    if tp > 1 and sharded:
        assert full % tp == 0, (name, shape, tp)
        return full // tp
    return full


def owned_llama(params: dict[str, tuple[int, ...]], n_layers: int, pp: int, stage: int) -> dict[str, tuple[int, ...]]:
    """The parameters (all names, tied aliases included) stage ``stage`` holds."""
    return {n: s for n, s in params.items() if llama_stage(n, n_layers, pp) == stage}


def tied_local_numel(params: dict[str, tuple[int, ...]], tp: int, stage: int, pp: int, tied: bool) -> int:
    """Elements of the tied embedding / head weight one end-stage rank holds (0 untied or in the middle)."""
    if not tied or stage not in (0, pp - 1):
        return 0
    name = next(n for n in params if n.rpartition(".")[0].endswith("embed_tokens" if stage == 0 else "lm_head"))
    return llama_local_numel(name, params[name], tp)


def llama_comm_formulas(
    *, b: int, s: int, h: int, v: int, tp: int, m: int, layers: int, first: bool, last: bool
) -> dict[str, float]:
    """The collectives one training step of one pipeline stage should issue under Llama's tensor-parallel plan.

    Per transformer layer and micro-batch (Megatron's count): forward, one all-reduce of ``b s h`` after
    ``o_proj`` and one after ``down_proj`` (row-parallel outputs); backward, one all-reduce of ``b s h`` for the
    input gradient of q/k/v (the three column-parallel Linears read one input, converted once, so their partial
    input gradients add up before one all-reduce) and one for gate/up. With grouped-query attention k/v are
    narrower (``kv_heads * head_dim`` outputs), which changes only the local matmuls: no collective has the
    k/v width. The first stage adds the vocabulary-parallel embedding's forward all-reduce of ``b s h`` (no
    backward collective: token ids have no gradient); the last stage adds the LM head's forward all-gather of its
    ``b s v/tp`` logits and the backward all-reduce of its input gradient, ``b s h``. The final RMSNorm is
    replicated: nothing.

    Args:
        b, s, h, v: sequences per micro-batch, sequence length, hidden size, vocabulary.
        tp: tensor-parallel size; m: micro-batches; layers: transformer layers on the stage.
        first, last: whether the stage is the first / last.

    Returns:
        ``{name: value}``: counts per step (all micro-batches) and element sizes per call.
    """
    bsh = b * s * h
    return {
        "tp_fwd_all_reduce_calls": m * (2 * layers + int(first)),
        "tp_bwd_all_reduce_calls": m * (2 * layers + int(last)),
        "tp_fwd_all_gather_calls": m * int(last),
        "tp_fwd_all_reduce_elements": m * (2 * layers + int(first)) * bsh,
        "tp_bwd_all_reduce_elements": m * (2 * layers + int(last)) * bsh,
        "tp_fwd_all_gather_elements": m * int(last) * b * s * v // tp,
        "layer_fwd_all_reduces_per_micro_batch": 2,
        "layer_bwd_all_reduces_per_micro_batch": 2,
        "all_reduce_elements_per_call": bsh,
    }
