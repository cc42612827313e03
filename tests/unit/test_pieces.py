"""Cutting a layer of a Sequential body where one tensor crosses (lightning_3d/core/pieces.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.core import partition, pieces
from lightning_3d.core.balance import ComputePartitioner
from lightning_3d_examples.gpt import GPT, Block, GPTConfig

CONFIG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)


def _block() -> Block:
    torch.manual_seed(0)
    return Block(CONFIG).double()


def test_a_pre_norm_block_is_cut_after_its_first_residual_add() -> None:
    block = _block()
    traced = pieces.trace(block)
    assert traced is not None and traced.num_pieces == 2
    first, second = (pieces.piece_module(block, traced, i, i + 1) for i in range(2))
    assert pieces.children_used(first) == {"ln_1", "attn"} and pieces.children_used(second) == {"ln_2", "mlp"}
    # parameter names as in the block, each parameter in exactly one piece, shared (not copied)
    own = dict(block.named_parameters())
    names = [n for part in (first, second) for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(own)
    assert all(p is own[n] for part in (first, second) for n, p in part.named_parameters())
    # the chained pieces compute the block: outputs and gradients bitwise equal (float64)
    x = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    whole = block(x)
    (gx_whole,) = torch.autograd.grad(whole.square().sum(), [x])
    chained = second(first(x))
    (gx_chained,) = torch.autograd.grad(chained.square().sum(), [x])
    assert torch.equal(whole, chained) and torch.equal(gx_whole, gx_chained)
    # two pieces merged are the whole block again
    assert torch.equal(pieces.piece_module(block, traced, 0, 2)(x), whole)


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        if self.training:  # a trace would freeze this branch
            x = x * 2
        return x + self.b(x)


class _OwnParameter(_Branches):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        return (x + self.b(x)) * self.scale


class _TwoInputs(_Branches):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.a(x)
        return x + self.b(x)


class _DataDependent(_Branches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        if x.sum() > 0:
            return x
        return x + self.b(x)


class _Residual(_Branches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.a(x)
        return x + self.b(h)  # x is still needed after h: no single tensor crosses


class _Cuttable(_Branches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        return x + self.b(x)


@pytest.mark.parametrize(
    "layer",
    [_Branches(), _OwnParameter(), _TwoInputs(), _DataDependent(), _Residual(), nn.Linear(4, 4)],
    ids=["branch-on-training", "own-parameter", "two-inputs", "data-dependent", "two-live-values", "leaf"],
)
def test_layers_that_must_stay_whole_are_not_cut(layer: nn.Module) -> None:
    assert pieces.trace(layer) is None
    assert pieces.cut_layers([("0", layer)], torch.zeros(2, 4)) == [("0", layer)]


def test_the_layer_mode_is_restored_and_a_cut_needs_parameters_on_both_sides() -> None:
    layer = _Cuttable().eval()
    assert pieces.trace(layer) is not None and not layer.training

    class _Tail(nn.Module):  # the second half owns no parameters: nothing worth a stage boundary
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act = nn.Linear(4, 4), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.a(x)
            return self.act(x)

    assert pieces.trace(_Tail()) is None


def _gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    model = GPT(preset="tiny", n_layer=n_layer, example_batch=2)
    model.configure_model()
    return model.double()


def test_cut_layers_names_the_pieces_and_checks_them_on_the_example() -> None:
    model = _gpt()
    layers = list(model.body.named_children())
    units = pieces.cut_layers(layers, model.example_input_array)
    # the embedding stays whole (the token ids stay live past its first child); blocks and head are cut in two
    assert [n for n, _ in units] == ["0", "1#0-1", "1#1-2", "2#0-1", "2#1-2", "3#0-1", "3#1-2"]
    assert [n for n, _ in pieces.cut_layers(layers, model.example_input_array, keep_whole=["2"])][3] == "2"

    class _TupleChild(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.a(x)
            return y, y

    class _HandsOnATuple(nn.Module):  # a cut after `pair` would pass a tuple: kept whole once the example runs
        def __init__(self) -> None:
            super().__init__()
            self.pair, self.b = _TupleChild(), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.pair(x)
            return h[0] + self.b(h[1])

    layer = _HandsOnATuple()
    assert pieces.trace(layer) is not None  # the trace alone cannot tell
    assert pieces.cut_layers([("0", layer)], torch.zeros(2, 4)) == [("0", layer)]


def test_stage_names_merge_pieces_and_name_whole_layers_plainly() -> None:
    units = [(n, nn.Identity()) for n in ["0", "1#0-1", "1#1-2", "2#0-1", "2#1-2", "3#0-1", "3#1-2"]]
    ranges = [range(0, 2), range(2, 6), range(6, 7)]
    names = pieces.stage_names(units, ranges)
    assert names == [["0", "1#0-1"], ["1#1-2", "2", "3#0-1"], ["3#1-2"]]
    assert pieces.parse("1#1-2") == pieces.Part("1", 1, 2) and pieces.parse("2").whole
    assert pieces.held_parts(["0", "1#0-1", "3#1-2"]) == {"1": [pieces.Part("1", 0, 1)], "3": [pieces.Part("3", 1, 2)]}
    assert pieces.held_parts(["1#0-1", "1#1-2"]) == {"1": [pieces.Part("1", 0, 1), pieces.Part("1", 1, 2)]}


def test_stages_with_parts_compute_the_body_and_prune_what_another_rank_holds() -> None:
    model = _gpt()
    body = partition.find_body(model)
    names = [["0", "1", "2#0-1"], ["2#1-2", "3"]]
    x = torch.randint(0, 256, (2, 8))
    expected = model.body(x)
    stages = [partition.stage_container(body, n) for n in names]
    assert torch.equal(stages[1](stages[0](x)), expected)
    assert list(stages[0]._modules) == ["0", "1", "2"] and list(stages[1]._modules) == ["2", "3"]
    # pruning the rank that holds stage 0: block 2 keeps only the children its part calls
    parts = pieces.build_parts(model.body, names[0])
    dropped = pieces.prune_layer(model.body[2], list(parts.values()))
    assert dropped == ["ln_2", "mlp"]
    assert {n.split(".")[2] for n in model.state_dict() if n.startswith("body.2.")} == {"ln_1", "attn"}
    assert torch.equal(parts["2#0-1"](model.body[1](model.body[0](x))), stages[0](x))


class _Fixed(ComputePartitioner):
    """The compute partitioner over given per-unit seconds (nothing timed)."""

    def __init__(self, seconds: list[float], split_layers: bool = True) -> None:
        super().__init__(example_input=None, profiles=[(s, 0.0, 0.0) for s in seconds], split_layers=split_layers)
        self.measured = True


UNITS = [(n, nn.Identity()) for n in ["0", "1#0-1", "1#1-2", "2#0-1", "2#1-2", "3"]]


def test_the_compute_partitioner_cuts_inside_a_layer_only_when_that_pays() -> None:
    # units: embedding, block 1 (attention, MLP), block 2 (attention, MLP), head
    assert _Fixed([2, 4, 6, 4, 6, 2])(UNITS, 2) == [range(0, 3), range(3, 6)]  # 12 | 12 between whole blocks
    # whole blocks give 11 | 16 at best; inside block 2, 15 | 12
    assert _Fixed([1, 4, 6, 4, 6, 6])(UNITS, 2) == [range(0, 4), range(4, 6)]
    demanding = _Fixed([1, 4, 6, 4, 6, 6])
    demanding.MIN_GAIN = 0.5  # the same gain (16 -> 15) is not enough: whole blocks kept
    assert demanding(UNITS, 2) == [range(0, 3), range(3, 6)]


def test_plan_stages_shows_the_parts_in_the_layout() -> None:
    model = _gpt()
    body = partition.find_body(model)
    layers = list(body.module.named_children())
    units = pieces.cut_layers(layers, model.example_input_array)
    seconds = {"0": 1.0, "3#0-1": 0.5, "3#1-2": 9.0}  # a head heavy enough to move half of block 2 across
    part = _Fixed([seconds.get(n, 4.0 if n.endswith("#0-1") else 6.0) for n, _ in units])
    plan = partition.plan_stages(body, 2, part, example=model.example_input_array)
    assert plan.layer_names == [["0", "1", "2#0-1"], ["2#1-2", "3"]]
    text = plan.describe()
    assert "body[0, 1, 2 (ln_1, attn)]" in text and "body[2 (ln_2, mlp), 3]" in text
    # the user's opt-out (kept by for_input), and the uniform partitioner: whole layers only
    assert not ComputePartitioner(split_layers=False).for_input(model.example_input_array).split_layers
    whole = partition.plan_stages(body, 2, _Fixed([1.0, 10.0, 10.0, 9.5], split_layers=False))
    assert whole.layer_names == [["0", "1"], ["2", "3"]] and not whole.shown
    assert partition.plan_stages(body, 2, partition.UniformPartitioner()).layer_names == [["0", "1"], ["2", "3"]]


def test_the_pieces_of_a_layer_are_timed_on_one_rank() -> None:
    from lightning_3d.core.balance import _share

    names = ["0", "1#0-1", "1#1-2", "2#0-1", "2#1-2", "3#0-1", "3#1-2"]
    layers = [(n, nn.Identity()) for n in names]
    groups = [[0], [1, 3], [2, 4], [5], [6]]  # embedding, attention halves, MLP halves, head norm, head projection
    shares = [_share(groups, layers, rank, 2) for rank in range(2)]
    assert shares == [[0, 3, 4], [1, 2]]  # families: embedding, block halves, head halves
    assert _share([[0], [1], [2]], [("0", None), ("1", None), ("2", None)], 1, 2) == [1]  # whole layers: as before
