"""``parallelize.plan_model`` for a module without a block container (pp = 1): the tensor-parallel plan is made for
the whole module, on its ``example_input_array`` or an input made for its first layer."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_3d.core.parallelize import describe_layout, plan_model
from lightning_3d.core.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import NanoGPT, PlainMLP, RotaryGPT


def _styles(plan) -> dict[str, str]:
    return {name: entry.style for name, entry in plan.tp_plan.entries.items()}


def test_a_module_without_blocks_gets_the_plan_of_the_whole_module():
    model = PlainMLP(build="init")
    plan = plan_model(model, tp=2, pp=1)
    assert plan.split is not None and plan.split.container is None
    assert plan.tp_root is model
    assert _styles(plan) == {"fc1": "colwise", "fc2": "rowwise", "head": "colwise_gather"}
    model.example_input_array = torch.zeros(3, 16)  # the module's own example: the same plan
    assert _styles(plan_model(model, tp=2, pp=1)) == _styles(plan)


def test_its_explicit_plan_is_applied_and_checked():
    model = PlainMLP(build="init")
    plan = plan_model(model, tp=2, pp=1, tp_plan={"head": "replicate"})
    assert _styles(plan) == {"fc1": "colwise", "fc2": "rowwise", "head": "replicate"}
    assert plan.tp_plan.entries["head"].source == "explicit"
    with pytest.raises(ValueError, match="'haed' matches no module"):
        plan_model(model, tp=1, pp=1, tp_plan={"haed": "replicate"})
    assert plan_model(model, tp=1, pp=1).tp_plan.entries == {}


def test_a_forward_the_analysis_cannot_run_leaves_it_replicated_with_what_to_set():
    class TwoInputs(PlainMLP):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * scale

    model = TwoInputs(build="init")
    with pytest.warns(UserWarning, match="set the LightningModule's example_input_array"):
        plan = plan_model(model, tp=2, pp=1)
    assert _styles(plan) == {}
    model.example_input_array = (torch.zeros(2, 16), torch.ones(1))
    assert _styles(plan_model(model, tp=2, pp=1)) == {"fc1": "colwise", "fc2": "rowwise", "head": "colwise_gather"}


def test_modules_with_blocks_keep_the_plan_of_their_blocks():
    class WithBlocks(PlainMLP):
        def configure_model(self) -> None:
            super().configure_model()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    plan = plan_model(WithBlocks(build="init"), tp=2, pp=1)
    assert plan.tp_root is None and plan.split.container is not None


class _FakeMesh:
    """What ``describe_layout`` reads of a (dp, pp, tp) mesh, without a process group."""

    def __init__(self, tp: int, pp: int = 2) -> None:
        self.mesh = torch.arange(tp * pp).reshape(1, pp, tp)
        self.sizes = {"tp": tp, "pp": pp, "dp": 1}

    def __getitem__(self, name: str):
        return SimpleNamespace(size=lambda: self.sizes[name])


def _outer(plan) -> dict[str, str]:
    return {name: entry.style for name, entry in plan.outer_plan.entries.items()}


def test_a_split_model_shards_its_embedding_and_head_too():
    """Blocks in a ModuleList: the blocks get their plan, and the modules around them the one an nn.Sequential body
    would give them (vocabulary-sharded embedding, final projection gathered), from the whole forward."""
    model = RotaryGPT()
    model.configure_model()
    plan = plan_model(model, tp=2, pp=2)
    assert _outer(plan) == {"tok": "vocab", "out": "colwise_gather"}
    assert plan.outer_plan.notes == {}
    assert {n.split(".", 1)[1] for n in plan.tp_plan.entries} == {"wq", "wk", "wv", "wo", "w1", "w3", "w2"}
    layout = describe_layout(Topology(world_size=4, tp=2, pp=2), _FakeMesh(2), model, plan, "1f1b", 4)
    assert "Outside the blocks (tp=2): 2 modules sharded" in layout
    whole = sum(p.numel() for p in model.parameters())
    assert f"whole model: {whole:,} parameters ({whole:,} trainable); Lightning's model summary counts" in layout
    assert "out     Linear     colwise_gather  (32, 16) -> (16, 16)" in layout


def test_without_an_example_outer_modules_stay_replicated_with_what_to_set():
    model = NanoGPT(tie=True, build="init")
    plan = plan_model(model, tp=2, pp=2)  # no example_input_array: nothing outside the blocks is sharded
    assert _outer(plan) == {}
    assert set(plan.outer_plan.notes) == {"transformer.wte", "transformer.wpe", "lm_head"}
    assert all("example_input_array" in why for why in plan.outer_plan.notes.values())
    plan = plan_model(NanoGPT(tie=True, example=True, build="init"), tp=2, pp=2)
    assert _outer(plan) == {"transformer.wte": "vocab", "transformer.wpe": "vocab", "lm_head": "colwise_gather"}
    assert plan.outer_plan.tied == [("transformer.wte.weight", "lm_head.weight")]


def _rotary() -> RotaryGPT:
    model = RotaryGPT()
    model.configure_model()
    return model  # (plan_model hides the example_input_array from Lightning: a fresh model for each plan)


def test_outer_modules_follow_the_settings():
    assert plan_model(_rotary(), tp=1, pp=2).outer_plan is None
    assert plan_model(_rotary(), tp=2, pp=2, tp_autoplan=False).outer_plan is None
    assert _outer(plan_model(_rotary(), tp=2, pp=2)) == {"tok": "vocab", "out": "colwise_gather"}
    # explicit entries name modules in the blocks, outside them, or both; the analysis does the rest
    plan = plan_model(_rotary(), tp=2, pp=2, tp_plan={"blocks.*.wq": "replicate", "out": "replicate"})
    assert plan.tp_plan.entries["0.wq"].source == "explicit" and plan.tp_plan.entries["0.w1"].source == "auto"
    assert _outer(plan) == {"tok": "vocab", "out": "replicate"}
    assert plan.outer_plan.entries["out"].source == "explicit"
    plan = plan_model(_rotary(), tp=2, pp=2, tp_plan={"*": "replicate"})  # both sides, everything whole
    assert {e.style for e in plan.tp_plan.entries.values()} == {"replicate"}
    assert {e.style for e in plan.outer_plan.entries.values()} == {"replicate"}
    # without the analysis only the explicit entries, and a pattern naming nothing anywhere is refused
    plan = plan_model(_rotary(), tp=2, pp=2, tp_autoplan=False, tp_plan={"tok": "vocab"})
    assert _outer(plan) == {"tok": "vocab"} and plan.tp_plan.entries == {}
    with pytest.raises(ValueError, match="'lm_head' matches no module of the model\\. Closest"):
        plan_model(_rotary(), tp=2, pp=2, tp_plan={"lm_head": "replicate"})
    with pytest.raises(ValueError, match="num_embeddings = 32 is not divisible by tp=3"):
        plan_model(_rotary(), tp=3, pp=2, tp_plan={"tok": "vocab"}, tp_autoplan=False)


def test_an_explicit_entry_must_not_split_a_tie():
    tied = {"tp_plan": {"lm_head": "colwise_gather", "transformer.wte": "replicate"}}
    with pytest.raises(ValueError, match=r"lm_head \(explicit plan\) would shard the tied parameter .* unlike"):
        plan_model(NanoGPT(tie=True, example=True, build="init"), tp=2, pp=2, **tied)
    objects = {"tp_plan": {"lm_head": ColwiseParallel(output_layouts=Replicate())}}
    with pytest.raises(ValueError, match="as a ParallelStyle object"):
        plan_model(NanoGPT(tie=True, example=True, build="init"), tp=2, pp=2, **objects)
    alike = {"tp_plan": {"lm_head": "colwise_gather", "transformer.wte": "vocab"}}
    plan = plan_model(NanoGPT(tie=True, example=True, build="init"), tp=2, pp=2, **alike)
    assert plan.outer_plan.tied == [("transformer.wte.weight", "lm_head.weight")]


def test_an_outer_size_tp_does_not_divide_stays_replicated_without_failing():
    model = RotaryGPT()
    model.vocab = 33
    model.configure_model()
    plan = plan_model(model, tp=2, pp=2)
    assert _outer(plan) == {}
    assert "33 embeddings are not divisible by tp=2" in plan.outer_plan.notes["tok"]
    assert "33 outputs, not divisible by tp=2" in plan.outer_plan.notes["out"]
