"""core/hf_outputs.py: Hugging Face's recorded outputs on a pipeline stage, in one process (no communication).

A tiny BERT whose step reads ``outputs.hidden_states`` (transformers 5 records them with forward hooks on the
layers), split into two stages at its layers; each stage is run as a rank holding it would run it, and the last
stage's loss and the gradients it sends back are checked against the unsplit model's pieces by hand.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_3d.core import hf_outputs
from lightning_3d.core.blocks import find_blocks, split_model
from lightning_3d.core.boundary_check import check_first_step, make_skeleton
from lightning_3d.core.stage_exec import StageExecutor, StageModule
from lightning_3d.core.stand_ins import Skipped

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(hf_outputs._capturing() is None, reason="transformers records no outputs by hooks")


class Pooled(LightningModule):
    """A classifier on the mean of BERT's hidden states (the embedding's and every layer's)."""

    def __init__(self, attentions: bool = False) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=16, hidden_size=8, num_hidden_layers=4, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        config._attn_implementation = "eager"  # (sdpa returns no attention weights)
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(8, 3)
        self.attentions = attentions

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.bert(input_ids=x, output_hidden_states=True, output_attentions=self.attentions)
        assert len(out.hidden_states) == 5, len(out.hidden_states)
        return F.cross_entropy(self.head(torch.stack(out.hidden_states).mean(0).mean(1)), y)


def stage_of(model: LightningModule, stage: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any, StageModule]:
    """A copy of ``model`` arranged as a rank holding ``stage`` of two (layers 0-1 | 2-3) arranges it, checked and
    ready to run the first micro-batch of 2 of the batch ``(x, y)``: the copy, its executor and the stage module."""
    net = copy.deepcopy(model)
    split = split_model(net, find_blocks(net), pp=2, ranges=[range(0, 2), range(2, 4)])
    executor = StageExecutor(net, split, [stage], skeleton=make_skeleton(net))
    executor.prune()
    executor.check_first_step("training_step", (x, y), (0,), 4, 2)
    module = StageModule(stage, {n: net.get_submodule(n) for n in split.modules_of(stage)}, executor)
    executor.begin("training_step", net.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(stage, 0)
    return net, executor, module


def run_stages(model: Pooled, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Both stages of ``model`` at pp2 (layers 0-1 | 2-3) on one micro-batch of 2: the last stage's loss and what
    stage 0 sent (leaves holding the gradients the last stage sent back)."""
    sent: list[torch.Tensor] = []
    for stage in (0, 1):
        _, _, module = stage_of(model, stage, x, y)
        if stage == 0:
            out = module(x[:2])
            sent = [t.detach().requires_grad_(True) for t in (out if isinstance(out, tuple) else (out,))]
        else:
            loss = module(*sent)
            loss.sum().backward()
    return loss, sent


def test_the_last_stage_reads_every_layers_hidden_state_carried_from_where_it_was_made() -> None:
    """Before 2026-12-05 the last stage's ``hidden_states`` held 3 of the 5 (its stand-ins for stage 0's layers
    are not ``BertLayer``s, so Hugging Face's recorders skipped them): a wrong mean, without a word."""
    torch.manual_seed(0)
    model = Pooled()
    x, y = torch.randint(0, 16, (4, 6)), torch.tensor([0, 1, 2, 0])
    loss, sent = run_stages(model, x, y)
    ref = model.bert

    def layer(i: int, h: torch.Tensor) -> torch.Tensor:
        out = ref.encoder.layer[i](h)
        return out[0] if isinstance(out, tuple) else out

    h0 = ref.embeddings(input_ids=x[:2])
    h1 = layer(0, h0)
    h2 = layer(1, h1)
    # the last stage's part, from what stage 0 sent: its last layer's output (flowing to layer 2), then the values
    # the step reads, in model order (the embedding's output, layer 0's, layer 1's), each a leaf that takes its
    # gradient back
    flowing, emb, first, second = (t.detach().requires_grad_(True) for t in (h2, h0, h1, h2))
    h3 = layer(2, flowing)
    h4 = layer(3, h3)
    pooled = torch.stack([emb, first, second, h3, h4]).mean(0).mean(1)
    want = F.cross_entropy(model.head(pooled), y[:2]) * 0.5
    assert len(sent) == 4 and all(torch.allclose(s, h) for s, h in zip(sent, (h2, h0, h1, h2), strict=True))
    assert torch.allclose(loss[0], want)
    grads = torch.autograd.grad(want, (flowing, emb, first, second))
    assert all(torch.allclose(s.grad, g, atol=1e-7) for s, g in zip(sent, grads, strict=True))


class RouterLoss(LightningModule):
    """A tiny Mixtral whose config records the routers' logits, for the load-balancing loss added to the LM loss."""

    def __init__(self, experts: str = "batched_mm") -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=8,
            output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False,
        )  # fmt: skip
        self.lm = transformers.MixtralForCausalLM._from_config(
            config, attn_implementation="eager", experts_implementation=experts
        )

    def training_step(self, batch, batch_idx):
        return self.lm(input_ids=batch[0], labels=batch[0]).loss


def test_attention_weights_the_step_does_not_read_are_refused_by_name() -> None:
    """Attention weights are recorded by hooks on modules inside each layer, which a stage not holding the layer
    never runs; a step that asks for them but whose result does not read them has them carried nowhere (the check
    sees no read), so the tuple would miss stage 0's: the last stage refuses, naming what was asked and the layer."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 16, (4, 6)), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"record attentions, cross_attentions .*bert\.encoder\.layer\.0 \(pipeline"):
        run_stages(Pooled(attentions=True), x, y)


def test_a_load_balancing_loss_counts_every_stages_router_logits() -> None:
    """Mixtral's load-balancing loss is computed on the last stage over every layer's router logits, recorded by
    hooks on the routers inside the layers: the check finds the loss reads stage 0's routers, stage 0 sends their
    logits, and the last stage's stand-ins for its layers replay the recorders with them, in layer order. Float64:
    the loss and every parameter's gradient (stage 0's through the logits sent back) match the unsplit model's.
    Before 2026-12-06 this was refused (and until 2026-12-05 the loss silently counted the last stage's layers)."""
    torch.manual_seed(0)
    model = RouterLoss().double()
    x, y = torch.randint(0, 16, (4, 6)), torch.tensor([0, 1, 2, 0])
    nets: list[RouterLoss] = []
    for stage in (0, 1):
        net, executor, module = stage_of(model, stage, x, y)
        assert [v.module for v in executor.carry.values] == ["lm.model.layers.0.mlp.gate", "lm.model.layers.1.mlp.gate"]
        if stage == 0:
            sent = module(x[:2])
            received = [t.detach().requires_grad_(True) for t in sent]
            assert len(received) == 3  # the flowing activation, then layer 0's and layer 1's router logits
        else:
            loss = module(*received)
            loss.sum().backward()
            torch.autograd.backward(sent, [t.grad for t in received])  # stage 0's backward, as torch's stage runs it
        nets.append(net)
    want = model.training_step((x[:2], y[:2]), 0) * 0.5
    want.backward()
    torch.testing.assert_close(loss.sum(), want, rtol=1e-12, atol=0)
    for name, param in model.named_parameters():
        held = [n for n in nets if dict(n.named_parameters()).get(name) is not None]
        got = dict(held[-1].named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, param.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_check_runs_hugging_face_experts_in_their_default_implementation() -> None:
    """Mixtral's experts default to ``grouped_mm``, whose shape rule takes bfloat16 only: the check ran into it in
    float32 and was left to the first step, where a recording asked inside the layers had nothing carried. The
    check runs them as ``batched_mm`` (the model keeps its own choice) and finds the routers the loss reads."""
    model = RouterLoss(experts="grouped_mm")
    x, y = torch.randint(0, 16, (2, 6)), torch.tensor([0, 1])
    split = split_model(model, find_blocks(model), pp=2, ranges=[range(0, 2), range(2, 4)])
    checked = check_first_step(make_skeleton(model), split, "training_step", (x, y), (0,))
    assert checked.not_checked is None
    assert [(v.module, v.index, v.stage, v.last) for v in checked.carry.values] == [
        ("lm.model.layers.0.mlp.gate", 0, 0, 1),
        ("lm.model.layers.1.mlp.gate", 0, 0, 1),
    ]
    assert model.lm.config._experts_implementation == "grouped_mm"


def test_recorders_install_once_and_are_silent_while_a_meta_copy_runs() -> None:
    model = Pooled()
    layer = model.bert.encoder.layer[0]
    assert hf_outputs.recorders(layer) == []  # Hugging Face installs them at the first forward that asks
    hf_outputs.install_recorders(model)
    assert len(hf_outputs.recorders(layer)) == 1 and hf_outputs.recorders(model.head) == []
    hf_outputs.install_recorders(model)  # once only
    assert len(hf_outputs.recorders(layer)) == 1
    capturing = hf_outputs._capturing()
    token = capturing._active_collector.set({"hidden_states": [], "attentions": []})
    try:
        assert hf_outputs.recorded_inside() == ["attentions"]
        with hf_outputs.not_recording():
            assert hf_outputs.recorded_inside() == []
            layer(torch.randn(1, 3, 8))
        assert capturing._active_collector.get() == {"hidden_states": [], "attentions": []}
    finally:
        capturing._active_collector.reset(token)
    assert hf_outputs.recorded_inside() == []


def test_the_model_gets_its_recorders_only_when_a_forward_asks() -> None:
    """A recorder reads a context variable on every call, which ``torch.compile`` cannot trace: a compiled block
    with one breaks its graph (``fullgraph=True`` fails) even when nothing is recorded. The executor takes them off
    the model (its stand-ins keep copies) and puts them back at the first forward that asks for an output (the
    hidden-states and load-balancing tests above run through that); the stage-boundary check leaves the model as
    it found it. Until 2026-12-06 every Hugging Face model under pp > 1 had them from the start."""
    model = Pooled()
    x, y = torch.randint(0, 16, (4, 6)), torch.tensor([0, 1, 2, 0])
    layers = model.bert.encoder.layer
    split = split_model(model, find_blocks(model), pp=2, ranges=[range(0, 2), range(2, 4)])
    with hf_outputs.recording(model):
        assert len(hf_outputs.recorders(layers[0])) == 1
    assert hf_outputs.recorders(layers[0]) == [] and not getattr(model.bert, hf_outputs._INSTALLED, False)
    checked = check_first_step(make_skeleton(model), split, "training_step", (x[:2], y[:2]), (0,))
    assert checked.carry.values and hf_outputs.recorders(layers[0]) == []

    def graph_breaks(layer: nn.Module) -> int:
        torch._dynamo.reset()
        return torch._dynamo.explain(layer)(torch.randn(1, 3, 8)).graph_break_count

    taken = hf_outputs.Recorders.taken(model)
    hf_outputs.on_request(model, lambda _: taken.install())
    assert len(taken.of(layers[0])) == 1 and hf_outputs.recorders(layers[0]) == [] and graph_breaks(layers[0]) == 0
    model.bert(input_ids=x)  # asks for nothing: still none
    assert hf_outputs.recorders(layers[0]) == []
    out = model.bert(input_ids=x, output_hidden_states=True)
    assert len(out.hidden_states) == 5 and len(hf_outputs.recorders(layers[0])) == 1
    assert getattr(model.bert, hf_outputs._INSTALLED) and graph_breaks(layers[0]) > 0  # why they wait
    torch._dynamo.reset()

    staged = Pooled()
    split = split_model(staged, find_blocks(staged), pp=2, ranges=[range(0, 2), range(2, 4)])
    StageExecutor(staged, split, [1], skeleton=None).prune()
    with_recorders = [m for m in staged.modules() if hf_outputs.recorders(m)]
    assert with_recorders and all(isinstance(m, Skipped) for m in with_recorders)  # the stand-ins keep theirs


def test_head_gathering_is_installed_once_per_attention_module_when_asked(world_of_one) -> None:
    """A causal LM and its base model both ask for the outputs (each is a Hugging Face model that records): the
    gathering hook goes on each attention module once, with the recorders, at the first forward that asks."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.core import torch_compat

    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    lm = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    hf_outputs.gather_recorded_heads(lm, init_device_mesh("cpu", (1,)))
    attention = lm.model.layers[0].self_attn
    assert torch_compat.forward_hooks(attention) == []
    out = lm(input_ids=torch.randint(0, 16, (1, 4)), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape[1] == 2
    assert len(torch_compat.forward_hooks(attention)) == 2  # the gathering hook, then the recorder
