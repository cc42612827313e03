"""``parallelize.plan_model`` for a module without a block container (pp = 1): the tensor-parallel plan is made for
the whole module, on its ``example_input_array`` or an input made for its first layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_3d.core.parallelize import plan_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import PlainMLP


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
