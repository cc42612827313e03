"""core/stage_exec.py: the user's step run for one pipeline stage, in one process (no schedule, no communication).

A model split into two stages at its ModuleList; each test builds the executor a rank holding one of them would
build, and checks what the stage's forward returns against running the unsplit model's pieces by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.core.blocks import find_blocks, split_model
from lightning_3d.core.stage_exec import StageExecutor, StageModule


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * torch.tanh(self.fc(x))


class Net(LightningModule):
    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(4, 2)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        first = None
        for block in self.blocks:
            h = block(h, scale=0.5)  # a keyword argument besides the flowing tensor
            first = h if first is None else first
        return self.head(h + first if self.skip else h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


def stage_of(model: Net, stage: int) -> tuple[StageExecutor, StageModule]:
    split = split_model(model, find_blocks(model), pp=2, ranges=[range(0, 2), range(2, 4)])
    executor = StageExecutor(model, split, [stage])
    executor.prune()
    held = {n: model.get_submodule(n) for n in split.modules_of(stage)}
    return executor, StageModule(stage, held, executor)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)


def test_first_stage_sends_its_last_blocks_output() -> None:
    torch.manual_seed(0)
    model, ref = Net(), None
    ref = copy.deepcopy(model)
    executor, stage = stage_of(model, 0)
    x, y = batch()
    executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(0, 1)  # the second micro-batch: samples 2 and 3
    out = stage(torch.arange(2, 4))
    want = ref.blocks[1](ref.blocks[0](ref.embed(x[2:]), scale=0.5), scale=0.5)
    assert torch.allclose(out, want)
    assert set(dict(model.named_parameters())) == {"embed.weight", "embed.bias", *(
        f"blocks.{i}.fc.{p}" for i in (0, 1) for p in ("weight", "bias"))}  # fmt: skip


def test_last_stage_takes_the_received_tensor_and_returns_the_weighted_loss() -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    executor, stage = stage_of(model, 1)
    x, y = batch()
    received = torch.randn(2, 4, requires_grad=True)
    executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(1, 0)
    out = stage(received)
    want = F.cross_entropy(ref.head(ref.blocks[3](ref.blocks[2](received, scale=0.5), scale=0.5)), y[:2])
    assert out.shape == (1,) and torch.allclose(out[0], want * 0.5)  # 2 of the batch's 4 samples
    out.sum().backward()
    assert received.grad is not None  # the gradient goes back to the previous stage
    logs, _ = executor.finish()
    assert logs.entries["train_loss"].weight == 2.0


class LayerDrop(Net):
    """Skips the blocks named in ``drop`` as Hugging Face's LayerDrop does (``continue`` in the model's loop)."""

    def __init__(self, drop: set[int]) -> None:
        super().__init__()
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i not in self.drop:
                h = block(h, scale=0.5)
        return self.head(h)


def unsplit_drop(ref: LayerDrop, h: torch.Tensor, blocks: range, drop: set[int]) -> torch.Tensor:
    for i in blocks:
        if i not in drop:
            h = ref.blocks[i](h, scale=0.5)
    return h


@pytest.mark.parametrize("drop", [{1}, {0, 1}, {2}, {3}, {2, 3}, {1, 2}, {0, 1, 2, 3}])
def test_blocks_the_model_skips_leave_each_stage_what_flows(drop: set[int]) -> None:
    """LayerDrop (M2M100's and NLLB's default config) under pp2: a stage's first block skipped, its last, or all of
    them. The first stage sends what its last called block made (or the embedding's output), the last stage feeds
    the received tensor to the first of its blocks that runs (or to the head). Before 2026-12-05 a skipped first
    block left the received tensor unused and a skipped last block ran the step past the stage."""
    torch.manual_seed(0)
    x, y = batch()
    ref = LayerDrop(drop)
    ref.load_state_dict(Net().state_dict())
    for index in (0, 1):
        model = copy.deepcopy(ref)
        executor, stage = stage_of(model, index)
        executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
        executor.on_chunk(index, 0)
        if index == 0:
            out = stage(torch.arange(0, 2))
            assert torch.allclose(out, unsplit_drop(ref, ref.embed(x[:2]), range(0, 2), drop))
            continue
        received = torch.randn(2, 4, requires_grad=True)
        out = stage(received)
        want = F.cross_entropy(ref.head(unsplit_drop(ref, received, range(2, 4), drop)), y[:2]) * 0.5
        assert torch.allclose(out[0], want)
        (got,) = torch.autograd.grad(out.sum(), received)
        (expected,) = torch.autograd.grad(want, received)
        assert torch.allclose(got, expected)


def test_a_middle_stage_whose_blocks_are_all_skipped_passes_the_received_tensor_on() -> None:
    model = LayerDrop({2})
    split = split_model(model, find_blocks(model), pp=3, ranges=[range(0, 2), range(2, 3), range(3, 4)])
    executor = StageExecutor(model, split, [1])
    executor.prune()
    stage = StageModule(1, {n: model.get_submodule(n) for n in split.modules_of(1)}, executor)
    executor.begin("training_step", model.training_step, batch(), (0,), 4, 2, 1.0, True)
    executor.on_chunk(1, 0)
    received = torch.randn(2, 4, requires_grad=True)
    out = stage(received)
    assert torch.equal(out, received) and out is not received  # a copy: torch detaches stage outputs in place
    (grad,) = torch.autograd.grad(out.sum(), received)
    assert torch.equal(grad, torch.ones_like(received))


class Projection(nn.Module):
    """wav2vec2's feature projection: features of another width in, the hidden states and the normed features out."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(6), nn.Linear(6, 4)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(features)
        return self.fc(normed), normed


class SpeechNet(Net):
    """A feature extractor whose output is not the blocks' width, then a projection returning a tuple (wav2vec2)."""

    def __init__(self) -> None:
        super().__init__()
        del self.embed, self.blocks, self.head  # registered again after the modules that run before the blocks
        self.features = nn.Linear(3, 6)
        self.projection = Projection()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.projection(self.features(x))
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


def test_a_module_before_the_blocks_stands_in_with_its_own_output_shape() -> None:
    """The later stage's stand-in for a module before the blocks returned zeros shaped like the received activation,
    so a module after it that stands in too (run on its meta copy for its output structure) got the wrong width and
    returned one tensor: wav2vec2 at pp2 died with "too many values to unpack (expected 2)" on stage 1."""
    torch.manual_seed(0)
    model = SpeechNet()
    ref = copy.deepcopy(model)
    executor, stage = stage_of(model, 1)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))  # 3 per micro-batch: unpacking the wrong one's rows fails
    received = torch.randn(3, 4, requires_grad=True)
    executor.begin("training_step", model.training_step, (x, y), (0,), 6, 2, 1.0, True)
    executor.on_chunk(1, 0)
    out = stage(received)
    want = F.cross_entropy(ref.head(ref.blocks[3](ref.blocks[2](received, scale=0.5), scale=0.5)), y[:3]) * 0.5
    assert torch.allclose(out[0], want)


def test_shape_inference_runs_the_step_on_every_stage_but_the_last() -> None:
    """torch's shape inference (no chunk): the first stage runs the step up to its blocks (it must send their
    output's shape); the last stage answers without running the step, whose code after the model call (metric
    updates, lists) must see each micro-batch once, with a (1,) tensor whose gradient reaches the received one."""
    calls: list[str] = []

    class Counting(Net):
        def training_step(self, batch, batch_idx):
            calls.append("before the model")
            loss = super().training_step(batch, batch_idx)
            calls.append("after the model")
            return loss

    for stage_index in (0, 1):
        calls.clear()
        model = Counting()
        executor, stage = stage_of(model, stage_index)
        executor.begin("training_step", model.training_step, batch(), (0,), 4, 2, 1.0, True)
        executor.on_chunk(stage_index, None)
        received = torch.randn(2, 4, requires_grad=True)
        out = stage(torch.arange(0, 2) if stage_index == 0 else received)
        if stage_index == 0:
            assert calls == ["before the model"] and out.shape == (2, 4)
        else:
            assert calls == [] and out.shape == (1,)
            (grad,) = torch.autograd.grad(out.sum(), received)
            assert grad.shape == received.shape and not grad.any()
        logs, outputs = executor.finish()
        assert not logs.entries and not outputs


def test_a_second_model_call_in_one_step_is_refused_with_the_alternative() -> None:
    """generate() and other repeated calls: the last stage cannot feed a second call (it failed deep inside the
    model, "The size of tensor a (8) must match the size of tensor b (4)", for a Hugging Face generate())."""

    class Twice(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self(x)
            return F.cross_entropy(self(x), y)

    model = Twice()
    executor, stage = stage_of(model, 1)
    executor.begin("training_step", model.training_step, batch(), (0,), 4, 2, 1.0, True)
    executor.on_chunk(1, 0)
    with pytest.raises(ValueError, match=r"Twice\.training_step ran the model a second time on pipeline stage 1"):
        stage(torch.randn(2, 4, requires_grad=True))


def run_last_stage(model: Net, received: torch.Tensor | None = None) -> torch.Tensor:
    """The last of two stages on the first micro-batch of two, fed a received activation."""
    executor, stage = stage_of(model, 1)
    executor.begin("training_step", model.training_step, batch(), (0,), 4, 2, 1.0, True)
    executor.on_chunk(1, 0)
    return stage(received if received is not None else torch.randn(2, 4, requires_grad=True))


def test_reading_a_parameter_of_another_stages_module_names_it_and_the_fix() -> None:
    class ReadsTheEmbedding(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h) + self.embed.bias.sum()  # the first stage's parameter, on the last stage

    model = ReadsTheEmbedding()
    with pytest.raises(RuntimeError, match=r"embed.bias was used in a computation on pipeline stage 1, but it is held"):
        run_last_stage(model)
    assert not hasattr(model.embed, "weight")  # outside a step, probes still see an AttributeError


def test_the_model_called_outside_the_steps_says_so_and_what_works() -> None:
    """An epoch-end hook calling the model (``generate()`` for sample text) under pp > 1 reached a module of another
    stage with no stage running. It said *"stage ? reached it before its blocks ... name the container with
    ThreeDStrategy(blocks=...)"*, as if the split were wrong; now it names the call outside the steps and what
    works instead. Both stages: the last reaches the embedding, the first the head."""
    x, _ = batch()
    for stage, reached in ((1, "embed"), (0, "head")):
        model = Net()
        stage_of(model, stage)
        with pytest.raises(RuntimeError, match=rf"called outside the training.*reached {reached}, which pipeline"):
            model(x)
    with pytest.raises(AttributeError, match="called outside the training, validation, test and predict steps"):
        model.head.weight  # noqa: B018  (the first stage reads the head's weight outside a step)


def test_a_skip_connection_across_the_boundary_is_named() -> None:
    with pytest.raises(ValueError, match=r"crosses the stage boundary between blocks.0 and blocks.2"):
        run_last_stage(Net(skip=True))


def test_a_step_that_skips_the_model_is_refused() -> None:
    model = Net()
    executor, stage = stage_of(model, 0)
    executor.begin("training_step", lambda batch, idx: batch[0].sum(), batch(), (0,), 4, 2, 1.0, True)
    executor.on_chunk(0, 0)
    with pytest.raises(ValueError, match=r"returned without running the blocks of pipeline stage 0"):
        stage(torch.arange(0, 2))


def test_a_step_that_returns_none_to_skip_the_batch_is_refused_with_the_alternative() -> None:
    model = Net()
    executor, stage = stage_of(model, 0)
    executor.begin("training_step", lambda batch, idx: None, batch(), (0,), 4, 2, 1.0, True)
    executor.on_chunk(0, 0)
    with pytest.raises(ValueError, match=r"returned None before running the model .* in the data pipeline"):
        stage(torch.arange(0, 2))


class MidNet(Net):
    """A module with parameters registered after the blocks (the last stage's by default) but called between
    blocks 0 and 1: ``stages=`` puts it on stage 0, where the forward runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h, scale=0.5)
            h = self.mid(h) if i == 0 else h
        return self.head(h)


def test_a_module_placed_on_an_earlier_stage_runs_there_and_is_stood_in_for_later() -> None:
    torch.manual_seed(0)
    model = MidNet()
    ref = copy.deepcopy(model)
    x, y = batch()
    for index in (0, 1):
        part = copy.deepcopy(model)
        ranges = [range(0, 2), range(2, 4)]
        split = split_model(part, find_blocks(part), pp=2, ranges=ranges, placement={"mid": 0})
        assert split.modules_of(0) == ["embed", "blocks.0", "blocks.1", "mid"] and "mid" not in split.modules_of(1)
        executor = StageExecutor(part, split, [index])
        executor.prune()
        stage = StageModule(index, {n: part.get_submodule(n) for n in split.modules_of(index)}, executor)
        executor.begin("training_step", part.training_step, (x, y), (0,), 4, 1, 1.0, True)
        executor.on_chunk(index, 0)
        if index == 0:
            got = stage(torch.arange(0, 4))
            want = ref.blocks[1](ref.mid(ref.blocks[0](ref.embed(x), scale=0.5)), scale=0.5)
        else:  # mid is reached before this stage's first block: stood in for, its output replaced anyway
            received = torch.randn(4, 4)
            got = stage(received)[0]
            want = F.cross_entropy(ref.head(ref.blocks[3](ref.blocks[2](received, scale=0.5), scale=0.5)), y)
        assert torch.allclose(got, want)


def test_an_earlier_blocks_output_read_after_the_blocks_is_carried_to_the_last_stage() -> None:
    """The skip (blocks.0's output added before the head) was refused; the first step's check now finds it, stage 0
    sends it after its last block's output, and the last stage's stand-in for blocks.0 returns it: the loss and the
    gradients of both received tensors are the unsplit model's."""
    from lightning_3d.core.boundary_check import make_skeleton

    torch.manual_seed(0)
    model = Net(skip=True)
    ref = copy.deepcopy(model)
    x, y = batch()
    outputs = []
    for stage in (0, 1):
        net = copy.deepcopy(model)
        split = split_model(net, find_blocks(net), pp=2, ranges=[range(0, 2), range(2, 4)])
        executor = StageExecutor(net, split, [stage], skeleton=make_skeleton(net))
        executor.prune()
        assert executor.check_first_step("training_step", (x, y), (0,), 4, 2)  # what crosses changed
        assert [(v.module, v.index, v.stage, v.last) for v in executor.carry.values] == [("blocks.0", 0, 0, 1)]
        module = StageModule(stage, {n: net.get_submodule(n) for n in split.modules_of(stage)}, executor)
        executor.begin("training_step", net.training_step, (x, y), (0,), 4, 2, 1.0, True)
        executor.on_chunk(stage, 0)
        if stage == 0:
            sent = module(torch.arange(4))
            assert isinstance(sent, tuple) and len(sent) == 2
            outputs = [t.detach().requires_grad_(True) for t in sent]
        else:
            loss = module(*outputs)
            loss.sum().backward()
    h0 = ref.blocks[0](ref.embed(x[:2]), scale=0.5)
    h2 = ref.blocks[1](h0, scale=0.5)
    # the last stage's part: from blocks.1's output and blocks.0's, each a leaf (stage 0 takes both gradients back)
    h2, h0 = h2.detach().requires_grad_(True), h0.detach().requires_grad_(True)
    want = F.cross_entropy(ref.head(ref.blocks[3](ref.blocks[2](h2, scale=0.5), scale=0.5) + h0), y[:2]) * 0.5
    assert torch.allclose(loss[0], want)
    grads = torch.autograd.grad(want, (h2, h0))
    assert all(torch.allclose(o.grad, g) for o, g in zip(outputs, grads, strict=True))


def test_values_a_later_check_adds_for_a_module_already_carrying_one_are_sent_too() -> None:
    """An evaluation step's check (sanity validation comes first) may find one output of a module to carry and
    training's check another of the same module: the module's hook must send both from then on."""
    from lightning_3d.core.carry import Carried, CarryPlan

    class TwoOut(Block):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            h = super().forward(x, scale)
            return h, h * 2

    torch.manual_seed(0)
    model = Net()
    model.blocks[1] = TwoOut()
    model.forward = lambda x: model.head(model.blocks[3](model.blocks[2](model.blocks[1](model.blocks[0](
        model.embed(x)))[0])))  # fmt: skip
    split = split_model(model, find_blocks(model, "blocks"), pp=2, ranges=[range(0, 2), range(2, 4)])
    executor = StageExecutor(model, split, [0])
    executor.prune()
    executor.use_carry(CarryPlan((Carried(0, 2, "blocks.1", 1, 1),)))  # found first (validation)
    executor.use_carry(CarryPlan((Carried(0, 2, "blocks.1", 0, 1),)))  # and then (training)
    module = StageModule(0, {n: model.get_submodule(n) for n in split.modules_of(0)}, executor)
    x, y = batch()
    executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(0, 0)
    flowing, first, second = module(torch.arange(4))
    assert torch.equal(first, flowing) and torch.allclose(second, flowing * 2)


class Checkpointed(Net):
    """Calls each block through ``torch.utils.checkpoint`` itself, as some forwards do."""

    def __init__(self, reentrant: bool, span: bool = False) -> None:
        super().__init__()
        self.reentrant, self.span = reentrant, span

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.span:  # one checkpoint around blocks 0-2, across the stage boundary after block 1
            h = checkpoint(lambda h: self.run(h, self.blocks[:3]), h, use_reentrant=self.reentrant)
            return self.head(self.blocks[3](h, scale=0.5))
        for block in self.blocks:
            h = checkpoint(lambda h, block=block: block(h, scale=0.5), h, use_reentrant=self.reentrant)
        return self.head(h)

    @staticmethod
    def run(h: torch.Tensor, blocks: Sequence[nn.Module]) -> torch.Tensor:
        for block in blocks:
            h = block(h, scale=0.5)
        return h


@pytest.mark.parametrize("span", [False, True], ids=["each-block", "across-the-boundary"])
def test_a_block_the_forward_checkpoints_itself_recomputes_from_the_received_tensor(span: bool) -> None:
    """The stage's first block is called inside the user's checkpoint: the recomputation in the backward calls it
    again with the input the checkpoint kept, outside any stage. That input is now the received tensor (the stand-in
    of the block before returns it); it was the stand-ins' output, so the block's weights got the gradient of
    another input (1e-1 off). A checkpoint around blocks of both stages calls the stand-ins again too: they return
    what they returned in the forward for the same input."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=False, span=span)
    ref = copy.deepcopy(model)
    received = torch.randn(2, 4, requires_grad=True)
    run_last_stage(model, received).sum().backward()
    _, y = batch()
    mine = received.detach().clone().requires_grad_(True)
    want = F.cross_entropy(ref.head(ref.blocks[3](ref.blocks[2](mine, scale=0.5), scale=0.5)), y[:2]) * 0.5
    want.backward()
    assert torch.allclose(received.grad, mine.grad, rtol=1e-6, atol=1e-7)
    for i in (2, 3):
        assert torch.allclose(model.blocks[i].fc.weight.grad, ref.blocks[i].fc.weight.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage_index", [0, 1], ids=["last-block-of-stage-0", "first-block-of-stage-1"])
def test_a_reentrant_checkpoint_at_a_stage_boundary_is_refused(stage_index: int) -> None:
    """The reentrant variant runs the block without gradients: a stage's output got none (stage 0), and the received
    tensor's gradient could not be kept (stage 1)."""
    model = Checkpointed(reentrant=True)
    executor, stage = stage_of(model, stage_index)
    x, y = batch()
    executor.begin("training_step", model.training_step, (x, y), (0,), 4, 2, 1.0, True)
    executor.on_chunk(stage_index, 0)
    block = "blocks.1, the last" if stage_index == 0 else "blocks.2, the first"
    with pytest.raises(ValueError, match=rf"calls {block} block of pipeline stage {stage_index}.*use_reentrant=True"):
        stage(torch.arange(0, 2) if stage_index == 0 else torch.randn(2, 4, requires_grad=True))


def test_the_stand_in_before_a_stage_called_again_with_another_tensor_and_no_stage_running_raises() -> None:
    """What the recomputation of a checkpoint around the whole forward does (the stand-ins before it made new
    tensors): the stand-in that hands the stage its received activation cannot tell what to return."""
    model = Checkpointed(reentrant=False, span=True)
    run_last_stage(model)
    with pytest.raises(RuntimeError, match=r"blocks\.1 \(held by pipeline stage 0\) was called with no pipeline stage"):
        model.blocks[1](torch.randn(2, 4), scale=0.5)
    assert model.blocks[0](h := torch.randn(2, 4), scale=0.5) is h  # the others pass their input on, as before
