"""The model copy of Lightning's weight-averaging callbacks, rebuilt from this rank's set-up module."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim.swa_utils import AveragedModel

from lightning_3d.core.tied import install_alias_hooks
from lightning_3d.core.weight_averaging import (
    averaging_callbacks,
    defer_copies_to_setup_end,
    rebuild_averaged_copies,
    stage_copy,
)


class Stage(nn.Module):
    """A stage of a split model: one block of three, a head tied to an embedding, a shared submodule, a
    non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList([nn.Identity(), nn.Identity(), nn.LayerNorm(3)])
        self.norm = nn.BatchNorm1d(3)
        self.shared = self.blocks[2]
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("cache", torch.ones(2), persistent=False)


def test_copy_has_the_modules_names_order_and_values_but_not_its_tensors() -> None:
    module = Stage()
    copy = stage_copy(module)
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in module.named_parameters()]
    assert [n for n, _ in copy.named_buffers()] == [n for n, _ in module.named_buffers()]
    assert list(copy.state_dict()) == list(module.state_dict())  # "cache" is left out of both
    for mine, theirs in zip(copy.parameters(), module.parameters(), strict=True):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr() and not mine.requires_grad
    assert copy.head.weight is copy.embed.weight and copy.shared is getattr(copy.blocks, "2")  # tying kept
    assert not hasattr(copy, "forward") or type(copy) is nn.Module  # a plain tree, no model code


def test_copy_keys_a_tied_weight_as_the_module_does() -> None:
    """A split model's root renames the alias of a tied weight to its canonical name (``core/tied.py``); the copy
    does too, and loads such a state dict back."""
    module = Stage()
    module.head.weight = nn.Parameter(module.embed.weight.detach().clone())  # two copies (a V schedule's rank)
    install_alias_hooks(module, [["embed.weight", "head.weight"]])
    copy = stage_copy(module)
    assert list(copy.state_dict()) == list(module.state_dict())
    assert "head.weight" not in copy.state_dict()
    state = {k: v + 1 for k, v in module.state_dict().items()}
    copy.load_state_dict(state)
    assert torch.equal(copy.head.weight, state["embed.weight"])


def test_dtensor_parameters_stay_dtensors(world_of_one: object) -> None:
    mesh = init_device_mesh("cpu", (1,))
    module = nn.Linear(3, 2)
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    copy = stage_copy(module)
    assert isinstance(copy.weight, DTensor) and copy.weight.placements == (Replicate(),)
    assert torch.equal(copy.weight.full_tensor(), module.weight.full_tensor())


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_rebuild_replaces_a_whole_model_copy_once(kind: str) -> None:
    """The callback's own ``setup`` copied the whole model; after the strategy's setup the copy is this rank's
    part. A second setup of the same Trainer keeps the (already averaged) stage copy."""
    whole, stage = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3))
    callback = EMAWeightAveraging() if kind == "ema" else StochasticWeightAveraging(swa_lrs=0.1)
    other = EMAWeightAveraging()  # set up outside fit: no copy, nothing to rebuild
    callback._average_model = AveragedModel(whole) if kind == "ema" else whole  # what each callback's setup makes
    assert averaging_callbacks([callback, other, object()]) == [callback]
    assert rebuild_averaged_copies([callback, other], stage) == [callback]
    copy = callback._average_model.module if kind == "ema" else callback._average_model
    assert [p.shape for p in copy.parameters()] == [p.shape for p in stage.parameters()]
    with torch.no_grad():
        next(copy.parameters()).add_(1.0)
    assert rebuild_averaged_copies([callback], stage) == []
    assert (callback._average_model.module if kind == "ema" else callback._average_model) is copy


class BuiltInConfigureModel(L.LightningModule):
    def configure_model(self) -> None:
        if not hasattr(self, "layer"):
            self.layer = nn.Linear(3, 3)


class BuiltInInit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)


def test_the_callbacks_setup_copies_are_deferred_to_the_rebuild() -> None:
    """EMA's setup would build a ``configure_model`` model for real outside the strategy's meta-device context and
    copy it; SWA's would deep-copy the module (FSDP2 refuses once it is sharded). Deferred, the module stays
    unbuilt (Lightning's own configure_model call comes next) and a placeholder waits for the rebuild; a subclass
    with a setup of its own keeps it; the undo restores the callbacks."""

    class OwnSetup(EMAWeightAveraging):
        def setup(self, trainer: object, pl_module: object, stage: str) -> None:
            self.called = stage

    ema, swa, own, module = (
        EMAWeightAveraging(),
        StochasticWeightAveraging(swa_lrs=0.1),
        OwnSetup(),
        BuiltInConfigureModel(),
    )
    undo = defer_copies_to_setup_end([ema, swa, own, object()])
    for callback in (ema, swa, own):
        callback.setup(None, module, "fit")  # type: ignore[arg-type]
    assert not hasattr(module, "layer")
    assert averaging_callbacks([ema, swa, own]) == [ema, swa] and own.called == "fit"
    assert list(ema._average_model.parameters()) == [] and list(swa._average_model.parameters()) == []
    later = StochasticWeightAveraging(swa_lrs=0.1)
    undo_later = defer_copies_to_setup_end([later])
    later.setup(None, BuiltInInit(), "validate")  # type: ignore[arg-type]  # SWA copies at every stage: deferred too
    assert list(later._average_model.parameters()) == []
    rebuild_averaged_copies([ema, swa, later], BuiltInInit())
    assert all(len(list(copy.parameters())) == 2 for copy in (ema._average_model, swa._average_model))
    undo()
    undo_later()
    assert all("setup" not in c.__dict__ for c in (ema, swa, own, later))
