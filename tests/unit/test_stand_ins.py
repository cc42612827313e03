"""core/stand_ins.py: what a pipeline stage finds in place of the modules other stages hold, in one process.

The model of ``test_stage_exec.py`` (an embedding, four blocks in a ModuleList, a head; two stages of two blocks)
and variants whose forward does what Hugging Face models do around their blocks: unpack a block's tuple, read a
block's plain attribute, read an embedding's weight dtype. The last stage's forward is compared with the unsplit
model's pieces run by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.core.stand_ins import Absent, Remote

from .test_stage_exec import Net, batch, run_last_stage, stage_of


class TupleBlock(nn.Module):
    """Returns ``(hidden, None, bias)`` as T5's and DeBERTa's layers return several values; ``kind`` is a plain
    attribute the model's loop reads (ModernBERT's ``attention_type``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor, scale: float, bias: torch.Tensor | None = None):
        if bias is None:
            bias = torch.sigmoid(self.fc.bias)  # computed by the first block, passed on by the others
        return x + scale * torch.tanh(self.fc(x) + bias), None, bias


class TupleNet(Net):
    def __init__(self, uses_bias: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TupleBlock("wide" if i % 2 else "narrow") for i in range(4))
        self.uses_bias = uses_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.embed(x), None
        for block in self.blocks:
            scale = 0.5 if block.kind == "wide" else 0.25
            h, _, new_bias = block(h, scale, bias if self.uses_bias else None)
            bias = new_bias
        return self.head(h)


def last_stage_against_reference(model: Net) -> None:
    """The last of two stages on the first micro-batch equals the unsplit model's blocks 2, 3 and head."""
    ref = copy.deepcopy(model)
    received = torch.randn(2, 4, requires_grad=True)
    executor, stage = stage_of(model, 1)
    x, y = batch()
    executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(1, 0)
    out = stage(received)
    h = received
    for i in (2, 3):
        block = ref.blocks[i]
        h = block(h, 0.5 if getattr(block, "kind", "wide") == "wide" else 0.25)
        h = h[0] if isinstance(h, tuple) else h
    want = F.cross_entropy(ref.head(h), y[:2]) * 0.5
    assert torch.allclose(out[0], want)


def test_a_skipped_block_returns_the_blocks_structure_and_its_plain_attributes() -> None:
    """It returned its input alone, so ``h, _, bias = block(h)`` failed with "too many values to unpack" on every
    stage after the first (DeBERTa-v2, T5), and ``block.kind`` raised AttributeError (ModernBERT)."""
    torch.manual_seed(0)
    last_stage_against_reference(TupleNet())


def test_a_skipped_blocks_other_outputs_used_on_a_later_stage_are_refused() -> None:
    """A value a block returns besides the flowing tensor, used by a later stage's blocks (T5's position bias, made
    by the first block): when no check before the first step found it to carry (the step could not run on fake
    tensors; here no skeleton), the stand-in's zeros stand for it, and the first real forward's check names it."""
    with pytest.raises(ValueError, match=r"stage 1 \(from blocks.2\) uses the output of blocks.1"):
        run_last_stage(TupleNet(uses_bias=True))


def test_another_stages_parameter_reads_its_shape_dtype_and_device() -> None:
    """Hugging Face's ViT casts its pixels to ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every
    stage: it raised "was read on pipeline stage 1, but ... is held by stage 0"."""
    seen = {}

    class ReadsMetadata(Net):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(3, 4))  # a submodule read through the stand-in

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = self.embed[0].weight
            seen.update(dtype=weight.dtype, shape=weight.shape, device=weight.device, grad=weight.requires_grad)
            seen.update(size=weight.size(1), dim=weight.dim(), floating=weight.is_floating_point(), cuda=weight.is_cuda)
            return super().forward(x.to(weight.dtype))

    torch.manual_seed(0)
    last_stage_against_reference(ReadsMetadata())
    assert seen == {"dtype": torch.float32, "shape": (4, 3), "device": torch.device("cpu"), "grad": True, "size": 3,
                    "dim": 2, "floating": True, "cuda": False}  # fmt: skip


def test_another_stages_parameter_cannot_be_computed_with_or_called() -> None:
    model = Net()
    executor, _ = stage_of(model, 1)
    executor.current = type("Running", (), {"stage": 1})()  # as inside a step of stage 1
    weight = model.embed.weight
    assert isinstance(weight, Absent) and "held by pipeline stage 0" in repr(weight)
    for use in (lambda: weight + 1, lambda: torch.ones(4, 3) @ weight.T, lambda: weight.sum(), lambda: weight.clone()):
        with pytest.raises(RuntimeError, match=r"embed.weight was used in a computation on pipeline stage 1"):
            use()
    with pytest.raises(AttributeError, match=r"embed.reset_parameters was read on pipeline stage 1"):
        model.embed.reset_parameters  # noqa: B018  (a method would run on the meta copy)
    with pytest.raises(AttributeError, match=r"embed.no_such_thing was read"):
        model.embed.no_such_thing  # noqa: B018


def test_a_submodule_of_another_stages_module_is_read_but_not_called() -> None:
    class Nested(Net):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(3, 4))

    model = Nested()
    executor, _ = stage_of(model, 1)
    executor.current = type("Running", (), {"stage": 1})()
    remote = model.embed[0]
    assert isinstance(remote, Remote) and remote.out_features == 4 and remote.weight.shape == (4, 3)
    with pytest.raises(IndexError, match="out of range"):  # as the real Sequential says
        model.embed[5]
    with pytest.raises(TypeError, match=r"head\[0\] was read on pipeline stage 0"):  # a Linear is not subscriptable
        first = Nested()
        stage_of(first, 0)[0].current = type("Running", (), {"stage": 0})()
        first.head[0]
    with pytest.raises(RuntimeError, match=r"embed.0 was called on pipeline stage 1, but it is held by stage 0"):
        remote(torch.ones(2, 3))


def test_the_meta_copies_take_the_precision_plugins_conversion() -> None:
    """Under ``precision="64-true"`` the model's weights become float64 after the split; the dtype read from a
    stand-in must say so too."""
    model = Net()
    executor, _ = stage_of(model, 1)
    executor.convert_stand_ins(lambda module: module.double())
    executor.current = type("Running", (), {"stage": 1})()
    assert model.embed.weight.dtype == torch.float64


def test_a_block_that_cannot_run_on_the_meta_device_is_stood_in_for_by_its_input() -> None:
    """A block whose forward reads a value back to the host (``.item()``) cannot run on its meta copy: the stand-in
    then returns its first argument, as before the copies existed, and the stage still computes the right loss."""

    class HostRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            if x.abs().max().item() > 1e6:  # data-dependent Python control flow
                x = x / 1e6
            return x + scale * torch.tanh(self.fc(x))

    class Net2(Net):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(HostRead() for _ in range(4))

    torch.manual_seed(0)
    model = Net2()
    last_stage_against_reference(model)
    skipped = model.blocks[0]
    assert list(skipped.__dict__["_templates"].values()) == [None]  # tried once, cached as "no structure"
