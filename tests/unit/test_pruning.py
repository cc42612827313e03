"""``ModelPruning`` on a split model: the refusal under DTensors, the pairs kept per stage (lottery-ticket copies
re-indexed), and global pruning over gathered scores equal to torch's own on the whole model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelPruning
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightning_3d.core import pruning
from lightning_3d.core.pruning import natural_name, prune_this_stage, refuse_pruning


def whole() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))


def set_up(callback: ModelPruning, module: nn.Module) -> None:
    callback.setup(None, module, "fit")  # type: ignore[arg-type]  # the trainer is not read


def test_refused_where_parameters_are_dtensors() -> None:
    callbacks = [ModelPruning("l1_unstructured", amount=0.5)]
    refuse_pruning(callbacks, dp=1, tp=1)
    refuse_pruning([], dp=2, tp=2)
    with pytest.raises(ValueError, match=r"pipeline parallelism only .* this run has dp=2, tp=1"):
        refuse_pruning(callbacks, dp=2, tp=1)
    with pytest.raises(ValueError, match="dp=1, tp=2"):
        refuse_pruning(callbacks, dp=1, tp=2)


def test_each_stage_keeps_its_own_pairs_and_lottery_copies() -> None:
    model = whole()
    callback = ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=True)
    set_up(callback, model)
    assert len(callback._parameters_to_prune) == 8  # weights, then biases, of the four modules
    stage = nn.Sequential()  # the last stage: modules 2 and 3 under their own names
    stage.add_module("2", model[2])
    stage.add_module("3", model[3])
    initial = {name: p.detach().clone() for name, p in stage.named_parameters()}
    undo = prune_this_stage([callback], stage, list(model.state_dict()), group=None)
    assert [(owner, name) for owner, name in callback._parameters_to_prune] == [
        (model[2], "weight"),
        (model[3], "weight"),
        (model[2], "bias"),
        (model[3], "bias"),
    ]
    assert callback._original_layers is not None and len(callback._original_layers) == 2
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(1.0)
    callback.apply_pruning(0.5)
    callback.apply_lottery_ticket_hypothesis()  # each kept pair gets its own module's initial values back
    for name, value in initial.items():
        module, attr = stage.get_submodule(name.split(".")[0]), name.split(".")[1]
        assert torch.equal(getattr(module, attr + "_orig"), value), name
    assert not hasattr(model[0], "weight_mask")  # another stage's module is not pruned here
    undo()


def test_global_pruning_over_the_gathered_vector_equals_torchs(gloo_world: dist.ProcessGroup) -> None:
    """One rank holding every pair: the gathered vector is the whole model's, so two rounds of pruning (the second
    combined with the first's masks) give torch's own ``global_unstructured`` masks exactly."""
    model, reference = whole(), whole()
    callback = ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=True)
    set_up(callback, model)
    theirs = ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=True)
    set_up(theirs, reference)
    undo = prune_this_stage([callback], model, list(model.state_dict()), group=gloo_world)
    assert "_apply_global_pruning" in vars(callback)
    for _ in range(2):
        callback.apply_pruning(0.3)
        theirs.apply_pruning(0.3)
        for (owner, name), (ref_owner, _) in zip(callback._parameters_to_prune, theirs._parameters_to_prune):
            assert torch.equal(getattr(owner, name + "_mask"), getattr(ref_owner, name + "_mask")), name
        model(torch.randn(3, 4))  # the pruning hooks recompute the masked weights, as after a training step
        reference(torch.randn(3, 4))
    undo()
    assert "_apply_global_pruning" not in vars(callback)


def test_global_pruning_orders_pairs_by_name_then_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key that orders the gathered vector: ``weight`` pairs before ``bias`` pairs, each in model order (the
    order ``ModelPruning`` lists the unsplit model in), whatever order the stage's list has."""
    model = whole()
    callback = ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=True)
    set_up(callback, model)
    callback._parameters_to_prune.reverse()
    seen: list[tuple] = []

    def record(_callback: ModelPruning, amount: float, key_of: Callable, group: object) -> None:
        seen.extend(key_of(owner, name) for owner, name in _callback._parameters_to_prune)

    monkeypatch.setattr(pruning, "prune_globally", record)
    prune_this_stage([callback], model, list(model.state_dict()), group=object())
    callback.apply_pruning(0.3)
    assert sorted(key[2] for key in seen) == sorted(f"{i}.{name}" for i in range(4) for name in ("weight", "bias"))
    assert [key[2] for key in sorted(seen)] == [f"{i}.weight" for i in range(4)] + [f"{i}.bias" for i in range(4)]


def test_natural_name_of_pruned_and_other_parameters() -> None:
    model = whole()
    assert natural_name(model, "2.weight_orig") == "2.weight_orig"  # not pruned: a parameter of that name
    torch_prune.l1_unstructured(model[2], "weight", amount=0.5)
    torch_prune.l1_unstructured(model[2], "weight", amount=0.5)  # twice: a PruningContainer as the hook
    assert natural_name(model, "2.weight_orig") == "2.weight"
    assert natural_name(model, "2.bias") == "2.bias"
    assert natural_name(model[2], "weight_orig") == "weight"  # a parameter of the module itself
