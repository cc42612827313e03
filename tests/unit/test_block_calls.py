"""What a model's forward hands its blocks (``lightning_3d/core/block_calls.py``), and the automatic tensor-parallel
plan of a model whose blocks take more than the hidden states (``parallelize.plan_model``)."""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_3d.core.block_calls import ArgSpec, BlocksWithArguments, block_calls, first_calls
from lightning_3d.core.parallelize import plan_model
from lightning_3d.core.tensor_parallel.styles import style_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import NanoGPT, RotaryGPT


def test_block_calls_record_the_rotary_tables_and_leave_the_model_untouched():
    model = RotaryGPT(build="init")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    calls = block_calls(model, list(model.blocks), torch.zeros(3, 5, dtype=torch.long))
    assert not isinstance(calls, str), calls
    assert len(calls) == 4
    for call in calls:
        assert call.hidden == ArgSpec((3, 5, 16), torch.float32)
        assert call.args == (ArgSpec((5, 4), torch.float32), ArgSpec((5, 4), torch.float32))
        assert call.kwargs == {} and call.takes_more()
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(b._forward_pre_hooks for b in model.blocks)  # hooks removed


def test_block_calls_with_keyword_arguments_and_tuple_outputs_run_like_the_model():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, *, scale, flag=None):
            return (self.fc(x) * scale, "extra")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x, scale=torch.full((4,), 2.0), flag="on")[0]
            return x

    model = Model()
    calls = block_calls(model, list(model.layers), {"x": torch.randn(2, 4)})
    assert not isinstance(calls, str), calls
    assert calls[0].kwargs == {"scale": ArgSpec((4,), torch.float32), "flag": "on"}
    view = BlocksWithArguments(OrderedDict(model.layers.named_children()), calls, torch.device("cpu"))
    assert [n for n, _ in view.named_children()] == ["0", "1"]
    x = torch.randn(2, 4)
    # the stand-ins are zeros: the view runs the blocks as the model does, on zero scales
    assert torch.equal(view(x), torch.zeros(2, 4))


def test_block_calls_say_why_when_they_cannot_be_recorded():
    class Hidden(nn.Module):
        def forward(self, x=None):
            return x

    class ByKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Hidden()])

        def forward(self, x):
            return self.layers[0](x=x)

    model = ByKeyword()
    assert "without the hidden states as its first positional argument" in block_calls(
        model, list(model.layers), torch.zeros(2)
    )

    class Skips(ByKeyword):
        def forward(self, x):
            return x

    model = Skips()
    assert block_calls(model, list(model.layers), torch.zeros(2)) == "forward(example_input_array) did not call block 0"

    class DataDependent(ByKeyword):
        def forward(self, x):
            if x.sum() > 0:  # a value: unknown on fake tensors
                return self.layers[0](x)
            return x

    model = DataDependent()
    assert block_calls(model, list(model.layers), torch.ones(2)).startswith(
        "forward(example_input_array) did not run on fake tensors"
    )


def _styles(plan) -> dict[str, str]:
    return {name: entry.style for name, entry in plan.tp_plan.entries.items()}


def test_the_automatic_plan_shards_blocks_called_with_the_rotary_tables():
    model = RotaryGPT(build="init")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not run the body" warning
        styles = _styles(plan_model(model, tp=2, pp=2))
    for i in range(4):
        for name in ("wq", "wk", "wv", "w1", "w3"):
            assert styles[f"{i}.{name}"] == "colwise"
        assert styles[f"{i}.wo"] == styles[f"{i}.w2"] == "rowwise"
    assert len(styles) == 28


def test_without_an_example_such_blocks_stay_replicated_with_the_reason():
    model = RotaryGPT(build="init")
    model.example_input_array = None
    with pytest.warns(UserWarning, match="missing 2 required positional arguments: 'cos' and 'sin'"):
        plan = plan_model(model, tp=2, pp=2)
    assert _styles(plan) == {}
    assert "set the LightningModule's example_input_array" in plan.tp_plan.notes["0.wq"]


def test_blocks_of_one_tensor_keep_the_plain_analysis():
    model = NanoGPT(build="init")
    assert model.example_input_array is None
    styles = _styles(plan_model(model, tp=2, pp=2))
    assert styles["0.q_proj"] == "colwise" and styles["0.out_proj"] == "rowwise"


class _LateNorm(nn.Module):
    """An OPT-like decoder: the final norm registered before the blocks and called after them; ``shared`` called
    both before and after them (it stays with the first stage)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.shared = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8)
        self.fail = fail

    def forward(self, idx):
        x = self.shared(self.embed(idx))
        if self.fail:
            x = x[x.sum(-1) > 0]  # data-dependent shape: does not run on fake tensors
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(self.shared(x)))


OUTSIDE = ["embed", "shared", "norm"]


def test_first_calls_finds_modules_registered_before_the_blocks_but_run_after_them():
    model = _LateNorm()
    rng = torch.get_rng_state()
    example = torch.zeros(2, 3, dtype=torch.long)
    assert first_calls(model, "layers", OUTSIDE, example)[1] == {"norm"}
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed
    # nothing to run (no example, no Hugging Face model), or a forward that fails on fake tensors: registration
    # order (the stage boundary check names a misplaced module later)
    assert first_calls(model, "layers", OUTSIDE, None)[1] == set()
    assert first_calls(_LateNorm(fail=True), "layers", OUTSIDE, example)[1] == set()


def test_a_hugging_face_model_without_an_example_runs_on_its_dummy_inputs():
    pytest.importorskip("transformers")
    from models import HFCausalLM

    module = HFCausalLM("opt", tied=True, build="init")
    assert module.example_input_array is None
    decoder = "model.model.decoder"
    outside = [f"{decoder}.{n}" for n in ("embed_tokens", "embed_positions", "project_out", "project_in")]
    outside.append(f"{decoder}.final_layer_norm")
    found = first_calls(module, f"{decoder}.layers", outside, None)[1]
    assert found == {f"{decoder}.project_out", f"{decoder}.final_layer_norm"}
    plan = plan_model(module, tp=1, pp=2)
    assert plan.split.first == [f"{decoder}.{n}" for n in ("embed_tokens", "embed_positions", "project_in")]
    assert plan.split.last == [f"{decoder}.project_out", f"{decoder}.final_layer_norm", "model.lm_head"]
    assert plan.split.stage_of(f"{decoder}.final_layer_norm") == 1


def test_an_encoder_decoders_module_registered_after_the_blocks_but_run_before_them_goes_first():
    """BART's decoder registers ``layernorm_embedding`` after its layers and runs it before them: by registration it
    went with the last stage, and the stage boundary check refused the model at pp=2 (stage 0's part of the forward
    calls it). Found on the model's dummy inputs, it goes with the first stage."""
    pytest.importorskip("transformers")
    from models import HFEncoder

    module = HFEncoder("bart")
    module.configure_model()
    decoder = "model.model.decoder"
    before, after = first_calls(module, f"{decoder}.layers", [f"{decoder}.layernorm_embedding", "model.lm_head"], None)
    assert before == {f"{decoder}.layernorm_embedding"} and after == {"model.lm_head"}
    plan = plan_model(module, tp=1, pp=2)
    assert plan.split.stage_of(f"{decoder}.layernorm_embedding") == 0
    assert plan.split.stage_of("model.model.encoder") == 0 and plan.split.stage_of("model.lm_head") == 1


def test_a_hugging_face_model_without_a_plan_or_an_example_is_analysed_on_its_dummy_inputs():
    """StableLM has no tensor-parallel plan of its own and its decoder layers take the rotary tables and the mask:
    its blocks run as its forward calls them on its dummy_inputs, and its embedding and head are planned too."""
    pytest.importorskip("transformers")
    from models import HFCausalLM

    module = HFCausalLM("stablelm", build="init")
    assert module.example_input_array is None
    plan = plan_model(module, tp=2, pp=2)
    assert plan.hf_plan is None
    styles = _styles(plan)
    assert styles["0.mlp.gate_proj"] == styles["0.mlp.up_proj"] == "colwise"
    assert styles["0.mlp.down_proj"] == "rowwise"
    # its attention reshapes by its whole head counts (`view(bsz, q_len, self.num_heads, self.head_dim)`): sharded,
    # with those counts set to one rank's heads
    assert styles["0.self_attn.q_proj"] == styles["0.self_attn.k_proj"] == "colwise"
    assert styles["0.self_attn.o_proj"] == "rowwise"
    assert plan.tp_plan.entries["0.self_attn"].style.counts == {"num_heads": 4, "num_key_value_heads": 2}
    outer = {name: entry.style for name, entry in plan.outer_plan.entries.items()}
    assert outer == {"model.model.embed_tokens": "vocab", "model.lm_head": "colwise_gather"}


def test_a_hugging_face_plan_of_the_embedding_and_head_only_keeps_those_and_analyses_the_blocks():
    # HunYuan's plan (like LFM2's and GPT-OSS's) names model.embed_tokens and lm_head only: its blocks get the
    # automatic plan, as a model without a plan does, and the two named modules keep the plan's layouts
    pytest.importorskip("transformers")
    from lightning_3d.core.tensor_parallel.hf_plan import declared_tp_plan

    from models import HFCausalLM

    module = HFCausalLM("hunyuan_v1_dense", build="init")
    # transformers 5.25 names the embedding in HunYuan's plan, 5.17 only the head: the analysis shards it alike
    embedding = "explicit" if "model.embed_tokens" in declared_tp_plan(module.model) else "auto"
    plan = plan_model(module, tp=2, pp=2)
    assert plan.hf_plan is None
    styles = _styles(plan)
    assert styles["0.mlp.gate_proj"] == styles["0.mlp.up_proj"] == "colwise" and styles["0.mlp.down_proj"] == "rowwise"
    # its attention normalises q and k per head with learned weights: sharded, those weights' gradients summed over tp
    assert styles["0.self_attn.q_proj"] == "colwise" and styles["0.self_attn.o_proj"] == "rowwise"
    norm = plan.tp_plan.entries["0.self_attn.query_layernorm"]
    assert style_kind(norm.style) == "grad_allreduce" and "meets the sharded outputs of q_proj" in norm.reason
    outer = {name: (entry.style, entry.source) for name, entry in plan.outer_plan.entries.items()}
    assert outer == {"model.model.embed_tokens": ("vocab", embedding), "model.lm_head": ("colwise_gather", "explicit")}
