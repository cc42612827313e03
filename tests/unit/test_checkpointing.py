"""Activation checkpointing per block (``lightning_3d/core/checkpointing.py``), in one process.

The reference is the same model without checkpointing, run from the same generator states: gradients must be
bitwise equal (float64), with dropout inside and outside a tensor-parallel region whose stream
``BodyRandomness`` swaps in by hooks inside the block.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_3d.core import parallelize
from lightning_3d.core.checkpointing import checkpoint_blocks, checkpoint_every, chosen_blocks
from lightning_3d.core.rng import BodyRandomness
from lightning_3d.settings import ThreeDSettings


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc, self.inner = nn.Linear(16, 32), nn.Dropout(0.5)  # inner: a tensor-parallel region's dropout
        self.proj, self.outer = nn.Linear(32, 16), nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.outer(self.proj(self.inner(torch.relu(self.fc(self.norm(x))))))


STYLES = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}  # only their kinds matter to the region hooks


class UncountedBlock(Block):
    """``Block`` without the call counter (under ``torch.compile`` a changing attribute is a guard that fails at
    every call, so dynamo would recompile until it gives up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(self.proj(self.inner(torch.relu(self.fc(self.norm(x))))))


def _model(block: type[Block] = Block) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), block(), block(), block(), block(), nn.Linear(16, 4)).double()


def _with_streams(model: nn.Sequential) -> BodyRandomness:
    randomness = BodyRandomness(seed=7, stages=[0], tp_rank=0, device=torch.device("cpu"))
    randomness.install_stage(model, 0)
    for block in model[1:5]:
        randomness.install_regions(block, STYLES, 0)
    return randomness


def _grads(model: nn.Sequential, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches' forward and backward (the streams advance between them), gradients per step."""
    torch.manual_seed(123)
    out = []
    for step in range(steps):
        model.zero_grad()
        x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _assert_same(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        for name in e:
            assert torch.equal(g[name], e[name]), name


def test_setting_forms_and_refusals() -> None:
    assert [checkpoint_every(v) for v in (None, False, "full", "selective", 1, 3)] == [
        None,
        None,
        "full",
        "selective",
        "full",
        3,
    ]
    for bad in (True, 0, -2, "some", 1.5):
        with pytest.raises(ValueError, match="activation_checkpointing must be None"):
            checkpoint_every(bad)
    assert ThreeDSettings(activation_checkpointing=2).activation_checkpointing == 2
    with pytest.raises(ValueError, match="activation_checkpointing='selective' with compile"):
        ThreeDSettings(activation_checkpointing="selective", compile=True)
    assert ThreeDSettings(activation_checkpointing="full", compile={"backend": "aot_eager"}).compile
    assert ThreeDSettings(activation_checkpointing=2, compile=True).activation_checkpointing == 2


def test_every_nth_counts_over_the_whole_model() -> None:
    names = [f"h.{i}" for i in range(6)]
    assert chosen_blocks(names, 2) == ["h.1", "h.3", "h.5"]
    assert chosen_blocks(names, 4) == ["h.3"]
    assert chosen_blocks(names, "full") == names == chosen_blocks(names, "selective")


@pytest.mark.parametrize("mode", ["full", "selective", 2])
def test_names_unchanged_and_gradients_bitwise_equal_with_region_streams(mode) -> None:
    reference, model = _model(), _model()  # the same weights; hooks of their own (deepcopy would share closures)
    _with_streams(reference)
    keys = list(model.state_dict())
    randomness = _with_streams(model)
    chosen = [(str(i), model[i]) for i in range(1, 5)]
    chosen = [(n, m) for n, m in chosen if n in chosen_blocks([c for c, _ in chosen], "full" if mode != 2 else 2)]
    done = checkpoint_blocks(chosen, mode)
    done.randomness = randomness
    assert list(model.state_dict()) == keys  # no "_checkpoint_wrapped_module." anywhere
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    expected, got = _grads(reference), _grads(model)
    _assert_same(got, expected)
    # the checkpointed blocks really were recomputed in the backward (twice per micro-batch), the others not
    recomputed = {n for n, _ in chosen}
    for i in range(1, 5):
        assert model[i].calls == (4 if str(i) in recomputed else 2), (i, model[i].calls)
    # and the streams ended where the reference's did (the next micro-batch draws the same masks)
    torch.testing.assert_close(_grads(model, 1), _grads(reference, 1), rtol=0, atol=0)


def test_without_the_region_replay_the_masks_differ() -> None:
    """The negative control: recomputing with the region stream as the forward left it draws other masks."""
    reference, model = _model(), _model()
    _with_streams(reference)
    _with_streams(model)
    checkpoint_blocks([(str(i), model[i]) for i in range(1, 5)], "full")  # randomness never handed over
    got, expected = _grads(model), _grads(reference)
    assert any(not torch.equal(got[0][n], expected[0][n]) for n in expected[0])


def test_no_grad_forward_runs_plainly() -> None:
    model = _model().eval()
    reference = copy.deepcopy(model)
    checkpoint_blocks([(str(i), model[i]) for i in range(1, 5)], "full")
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_backward_in_two_passes_recomputes_twice_with_the_same_masks() -> None:
    """A zero-bubble schedule's backward: input gradients first (graph kept), weight gradients in a second pass.
    torch recomputes each checkpointed block once per pass; both recomputations replay the forward's masks, so the
    weight gradients equal the reference's one-pass backward bitwise."""
    reference, model = _model(), _model()
    _with_streams(reference)
    done = checkpoint_blocks([(str(i), model[i]) for i in range(1, 5)], "full")
    done.randomness = _with_streams(model)
    expected = _grads(reference, 1)[0]
    torch.manual_seed(123)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kept: list[torch.Tensor] = []  # the first layer's output: the input whose gradient pass 1 asks for
    model[0].register_forward_hook(lambda module, args, output: kept.append(output))
    out = model(x).square().sum()
    hidden = kept[0]
    (grad_in,) = torch.autograd.grad(out, [hidden], retain_graph=True)  # pass 1: input gradient
    params = [p for p in model[1:].parameters()]
    grads = torch.autograd.grad(out, params)  # pass 2: weight gradients
    names = [f"{i + 1}.{n}" for i, layer in enumerate(model[1:]) for n, _ in layer.named_parameters()]
    for name, grad in zip(names, grads, strict=True):
        assert torch.equal(grad, expected[name]), name
    assert grad_in.shape == hidden.shape
    assert all(model[i].calls == 3 for i in range(1, 5))  # forward, then one recomputation per pass


@pytest.mark.parametrize("schedule", ["zbvzerobubble", "interleavedzerobubble", "dualpipev"])
def test_selective_checkpointing_is_refused_with_a_split_backward(schedule) -> None:
    layout = {"pp": 2, "stages_per_rank": 2, "schedule": schedule, "micro_batches": 4}
    with pytest.raises(ValueError, match=rf"'selective' with schedule='{schedule}', which runs each backward in two"):
        ThreeDSettings(**layout, activation_checkpointing="selective")
    assert ThreeDSettings(**layout, activation_checkpointing="full")


def _compiled(mode: int | str | None, backend: Any) -> tuple[nn.Sequential, Any]:
    """The model with every block compiled and the chosen ones checkpointed, as the strategy builds them."""
    model = _model(UncountedBlock)
    randomness = _with_streams(model)
    held = {str(i): model[i] for i in range(1, 5)}
    checkpointed, compiled = parallelize._checkpoint_and_compile(list(held), held, mode, {"backend": backend})
    assert compiled is not None and compiled.names == list(held)
    if checkpointed is not None:
        checkpointed.randomness = randomness
    return model, checkpointed


@pytest.mark.parametrize("mode", ["full", 2])
def test_compiled_blocks_are_checkpointed_around_their_compiled_forward(mode) -> None:
    """``compile`` with activation checkpointing: the float64 gradients (dropout in and out of a tensor-parallel
    region) are those of the compiled blocks without checkpointing, bitwise, and of eager blocks within
    round-off; the compiled graphs run again in the backward for the checkpointed blocks only, and the blocks
    keep fewer tensors for backward."""
    torch._dynamo.reset()
    runs: list[int] = []

    def counting(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            runs.append(1)
            return graph(*args)

        return run

    reference = _model(UncountedBlock)
    _with_streams(reference)
    expected = _grads(reference)
    plain, _ = _compiled(None, "aot_eager")
    model, done = _compiled(mode, "aot_eager")
    assert done is not None and done.names == (["1", "2", "3", "4"] if mode == "full" else ["2", "4"])
    assert list(model.state_dict()) == list(reference.state_dict())
    compiled_plain, got = _grads(plain), _grads(model)
    _assert_same(got, compiled_plain)
    for g, e in zip(got, expected, strict=True):
        for name in e:
            torch.testing.assert_close(g[name], e[name], rtol=1e-12, atol=1e-12)

    def saved_bytes(module: nn.Sequential) -> int:
        kept: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(torch.randn(5, 8, dtype=torch.float64)).square().sum().backward()
        return sum(kept)

    assert saved_bytes(model) < saved_bytes(plain)
    # Graph runs: a forward alone (no grad: nothing checkpointed), then forward + backward.
    counted, done = _compiled(mode, counting)
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        counted(x)
    once, runs[:] = len(runs), []
    counted(x).square().sum().backward()
    rerun = 1.0 if mode == "full" else 0.5  # every block, or blocks 2 and 4 of 1-4
    assert once > 0 and len(runs) == once * (1 + rerun), (once, len(runs))
