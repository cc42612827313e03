"""BaseFinetuning's filter of the parameters already in the optimizer, by identity while the strategy runs."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

from lightning_3d.core.finetuning import filter_by_identity, filter_by_identity_while_running


class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module: nn.Module) -> None:
        pass

    def finetune_function(self, pl_module: nn.Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        pass


def test_identity_keeps_a_parameter_equal_in_value_to_one_already_optimized() -> None:
    """Two fresh LayerNorms have equal weights: Lightning's ``torch.equal`` would leave the second out."""
    held, frozen = nn.LayerNorm(4), nn.LayerNorm(4)
    optimizer = torch.optim.SGD(held.parameters(), lr=0.1)
    assert BaseFinetuning.filter_on_optimizer(optimizer, frozen.parameters()) == []  # Lightning's value test
    assert filter_by_identity(optimizer, [*frozen.parameters(), held.weight]) == list(frozen.parameters())


def test_installed_only_with_a_finetuning_callback_and_undone() -> None:
    original = BaseFinetuning.__dict__["filter_on_optimizer"]
    undo = filter_by_identity_while_running([object()])
    assert BaseFinetuning.__dict__["filter_on_optimizer"] is original
    undo()
    undo = filter_by_identity_while_running([Unfreeze()])
    try:
        held, frozen = nn.LayerNorm(4), nn.LayerNorm(4)
        optimizer = torch.optim.SGD(held.parameters(), lr=0.1)
        Unfreeze.unfreeze_and_add_param_group(frozen, optimizer, lr=0.01)  # through the class, as Lightning calls it
        assert len(optimizer.param_groups) == 2
        assert optimizer.param_groups[1]["params"] == list(frozen.parameters())
    finally:
        undo()
    assert BaseFinetuning.__dict__["filter_on_optimizer"] is original
