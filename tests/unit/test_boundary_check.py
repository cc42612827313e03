"""core/boundary_check.py: what crosses a pipeline stage boundary, found at setup on fake tensors."""

from __future__ import annotations

import itertools

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.core.agreed import is_agreed
from lightning_3d.core.blocks import find_blocks, split_model, stage_ranges_from_names
from lightning_3d.core.boundary_check import (
    FOUND_AT_FIRST_STEP,
    FOUND_AT_SETUP,
    Checked,
    check_first_step,
    check_stage_boundaries,
    make_skeleton,
)
from lightning_3d.core.stage_exec import StageExecutor


class Block(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.fc(x) * (1.0 if scale is None else scale)


class Net(nn.Module):
    """An embedding, four blocks, a final norm and a head; ``kind`` chooses how the forward wires them."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(8, 4)
        self.h = nn.ModuleList(Block() for _ in range(4))
        self.mid = nn.LayerNorm(4)  # registered after the blocks: the last stage's by default
        self.ln_f = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        first = x
        scale = torch.ones(())
        if self.kind == "data_dependent" and bool(x.sum() > 0):  # needs real values
            x = x * 2
        for i, block in enumerate(self.h):
            if self.kind == "residual_outside":
                x = x + block(x)
            elif self.kind == "kwarg_from_embedding":
                x = block(x, scale=first.mean())
            elif self.kind.startswith("checkpoint"):  # "checkpoint_reentrant" / "checkpoint": the blocks' own recompute
                x = checkpoint(block, x, scale, use_reentrant=self.kind == "checkpoint_reentrant")
            else:
                x = block(x, scale=scale)
            if self.kind == "mid_norm" and i == 0:
                x = self.mid(x)
        if self.kind == "skip":
            x = x + first
        if self.kind == "extra_output":  # what training_step uses is the first output
            return self.head(self.ln_f(x)), first
        return self.head(self.ln_f(x))


def _split(model: nn.Module, stages: list[list[str]] | None = None, cuts: tuple[int, ...] = (2,)):
    container = find_blocks(model)
    if stages is not None:
        ranges, placement = stage_ranges_from_names(model, container, stages, len(stages))
    else:
        bounds = (0, *cuts, len(container.names))
        ranges, placement = [range(a, b) for a, b in itertools.pairwise(bounds)], {}
    return split_model(model, container, len(ranges), ranges, 1, placement)


IDS = torch.zeros(2, 3, dtype=torch.long)


def test_a_model_whose_blocks_chain_passes_and_nothing_real_is_touched() -> None:
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    assert check_stage_boundaries(model, _split(model), IDS) == Checked()  # ran, and nothing is carried
    assert check_stage_boundaries(model, _split(model, cuts=(1, 2, 3)), (IDS,)) == Checked()
    assert check_stage_boundaries(model, _split(model), {"idx": IDS}) == Checked()
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_users_hook_replacing_a_blocks_output_is_checked_on_what_flows() -> None:
    """The check's own output hook runs after the user's (ahead only of Hugging Face's output recorders): a hook
    returning a new output for the block before a boundary (activation steering, a clamp) is what flows on, and the
    check sees the next stage's first block get exactly that."""
    model = Net()
    model.h[1].register_forward_hook(lambda module, args, output: output * 0.5)
    assert check_stage_boundaries(model, _split(model), IDS) == Checked()


class LayerDropNet(Net):
    """``Net("skip")`` whose loop skips blocks at random as Hugging Face's LayerDrop does, reading ``layerdrop`` from
    the module (BART, M2M100) or from its config (the speech encoders)."""

    def __init__(self, from_config: bool) -> None:
        super().__init__("skip")
        if from_config:
            self.config = type("Config", (), {})()
            self.config.layerdrop = 0.5
        else:
            self.layerdrop = 0.5

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        rate = self.config.layerdrop if hasattr(self, "config") else self.layerdrop
        x = first = self.wte(idx)
        for block in self.h:
            # as Hugging Face writes it: the draw, a value read back that no fake tensor can give, only when rate > 0
            if self.training and rate > 0 and torch.rand([]) < rate:
                continue
            x = block(x)
        return self.head(self.ln_f(x + first))


@pytest.mark.parametrize("from_config", [False, True])
def test_layer_drop_is_off_while_the_check_runs_so_every_block_is_seen(from_config: bool) -> None:
    """Before 2026-12-05 LayerDrop's draw stopped the check (*"DataDependentOutputException"*), so nothing was carried
    and M2M100 at pp2 died in the first step with a skip-connection error."""
    model = LayerDropNet(from_config)
    assert _carried(check_stage_boundaries(model, _split(model), IDS)) == [("wte", 0, 0, 1)]
    assert (model.config if from_config else model).layerdrop == 0.5  # put back


def _carried(checked: Checked) -> list[tuple[str, int, int, int]]:
    assert checked.not_checked is None, checked.not_checked
    return [(v.module, v.index, v.stage, v.last) for v in checked.carry.values]


def test_a_model_on_the_meta_device_is_checked_too() -> None:
    with torch.device("meta"):
        model = Net("skip")
    assert _carried(check_stage_boundaries(model, _split(model), IDS)) == [("wte", 0, 0, 1)]
    with torch.device("meta"):
        model = Net("residual_outside")
    with pytest.raises(ValueError, match=r"between h\.1 and h\.2"):
        check_stage_boundaries(model, _split(model), IDS)


@pytest.mark.parametrize(
    ("kind", "cuts", "carried"),
    [
        ("skip", (2,), [("wte", 0, 0, 1)]),  # the embedding's output added after the blocks, on the last stage
        ("skip", (1, 3), [("wte", 0, 0, 2)]),  # ... passed on by the middle stage
        ("kwarg_from_embedding", (2,), [("wte", 0, 0, 1)]),  # read by the blocks of stage 1
        ("kwarg_from_embedding", (1, 2, 3), [("wte", 0, 0, 3)]),
    ],
)  # fmt: skip
def test_a_module_output_a_later_stage_reads_is_carried(kind: str, cuts: tuple[int, ...], carried: list) -> None:
    """An earlier stage's module output that a later stage reads was refused; now the boundaries carry it up to the
    last stage that reads it."""
    model = Net(kind)
    assert _carried(check_stage_boundaries(model, _split(model, cuts=cuts), IDS)) == carried
    assert check_stage_boundaries(Net(kind), _split(Net(kind), cuts=()), IDS) == Checked()  # one stage


def test_a_value_computed_between_two_blocks_is_refused_and_named() -> None:
    model = Net("residual_outside")  # x = x + block(x): the sum made between h.1 and h.2 would be lost
    with pytest.raises(ValueError, match=r"a skip connection crosses the stage boundary between h.1 and h.2 \(in "
                                         r"the input of h.2\)") as err:  # fmt: skip
        check_stage_boundaries(model, _split(model), IDS)
    assert FOUND_AT_SETUP in str(err.value)


class BiasBlock(nn.Module):
    """Returns ``(hidden, bias)``: the first block makes the bias, the others use it (T5's position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.sigmoid(self.fc.bias) if bias is None else bias
        return x + self.fc(x) + bias, bias


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.kept = {"last_hidden_state": self.fc(x)}  # an output object, as a Hugging Face encoder's, also kept
        return self.kept


class MemoryBlock(Block):
    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) * memory.mean()


class SecondOutputs(nn.Module):
    """``kind="bias"``: blocks pass a bias along; ``kind="encoder"``: the blocks read an encoder's output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(8, 4)
        self.encoder = Encoder()
        self.h = nn.ModuleList((BiasBlock if kind == "bias" else MemoryBlock)() for _ in range(4))
        self.head = nn.Linear(4, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, bias = self.wte(idx), None
        memory = self.encoder(x)["last_hidden_state"]
        for block in self.h:
            if self.kind == "bias":
                x, bias = block(x, bias)
            else:
                x = block(x, memory)
        return self.head(x)


@pytest.mark.parametrize(
    ("kind", "carried"), [("bias", [("h.1", 1, 0, 1)]), ("encoder", [("encoder", 0, 0, 1)])]
)  # fmt: skip
def test_a_second_value_a_module_returns_is_carried(kind: str, carried: list) -> None:
    """Only a module's first output was tagged, so a bias the first block makes for the others (T5) or an encoder's
    output object read by the blocks crossed to the next stage unnoticed: a Hugging Face T5 at tp2 x pp2 trained
    with wrong gradients (0.03 off one device's after one step), no error. Every floating-point output is tagged,
    and the one a later stage reads is carried (the bias as the last block before the boundary returns it)."""
    model = SecondOutputs(kind)
    assert _carried(check_stage_boundaries(model, _split(model), IDS)) == carried
    assert check_stage_boundaries(model, _split(model, cuts=()), IDS) == Checked()
    if kind == "encoder":  # the dict the module returned and kept holds its own tensors, not the check's tags
        kept = model.encoder.kept["last_hidden_state"]
        assert not kept.requires_grad or kept.grad_fn is not None


def test_an_encoder_decoder_split_in_its_decoder_carries_the_encoder_output_and_the_position_biases() -> None:
    """A Hugging Face T5 split at its decoder's blocks: the second decoder layer reads the position biases the first
    one returns and the encoder's output."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    assert find_blocks(model).fqn == "decoder.block"
    ids = torch.ones(2, 5, dtype=torch.long)
    carried = _carried(check_stage_boundaries(model, _split(model, cuts=(1,)), {"input_ids": ids, "labels": ids}))
    assert carried == [("encoder", 0, 0, 1), ("decoder.block.0", 1, 0, 1), ("decoder.block.0", 2, 0, 1)]


def test_a_module_used_on_a_stage_that_does_not_hold_it_is_refused() -> None:
    model = Net("mid_norm")  # mid runs between h.0 and h.1 but belongs to the last stage by default
    with pytest.raises(ValueError, match=r"calls mid before h.1, which is pipeline stage 0's part of the forward, "
                                         r"but stage 1 holds it. Put mid on stage 0"):  # fmt: skip
        check_stage_boundaries(model, _split(model), IDS)
    placed = _split(model, [["h.0", "mid", "h.1"], ["h.2", "h.3"]])
    assert check_stage_boundaries(model, placed, IDS) == Checked()
    moved = _split(Net(), [["h.0", "h.1"], ["wte", "h.2", "h.3"]])  # the embedding is needed by stage 0
    with pytest.raises(ValueError, match=r"calls wte before the blocks, which is pipeline stage 0's part"):
        check_stage_boundaries(Net(), moved, IDS)
    head_early = _split(Net(), [["h.0", "h.1", "head"], ["h.2", "h.3"]])
    with pytest.raises(ValueError, match=r"calls head after the blocks, which is pipeline stage 1's part"):
        check_stage_boundaries(Net(), head_early, IDS)


def test_a_forward_that_needs_real_values_leaves_the_check_to_the_first_step() -> None:
    model = Net("data_dependent")
    reason = check_stage_boundaries(model, _split(model), IDS).not_checked
    assert reason is not None and "DataDependent" in reason
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class DictBlock(Block):
    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"hidden": super().forward(x, scale)}


class DictNet(Net):
    """Blocks that return a mapping (the executor sends its first tensor): nothing to tag, nothing refused."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(DictBlock() for _ in range(4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)["hidden"]
        return self.head(self.ln_f(x))


def test_extra_outputs_and_blocks_returning_mappings_are_not_refused() -> None:
    assert check_stage_boundaries(Net("extra_output"), _split(Net("extra_output")), IDS) == Checked()
    assert check_stage_boundaries(DictNet(), _split(DictNet(), cuts=(1, 3)), IDS) == Checked()


class LitNet(LightningModule):
    """A LightningModule without an ``example_input_array``: its step logs and computes the loss itself."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.net = Net(kind)
        self.register_buffer("steps", torch.zeros(()))
        self.logged: list[str] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, target = batch
        loss = nn.functional.cross_entropy(self.net(idx).flatten(0, 1), target.flatten())
        self.logged.append("train_loss")
        self.log("train_loss", loss)
        return loss


BATCH = (torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long))


def test_the_skeleton_holds_no_real_storage_and_shares_the_trainer() -> None:
    lit = LitNet()
    trainer = object()
    lit.__dict__["_trainer"] = trainer  # what Lightning attaches; LightningModule.__getstate__ would drop it
    lit.net.attribute = torch.ones(3)  # a plain tensor attribute: shared with the copy, not duplicated
    skeleton = make_skeleton(lit)
    assert isinstance(skeleton, LitNet) and skeleton is not lit
    tensors = [*skeleton.parameters(), *skeleton.buffers()]
    assert len(tensors) == len([*lit.parameters(), *lit.buffers()]) and all(t.is_meta for t in tensors)
    assert all(not t.is_meta for t in [*lit.parameters(), *lit.buffers()])
    assert skeleton.__dict__["_trainer"] is trainer and skeleton.net.attribute is lit.net.attribute
    assert skeleton.log("x", 1.0) is None and skeleton.log_dict({"x": 1.0}) is None


def test_tied_weights_stay_tied_in_the_skeleton() -> None:
    lit = LitNet()
    lit.net.head.weight = lit.net.wte.weight
    skeleton = make_skeleton(lit)
    assert skeleton.net.head.weight is skeleton.net.wte.weight and skeleton.net.wte.weight.is_meta


def test_the_first_step_check_runs_training_step_on_fakes() -> None:
    lit = LitNet()
    before = {n: p.detach().clone() for n, p in lit.named_parameters()}
    skeleton = make_skeleton(lit)
    assert check_first_step(skeleton, _split(skeleton), "training_step", BATCH, (0,)) == Checked()
    assert lit.logged == [] and skeleton.logged == ["train_loss"]  # the copy's step ran, its log did nothing
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in lit.named_parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in skeleton.modules())


class _Uncopyable:
    """What Lightning's ``PyTorchProfiler`` hooks hold (open ``record_function`` records): refuses ``deepcopy``."""

    def __init__(self) -> None:
        self.calls = 0

    def __deepcopy__(self, memo: dict) -> None:
        raise RuntimeError("Tried to deepcopy object which does not have a __getstate__ method defined!")

    def hook(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1


class _Copyable:
    def hook(self, module: nn.Module, args: tuple) -> None:
        pass


def test_a_hook_that_cannot_be_copied_is_shared_and_the_check_still_runs() -> None:
    lit = LitNet("residual_outside")
    recorder = _Uncopyable()
    for module in lit.modules():
        module.register_forward_pre_hook(recorder.hook)
    skeleton = make_skeleton(lit)
    assert not isinstance(skeleton, str), skeleton  # was: "the model could not be copied (RuntimeError: ...)"
    with pytest.raises(ValueError, match=r"between net\.h\.1 and net\.h\.2"):
        check_first_step(skeleton, _split(skeleton), "training_step", BATCH, (0,))
    assert recorder.calls > 0  # the shared hook ran on the copy's fake forward

    plain = LitNet()
    plain.net.register_forward_pre_hook(_Copyable().hook)  # copyable hooks are copied, as before
    copied = make_skeleton(plain)
    assert not isinstance(copied, str)
    (original,), (copy,) = plain.net._forward_pre_hooks.values(), copied.net._forward_pre_hooks.values()
    assert isinstance(copy.__self__, _Copyable) and copy.__self__ is not original.__self__


def test_the_first_step_check_carries_a_skip_and_refuses_a_sum_between_blocks() -> None:
    skeleton = make_skeleton(LitNet("skip"))
    assert _carried(check_first_step(skeleton, _split(skeleton), "training_step", BATCH, (0,))) == [
        ("net.wte", 0, 0, 1)
    ]
    skeleton = make_skeleton(LitNet("residual_outside"))
    with pytest.raises(ValueError) as err:
        check_first_step(skeleton, _split(skeleton), "training_step", BATCH, (0,))
    message = str(err.value)
    assert "a skip connection crosses the stage boundary between net.h.1 and net.h.2" in message
    assert FOUND_AT_FIRST_STEP in message and FOUND_AT_SETUP not in message


class LoggingEval(LitNet):
    """An evaluation step that returns nothing and logs its loss and the norm of the embedding's output, which the
    model returns besides its logits (the second output: no module of the last stage reads it)."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        idx, target = batch
        logits, first = self.net(idx)
        self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()))
        self.log_dict({"emb_norm": first.norm(), "constant": 1.0})


def test_what_an_evaluation_step_logs_is_carried_like_a_loss() -> None:
    """The last stage's logged values are the ones that count: one read of an earlier stage's module output that
    no module of the last stage reads (the embedding's output, logged) must be carried, also when the step returns
    nothing. Until 2026-12-06 the check looked at the returned loss only, and the logged norm was the stand-in's
    zeros' (Mixtral's load-balancing loss in a validation step that only logs it was refused for the same reason)."""
    skeleton = make_skeleton(LoggingEval("extra_output"))
    split = _split(skeleton)
    assert _carried(check_first_step(skeleton, split, "validation_step", BATCH, (0,))) == [("net.wte", 0, 0, 1)]
    assert _carried(check_first_step(skeleton, split, "validation_step", BATCH, (0,))) == [("net.wte", 0, 0, 1)]


def test_a_data_dependent_training_step_leaves_the_check_to_the_first_step() -> None:
    skeleton = make_skeleton(LitNet("data_dependent"))
    reason = check_first_step(skeleton, _split(skeleton), "training_step", BATCH, (0,)).not_checked
    assert reason is not None and "DataDependent" in reason, reason


def test_the_executor_checks_each_hooks_first_batch_once_then_frees_the_skeleton() -> None:
    bad = LitNet("residual_outside")
    executor = StageExecutor(bad, _split(bad), [0], skeleton=make_skeleton(bad))
    with pytest.raises(ValueError, match=r"between net\.h\.1 and net\.h\.2") as err:
        executor.check_first_step("training_step", BATCH, (0,), 4, 2)
    assert is_agreed(err.value) and executor._skeleton is None  # every rank raises it: printed once, no fail-fast

    good = LitNet()
    executor = StageExecutor(good, _split(good), [0], skeleton=make_skeleton(good))
    assert not executor.check_first_step("validation_step", BATCH, (0,), 4, 2)  # sanity-check validation: checked
    assert executor._skeleton is not None and not executor._checked  # kept for training_step's check
    assert not executor.check_first_step("training_step", BATCH, (0,), 4, 2)  # nothing carried: nothing changed
    assert executor._skeleton is None and executor._checked == {0}  # no in-schedule check needed any more
    assert not executor.check_first_step("validation_step", BATCH, (0,), 4, 2)  # once per hook

    skip = LitNet("skip")
    executor = StageExecutor(skip, _split(skip), [0, 1], skeleton=make_skeleton(skip))
    before = executor.carry_key
    assert executor.check_first_step("training_step", BATCH, (0,), 4, 2)  # what is carried changed
    assert executor.carry_key != before and [v.module for v in executor.carry.values] == ["net.wte"]

    dependent = LitNet("data_dependent")
    executor = StageExecutor(dependent, _split(dependent), [0], skeleton=make_skeleton(dependent))
    with pytest.warns(UserWarning, match="could not run on fake tensors before the first step"):
        executor.check_first_step("training_step", BATCH, (0,), 4, 2)
    assert executor._skeleton is None and not executor._checked  # the first real forward is checked instead


def test_the_skeleton_shares_tensors_kept_in_lists_instead_of_copying_them() -> None:
    """The strategy keeps a skeleton of every model (a checkpoint file of one device is numbered by it): outputs a
    LightningModule keeps in a list or dict attribute are shared with it, not copied (memory), while its parameters,
    also when a list names one, are meta copies."""
    import lightning as L

    class Keeps(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.outputs = [torch.ones(64, 64), {"val": (torch.zeros(3),)}]
            self.named = [self.layer.weight]

    module = Keeps()
    skeleton = make_skeleton(module)
    assert not isinstance(skeleton, str)
    assert skeleton.outputs is not module.outputs  # the containers are the copy's own
    assert skeleton.outputs[0] is module.outputs[0] and skeleton.outputs[1]["val"][0] is module.outputs[1]["val"][0]
    assert skeleton.layer.weight.is_meta and skeleton.named[0] is skeleton.layer.weight


@pytest.mark.parametrize(("cuts", "last"), [((2,), "net.h.1"), ((1, 3), "net.h.0")], ids=["pp2", "pp3"])
def test_a_reentrant_checkpoint_at_a_stage_boundary_is_refused_by_the_training_steps_check(cuts, last) -> None:
    """The blocks called through torch's reentrant checkpoint (its default): the block at a boundary runs without
    gradients inside it, so the boundary would get none; refused on every rank before the first step. The
    non-reentrant variant passes, and an evaluation step (no gradients to carry) is checked as usual."""
    skeleton = make_skeleton(LitNet("checkpoint_reentrant"))
    pattern = rf"calls {last}, the last block of pipeline stage 0, through .*use_reentrant=True.*use_reentrant=False"
    with pytest.raises(ValueError, match=pattern) as err:
        check_first_step(skeleton, _split(skeleton, cuts=cuts), "training_step", BATCH, (0,))
    assert FOUND_AT_FIRST_STEP in str(err.value)
    LitNet.validation_step = LitNet.training_step
    try:
        assert (
            check_first_step(skeleton, _split(skeleton, cuts=cuts), "validation_step", BATCH, (0,)).not_checked is None
        )
    finally:
        del LitNet.validation_step
    plain = make_skeleton(LitNet("checkpoint"))
    assert check_first_step(plain, _split(plain, cuts=cuts), "training_step", BATCH, (0,)) == Checked()
