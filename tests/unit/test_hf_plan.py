"""The tensor-parallel plans :func:`hf_tp_plan` reads from tiny Hugging Face models (in-process, no ranks).

Numerics of the resulting styles are checked with 2 ranks in ``tests/test_hf_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from lightning_3d.core.tensor_parallel.hf_plan import (
    GPT2_ATTENTION_NOTE,
    declared_tp_plan,
    find_hf_models,
    generic_name,
    hf_tp_plan,
)
from lightning_3d.core.tensor_parallel.hf_styles import HFColwiseParallel, HFRowwiseParallel, ReplicatedGradAllReduce

hf_logging.set_verbosity_error()

LLAMA = dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


class Root(nn.Module):
    """Stands for a LightningModule holding the model as ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def tiny(kind: str, vocab: int = 64, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        kwargs = dict(n_embd=16, n_head=4, n_layer=2, n_positions=32, bos_token_id=0, eos_token_id=0) | kwargs
    elif kind == "qwen3":
        kwargs = LLAMA | dict(head_dim=4) | kwargs
    else:
        kwargs = LLAMA | kwargs
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=vocab, **kwargs))


def styles(plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {name: entry.style for name, entry in plan.entries.items()}


def layer_entries(prefix: str, layers: int, per_layer: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}.layers.{i}.{k}": v for i in range(layers) for k, v in per_layer.items()}


LLAMA_LAYER = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def test_llama_plan_is_the_models_own_with_concrete_root_relative_names() -> None:
    plan = hf_tp_plan(Root(tiny("llama")), tp=2)
    assert plan is not None
    assert styles(plan) == {
        "model.model.embed_tokens": "embedding_rowwise",
        **layer_entries("model.model", 2, LLAMA_LAYER),
        "model.lm_head": "colwise_gather_output",
    }
    assert list(plan.entries)[:2] == ["model.model.embed_tokens", "model.model.layers.0.self_attn.q_proj"]
    assert plan.models == {"model": "LlamaForCausalLM"}
    assert plan.tied == [] and plan.notes == {}
    assert plan.entries["model.model.layers.1.mlp.up_proj"].source == (
        "LlamaForCausalLM tp_plan 'model.layers.*.mlp.up_proj'"
    )


def test_styles_are_torch_parallel_styles_with_the_right_layouts() -> None:
    plan = hf_tp_plan(Root(tiny("llama")), tp=2)
    assert plan is not None
    made = plan.styles
    assert set(made) == set(plan.entries)
    q = made["model.model.layers.0.self_attn.q_proj"]
    assert isinstance(q, HFColwiseParallel) and q.output_layouts == (Shard(-1),)
    o = made["model.model.layers.0.self_attn.o_proj"]
    assert isinstance(o, HFRowwiseParallel) and o.input_layouts == (Shard(-1),)
    head = made["model.lm_head"]
    assert isinstance(head, HFColwiseParallel) and head.output_layouts == (Replicate(),)
    emb = made["model.model.embed_tokens"]
    assert isinstance(emb, HFRowwiseParallel) and emb.input_layouts == (Replicate(),)
    # one tied-parameter registry for all styles of a plan, fresh objects per call
    assert q.ties is head.ties is plan.ties
    assert plan.styles["model.lm_head"] is not head
    # relative to a submodule, as a pipeline stage applies it
    sub = plan.styles_for("model.model.layers.1")
    assert set(sub) == set(LLAMA_LAYER)


def test_qwen3_norms_get_grad_allreduce_and_tied_embedding_is_recorded() -> None:
    plan = hf_tp_plan(Root(tiny("qwen3", tie_word_embeddings=True)), tp=2)
    assert plan is not None
    per_layer = dict(LLAMA_LAYER)
    per_layer |= {
        "self_attn.q_norm": "replicated_with_grad_allreduce",
        "self_attn.k_norm": "replicated_with_grad_allreduce",
    }
    expected = {"model.model.embed_tokens": "embedding_rowwise", **layer_entries("model.model", 2, per_layer)}
    expected["model.lm_head"] = "colwise_gather_output"
    assert styles(plan) == expected
    assert isinstance(plan.styles["model.model.layers.0.self_attn.k_norm"], ReplicatedGradAllReduce)
    assert plan.tied == [("model.model.embed_tokens.weight", "model.lm_head.weight")]


def test_a_learned_activation_between_the_mlp_pair_gets_its_gradient_summed() -> None:
    # Apertus' plan shards up_proj / down_proj but leaves out act_fn (xIELU, learned alpha_p / alpha_n), which acts on
    # the rank's share of the hidden features: without the sum its gradient would be a partial one
    plan = hf_tp_plan(Root(tiny("apertus", head_dim=4)), tp=2)
    assert plan is not None
    got = styles(plan)
    for i in range(2):
        assert got[f"model.model.layers.{i}.mlp.act_fn"] == "replicated_with_grad_allreduce"
        assert got[f"model.model.layers.{i}.mlp.up_proj"] == "colwise"
        assert "learned activation" in plan.entries[f"model.model.layers.{i}.mlp.act_fn"].source
    assert isinstance(plan.styles["model.model.layers.0.mlp.act_fn"], ReplicatedGradAllReduce)
    # an activation without parameters (Llama's SiLU) is left alone
    assert not any(name.endswith("act_fn") for name in styles(hf_tp_plan(Root(tiny("llama")), tp=2)))


def test_gpt2_gets_a_conv1d_plan_with_attention_replicated_and_noted() -> None:
    plan = hf_tp_plan(Root(tiny("gpt2")), tp=2)
    assert plan is not None
    assert styles(plan) == {
        "model.transformer.wte": "embedding_rowwise",
        "model.transformer.h.0.mlp.c_fc": "colwise",
        "model.transformer.h.0.mlp.c_proj": "rowwise",
        "model.transformer.h.1.mlp.c_fc": "colwise",
        "model.transformer.h.1.mlp.c_proj": "rowwise",
        "model.lm_head": "colwise_gather_output",
    }
    assert plan.notes == {f"model.transformer.h.{i}.attn": GPT2_ATTENTION_NOTE for i in range(2)}
    assert plan.tied == [("model.transformer.wte.weight", "model.lm_head.weight")]
    assert "lightning_3d plan" in plan.entries["model.transformer.h.0.mlp.c_fc"].source


def test_gpt2_with_an_indivisible_vocabulary_keeps_embedding_and_head_replicated() -> None:
    plan = hf_tp_plan(tiny("gpt2", vocab=65), tp=2)
    assert plan is not None
    assert "transformer.wte" not in plan.entries and "lm_head" not in plan.entries
    assert "vocabulary of 65 not divisible by tp=2" in plan.notes["transformer.wte"]
    assert plan.tied == []  # both replicated: the pair is untouched
    assert styles(plan)["transformer.h.1.mlp.c_proj"] == "rowwise"


def test_model_as_root_has_names_without_prefix() -> None:
    plan = hf_tp_plan(tiny("llama"), tp=2)
    assert plan is not None
    assert "model.layers.0.self_attn.q_proj" in plan.entries and "lm_head" in plan.entries
    assert plan.models == {"": "LlamaForCausalLM"}


@pytest.mark.parametrize(
    ("kwargs", "vocab", "tp", "message"),
    [
        ({}, 64, 3, "config.num_attention_heads = 4 is not divisible by tp=3. tp values that work: 1, 2."),
        ({}, 64, 4, "config.num_key_value_heads = 2 is not divisible by tp=4. tp values that work: 1, 2."),
        (
            dict(num_key_value_heads=4, intermediate_size=34),
            64,
            4,
            "config.intermediate_size = 34 is not divisible by tp=4. tp values that work: 1, 2.",
        ),
        (
            dict(num_key_value_heads=4),
            66,
            4,
            "config.vocab_size = 66 is not divisible by tp=4. tp values that work: 1, 2.",
        ),
    ],
)
def test_indivisible_sizes_name_the_quantity_and_the_working_tp(
    kwargs: dict, vocab: int, tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM") as info:
        hf_tp_plan(Root(tiny("llama", vocab=vocab, **kwargs)), tp=tp)
    assert message in str(info.value)


def test_unsupported_style_is_refused_naming_style_and_module() -> None:
    model = tiny("llama")
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="packed_colwise") as info:
        hf_tp_plan(model, tp=2)
    assert "(module model.layers.0.mlp.gate_proj, model.layers.1.mlp.gate_proj" in str(info.value)
    assert "model.layers.*.mlp.gate_proj" in str(info.value)
    # Llama 4's experts: the entry names a parameter (a 3-D tensor of every expert's weights)
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.gate_proj.weight": "packed_rowwise"}
    model.tp_plan.pop("model.layers.*.mlp.gate_proj")
    refused = r"'model.layers.\*.mlp.gate_proj.weight' \(a parameter\): style 'packed_rowwise'"
    with pytest.raises(ValueError, match=refused):
        hf_tp_plan(model, tp=2)


def test_style_on_the_wrong_kind_of_module_is_refused() -> None:
    model = tiny("llama")
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.down_proj": "embedding_rowwise"}
    with pytest.raises(ValueError, match=r"'embedding_rowwise' on model.layers.0.mlp.down_proj \(Linear\)"):
        hf_tp_plan(model, tp=2)


def test_tied_pair_sharded_inconsistently_is_left_replicated_or_refused() -> None:
    model = tiny("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # set past the setter: transformers before 5.25 refuses "replicate" there
    model._tp_plan = {**model.tp_plan, "model.embed_tokens": "replicate"}
    plan = hf_tp_plan(model, tp=2)
    assert plan is not None
    assert "lm_head" not in plan.entries and "model.embed_tokens" not in plan.entries
    assert "tied to model.embed_tokens.weight, lm_head.weight" in plan.notes["lm_head"]
    assert "model.embed_tokens" in plan.notes  # the model's own "replicate" entry
    # a head whose output is sharded cannot just be left unsharded: refused
    model._tp_plan = {**model.tp_plan, "lm_head": "colwise"}
    with pytest.raises(ValueError, match="Tied parameters"):
        hf_tp_plan(model, tp=2)


def test_no_hf_model_or_no_plan_gives_none() -> None:
    assert hf_tp_plan(nn.Sequential(nn.Linear(4, 4)), tp=2) is None
    model = tiny("llama")
    model.tp_plan = None  # emptied by the user
    assert declared_tp_plan(model) == {}
    assert hf_tp_plan(model, tp=2) is None
    with pytest.raises(ValueError, match="positive int"):
        hf_tp_plan(model, tp=0)


def test_declared_plan_falls_back_to_class_and_config_plans() -> None:
    model = tiny("llama")
    model._tp_plan = None  # as before post_init
    plan = declared_tp_plan(model)
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"


def test_plans_of_releases_before_the_embedding_rule_get_it() -> None:
    model = tiny("llama")
    # what transformers before 5.25 made (5.17): neither the base model's plan nor the head's names embed_tokens
    model.model._tp_plan = {k: v for k, v in model.model._tp_plan.items() if k != "embed_tokens"}
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if k != "model.embed_tokens"}
    assert declared_tp_plan(model)["model.embed_tokens"] == "embedding_rowwise"
    assert declared_tp_plan(model.model)["embed_tokens"] == "embedding_rowwise"
    assert hf_tp_plan(model, tp=2).entries["model.embed_tokens"].style == "embedding_rowwise"
    # a plan the user set is theirs: nothing added
    model.tp_plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    assert declared_tp_plan(model) == dict(model.tp_plan)
    # a model whose embedding is not an nn.Embedding gets nothing
    model = tiny("llama")
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if k != "model.embed_tokens"}
    model.model._tp_plan = {}
    model.model.embed_tokens = nn.Identity()
    assert "model.embed_tokens" not in declared_tp_plan(model)


def test_find_hf_models_returns_the_outermost_only() -> None:
    root = nn.Module()
    root.a = tiny("llama")
    root.b = nn.Sequential(tiny("gpt2"))
    assert [(name, type(m).__name__) for name, m in find_hf_models(root)] == [
        ("a", "LlamaForCausalLM"),
        ("b.0", "GPT2LMHeadModel"),
    ]
    plan = hf_tp_plan(root, tp=2)
    assert plan is not None
    assert plan.models == {"a": "LlamaForCausalLM", "b.0": "GPT2LMHeadModel"}
    assert "a.model.layers.1.mlp.down_proj" in plan.entries and "b.0.transformer.h.1.mlp.c_fc" in plan.entries


def test_generic_name_replaces_layer_numbers_only() -> None:
    assert generic_name("model.layers.12.mlp.w1") == "model.layers.*.mlp.w1"
    assert generic_name("h.0") == "h.*"
    assert generic_name("w2") == "w2"


def test_a_lora_layers_style_goes_to_its_base_and_the_adapter_on_the_sharded_side() -> None:
    """PEFT wraps q_proj / o_proj in LoRA layers: a column-parallel base shards ``lora_B`` with it (``lora_A`` stays
    replicated), a row-parallel base shards ``lora_A`` (``lora_B`` replicated); layers without adapters as before."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    got = styles(hf_tp_plan(Root(peft), tp=2))
    layer = "model.base_model.model.model.layers.0"
    assert got[f"{layer}.self_attn.q_proj.base_layer"] == got[f"{layer}.self_attn.q_proj.lora_B.default"] == "colwise"
    assert got[f"{layer}.self_attn.o_proj.base_layer"] == got[f"{layer}.self_attn.o_proj.lora_A.default"] == "rowwise"
    assert (
        f"{layer}.self_attn.q_proj.lora_A.default" not in got and f"{layer}.self_attn.o_proj.lora_B.default" not in got
    )
    assert f"{layer}.self_attn.q_proj" not in got and got[f"{layer}.self_attn.k_proj"] == "colwise"


def test_lora_on_a_sharded_embedding_shards_its_base_and_keeps_the_adapters_whole() -> None:
    """PEFT's embedding adapters are parameters its forward uses directly: the vocabulary-parallel style goes to the
    base (whose output is whole) and the adapters stay whole (refused until 2026-12-06)."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["embed_tokens"]))
    got = styles(hf_tp_plan(Root(peft), tp=2))
    embed = "model.base_model.model.model.embed_tokens"
    assert got[f"{embed}.base_layer"] == "embedding_rowwise"
    assert not [name for name in got if name.startswith(embed) and name != f"{embed}.base_layer"], got


def test_lora_on_an_embedding_under_a_style_with_a_sharded_output_is_refused() -> None:
    from peft import LoraConfig, get_peft_model

    from lightning_3d.core.tensor_parallel import hf_plan

    peft = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["embed_tokens"]))
    entries = {"model.base_model.model.model.embed_tokens": hf_plan.HFEntry("embedding_rowwise", "test")}
    hf_plan._with_adapters(Root(peft), entries, "test")  # whole output: accepted
    with pytest.MonkeyPatch.context() as patch:  # a style whose output would be sharded: refused, naming the way out
        patch.setattr(hf_plan, "_SELF_CONTAINED", frozenset())
        with pytest.raises(ValueError, match=r"is a LoRA layer on an embedding .* leave the embedding out of the LoRA"):
            hf_plan._with_adapters(Root(peft), entries, "test")


def test_a_modules_to_save_wrapper_gives_its_style_to_the_original_and_each_copy() -> None:
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    got = styles(hf_tp_plan(Root(peft), tp=2))
    head = "model.base_model.model.lm_head"
    assert got[f"{head}.original_module"] == got[f"{head}.modules_to_save.default"] == "colwise_gather_output"
    assert head not in got
