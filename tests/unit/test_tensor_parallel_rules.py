"""The tensor-parallel analysis' building blocks: op names, shape helpers (checked against torch's own shapes),
the propagation rules on single calls, and the style helpers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from lightning_3d.core.tensor_parallel.analyzer import divisors_text
from lightning_3d.core.tensor_parallel.flow import FlowState
from lightning_3d.core.tensor_parallel.rules import PARTIAL_GRAD, RESIDUAL, Tag, apply_rule, op_name, tensors_in
from lightning_3d.core.tensor_parallel.shapes import (
    Refuse,
    broadcast_pos,
    map_getitem,
    map_view,
    norm_dim,
    norm_dims,
    operand_dim_at,
    parse_einsum,
    permute_perm,
)
from lightning_3d.core.tensor_parallel.styles import (
    check_style,
    local_numel_of,
    local_shape,
    make_style,
    sharded_dim,
    style_kind,
    style_label,
)


# ------------------------------------------------------------------------------------ op_name
@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (torch.add, ("add", False)),
        (torch.Tensor.add_, ("add", True)),
        (torch.Tensor.__add__, ("add", False)),
        (torch.Tensor.__radd__, ("add", False)),
        (torch.Tensor.__iadd__, ("add", True)),
        (torch.Tensor.__truediv__, ("div", False)),
        (torch.Tensor.__rtruediv__, ("div", False)),
        (torch.Tensor.__getitem__, ("getitem", False)),
        (torch.Tensor.__matmul__, ("matmul", False)),
        (torch.Tensor.__rsub__, ("sub", False)),
        (torch.swapaxes, ("transpose", False)),
        (torch.concat, ("cat", False)),
        (torch.Tensor.clip_, ("clamp", True)),
        (torch.Tensor.mT.__get__, ("mT", False)),
        (torch.Tensor.shape.__get__, ("shape", False)),
        (F.relu, ("relu", False)),
        (torch._softmax, ("_softmax", False)),  # a leading underscore is not an in-place suffix
    ],
)
def test_op_name(func: object, expected: tuple[str, bool]) -> None:
    assert op_name(func) == expected  # type: ignore[arg-type]


def test_tensors_in_nested_structures_in_order() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.zeros(2)
    found = tensors_in(((a, [1, {"k": b}]), {"x": "s", "y": (c,)}))
    assert len(found) == 3 and all(x is y for x, y in zip(found, (a, b, c)))


# ------------------------------------------------------------------------------------ shape helpers
def test_norm_dim() -> None:
    assert norm_dim(-1, 3) == 2 and norm_dim(0, 3) == 0 and norm_dim(-3, 3) == 0
    assert norm_dim(0, 0) == 0 and norm_dim(-1, 0) == 0  # a scalar behaves like one dimension
    with pytest.raises(Refuse, match="uses dimension 3 of a 3-d tensor"):
        norm_dim(3, 3)
    with pytest.raises(Refuse):
        norm_dim(-4, 3)
    assert norm_dims(-1, 2) == [1] and norm_dims((0, -1), 3) == [0, 2]


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        ("transpose", (0, 2), {}),
        ("transpose", (), {"dim0": -1, "dim1": 1}),
        ("permute", (2, 0, 3, 1), {}),
        ("permute", ((3, 2, 1, 0),), {}),
        ("permute", (), {"dims": (1, 0, 2, 3)}),
        ("movedim", (0, -1), {}),
        ("movedim", ((0, 1), (2, 3)), {}),
        ("t", (), {}),
        ("mT", (), {}),
        ("T", (), {}),
    ],
)
def test_permute_perm_matches_torch(name: str, args: tuple, kwargs: dict) -> None:
    x = torch.zeros(2, 3, 4, 5)
    if name == "t":
        x = torch.zeros(2, 3)
    perm = permute_perm(name, (x, *args), kwargs, x.ndim)
    if name == "T":
        out = x.permute(*reversed(range(x.ndim)))
    elif name in ("t", "mT"):
        out = getattr(x, name) if name == "mT" else x.t()
    else:
        out = getattr(x, name)(*args, **kwargs)
    assert list(out.shape) == [x.shape[p] for p in perm]


@pytest.mark.parametrize(
    ("equation", "n", "terms", "rhs"),
    [
        ("bhqd,bhkd->bhqk", 2, ["bhqd", "bhkd"], "bhqk"),
        ("b h q k , b h k d -> b h q d", 2, ["bhqk", "bhkd"], "bhqd"),
        ("ij,jk", 2, ["ij", "jk"], "ik"),  # implicit output: letters seen once, sorted
        ("ba", 1, ["ba"], "ab"),
    ],
)
def test_parse_einsum(equation: str, n: int, terms: list[str], rhs: str) -> None:
    assert parse_einsum(equation, n) == (terms, rhs)
    sizes = {c: 2 + i for i, c in enumerate("abhqkdij")}
    operands = [torch.zeros([sizes[c] for c in term]) for term in terms]
    assert list(torch.einsum(equation.replace(" ", ""), *operands).shape) == [sizes[c] for c in rhs]


def test_parse_einsum_refuses_what_it_cannot_follow() -> None:
    with pytest.raises(Refuse, match=r"\'\.\.\.\'"):
        parse_einsum("...ij,...jk->...ik", 2)
    with pytest.raises(Refuse, match="cannot parse"):
        parse_einsum("ij,jk->ik", 3)


def test_broadcast_positions() -> None:
    # a (C,) bias against a (B, T, C) activation: its dim 0 lands at output position 2
    assert broadcast_pos(0, 1, 3) == 2
    assert operand_dim_at(2, 1, 3) == 0
    assert operand_dim_at(0, 1, 3) is None  # the bias has no batch dimension
    assert operand_dim_at(1, 3, 3) == 1
    out = torch.zeros(4, 1, 6) + torch.zeros(5, 1)  # torch agrees: (4, 5, 6)
    assert out.shape[broadcast_pos(0, 2, 3)] == 5


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "dim", "expected"),
    [
        ((2, 3, 12), (2, 3, 4, 3), 2, (2, 4)),  # split into 4 heads
        ((2, 3, 4, 3), (2, 3, 12), 2, (2, 12)),  # heads merged back
        ((2, 3, 12), (6, 12), 2, (1, 12)),  # batch and time flattened: the feature dim is untouched
        ((6, 12), (2, 3, 12), 1, (2, 12)),
        ((2, 1, 12), (2, 12), 2, (1, 12)),  # squeeze
    ],
)
def test_map_view_more_shapes(in_shape: tuple, out_shape: tuple, dim: int, expected: tuple) -> None:
    assert map_view(in_shape, out_shape, dim) == expected


def test_map_view_refuses_merging_the_sharded_dim_into_an_outer_one() -> None:
    with pytest.raises(Refuse, match="merged with the dimensions before it"):
        map_view((2, 3, 12), (2, 36), 2)


@pytest.mark.parametrize(
    ("index", "shape", "dim", "expected"),
    [
        (0, (4, 16), 1, 0),  # x[0]: the batch dim goes
        ((slice(None), None), (4, 16), 1, 2),  # x[:, None]: a new dim before
        ((Ellipsis, None), (4, 16), 1, 1),  # x[..., None]: after
        ((slice(1, 3),), (4, 16), 1, 1),  # rows sliced, features whole
        ((slice(None), slice(0, 16)), (4, 16), 1, 1),  # the full feature range is fine
        ((slice(None), slice(-16, None)), (4, 16), 1, 1),
    ],
)
def test_map_getitem(index: object, shape: tuple, dim: int, expected: int) -> None:
    assert map_getitem(index, shape, dim) == expected
    x = torch.zeros(shape)
    assert x[index].shape[expected] == shape[dim]  # torch puts the dimension there


@pytest.mark.parametrize("index", [(slice(None), 3), (slice(None), slice(0, 16, 2)), torch.tensor([0, 1]), [0, 1]])
def test_map_getitem_refuses(index: object) -> None:
    with pytest.raises(Refuse):
        map_getitem(index, (4, 16), 1)


# ------------------------------------------------------------------------------------ rules on single calls
def sharded(state: FlowState, *shape: int, dim: int = -1, src: str = "q", grad: bool = True) -> torch.Tensor:
    x = torch.zeros(shape)
    state.set_tag(x, Tag(dim % len(shape), shape[dim], frozenset({src})), grad)
    return x


def plain(state: FlowState, *shape: int, grad: bool = False) -> torch.Tensor:
    x = torch.zeros(shape)
    state.set_tag(x, None, grad)
    return x


def rule(name: str, args: tuple, kwargs: dict, out: object, st: FlowState) -> list[Tag | None]:
    return apply_rule(name, args, kwargs, tensors_in(out), st)


def test_unary_ops_keep_the_tag() -> None:
    st = FlowState()
    x = sharded(st, 2, 3, 8)
    assert rule("gelu", (x,), {}, F.gelu(x), st) == [st.tag_of(x)]


def test_softmax_along_the_sharded_dim_is_refused_elsewhere_kept() -> None:
    st = FlowState()
    x = sharded(st, 2, 4, 8, dim=1)
    assert rule("softmax", (x, -1), {}, x.softmax(-1), st) == [st.tag_of(x)]
    with pytest.raises(Refuse, match="normalised or scanned along its sharded dimension"):
        rule("softmax", (x,), {"dim": 1}, x.softmax(1), st)


def test_reductions() -> None:
    st = FlowState()
    x = sharded(st, 2, 3, 8)
    assert rule("sum", (x, 0), {}, x.sum(0), st) == [Tag(1, 8, frozenset({"q"}))]  # the dim before it goes
    assert rule("mean", (x, 1), {"keepdim": True}, x.mean(1, keepdim=True), st) == [Tag(2, 8, frozenset({"q"}))]
    with pytest.raises(Refuse, match="reduced over its sharded dimension by `sum`"):
        rule("sum", (x, -1), {}, x.sum(-1), st)
    with pytest.raises(Refuse, match="reduced over its sharded dimension by `mean`"):
        rule("mean", (x,), {}, x.mean(), st)  # a full reduction


def test_elementwise_with_residual_or_gradient_operands() -> None:
    st = FlowState()
    x = sharded(st, 2, 3, 8)
    scale = plain(st, 2, 3, 1)
    assert rule("mul", (x, scale), {}, x * scale, st) == [st.tag_of(x)]  # broadcast along the shard: fine
    residual = plain(st, 2, 3, 8)
    with pytest.raises(Refuse, match="full-size tensor"):
        rule("add", (x, residual), {}, x + residual, st)
    learned = plain(st, 1, grad=True)
    with pytest.raises(Refuse, match="partial sum"):
        rule("mul", (x, learned), {}, x * learned, st)
    assert RESIDUAL.startswith("is combined") and "partial sum" in PARTIAL_GRAD


def test_elementwise_of_two_sharded_tensors_joins_their_groups() -> None:
    st = FlowState()
    gate, up = sharded(st, 2, 8, src="w1"), sharded(st, 2, 8, src="w3")
    (tag,) = rule("mul", (gate, up), {}, gate * up, st)
    assert tag == Tag(1, 8, frozenset({"w1", "w3"}))
    assert st.find("w1") == st.find("w3")
    rows, cols = sharded(st, 8, 8, dim=0, src="a"), sharded(st, 8, 8, dim=1, src="b")
    with pytest.raises(Refuse, match="sharded along a different dimension"):
        rule("add", (rows, cols), {}, rows + cols, st)


def test_views_permutes_and_splits() -> None:
    st = FlowState()
    x = sharded(st, 2, 3, 12)
    heads = x.view(2, 3, 4, 3)
    assert rule("view", (x, 2, 3, 4, 3), {}, heads, st) == [Tag(2, 4, frozenset({"q"}))]
    assert st.splits == {"q": {4}}  # 4 heads: tp must divide 4
    assert rule("transpose", (x, 1, 2), {}, x.transpose(1, 2), st) == [Tag(1, 12, frozenset({"q"}))]
    assert rule("chunk", (x, 3, 1), {}, x.chunk(3, 1), st) == [Tag(2, 12, frozenset({"q"}))] * 3
    with pytest.raises(Refuse, match="fused projection"):
        rule("split", (x, 4, -1), {}, x.split(4, -1), st)
    assert rule("unbind", (x, 0), {}, x.unbind(0), st) == [Tag(1, 12, frozenset({"q"}))] * 2
    with pytest.raises(Refuse, match="fused projection"):
        rule("narrow", (x, 2, 0, 6), {}, x.narrow(2, 0, 6), st)
    assert rule("select", (x, 0, 1), {}, x.select(0, 1), st) == [Tag(1, 12, frozenset({"q"}))]


def test_cat_and_stack() -> None:
    st = FlowState()
    a, b = sharded(st, 2, 8, src="k"), sharded(st, 3, 8, src="v")
    assert rule("cat", ((a, b),), {}, torch.cat((a, b)), st) == [Tag(1, 8, frozenset({"k", "v"}))]
    with pytest.raises(Refuse, match="concatenated along its sharded dimension"):
        rule("cat", ((a, a), -1), {}, torch.cat((a, a), -1), st)
    assert rule("stack", ((a, a), 1), {}, torch.stack((a, a), 1), st) == [Tag(2, 8, frozenset({"k"}))]
    assert rule("stack", ((a, a), -1), {}, torch.stack((a, a), -1), st) == [Tag(1, 8, frozenset({"k"}))]
    p = plain(st, 2, 8)
    with pytest.raises(Refuse, match="not sharded the same way"):
        rule("cat", ((a, p),), {}, torch.cat((a, p)), st)


def test_attention_matmuls() -> None:
    st = FlowState()
    q = sharded(st, 2, 4, 5, 3, dim=1, src="q")  # (B, heads, T, head_dim), sharded on heads
    k = sharded(st, 2, 4, 5, 3, dim=1, src="k")
    scores = q @ k.transpose(-2, -1)
    kt = k.transpose(-2, -1)
    st.set_tag(kt, Tag(1, 4, frozenset({"k"})), True)
    assert rule("matmul", (q, kt), {}, scores, st) == [Tag(1, 4, frozenset({"q", "k"}))]
    assert st.attention == {"q", "k"}
    features = sharded(st, 2, 5, 8, src="up")
    w = plain(st, 8, 3)
    with pytest.raises(Refuse, match="contracted over its sharded dimension"):
        rule("matmul", (features, w), {}, features @ w, st)


def test_layer_norm_rules() -> None:
    st = FlowState()
    x = sharded(st, 2, 4, 5, 3, dim=1)
    assert rule("layer_norm", (x, (3,)), {}, F.layer_norm(x, (3,)), st) == [st.tag_of(x)]
    weight = plain(st, 3, grad=True)
    with pytest.raises(Refuse, match="learned weight"):
        rule("layer_norm", (x, (3,), weight), {}, F.layer_norm(x, (3,), weight), st)
    y = sharded(st, 2, 8)
    with pytest.raises(Refuse, match="normalised over its sharded feature dimension"):
        rule("layer_norm", (y, 8), {}, F.layer_norm(y, (8,)), st)


def test_unknown_ops_are_refused() -> None:
    st = FlowState()
    x = sharded(st, 2, 8)
    with pytest.raises(Refuse, match="goes through `fft_fft`, which the analysis does not know"):
        rule("fft_fft", (x,), {}, torch.zeros(2, 8), st)


def test_pad_and_repeat_interleave() -> None:
    st = FlowState()
    x = sharded(st, 2, 4, 6, dim=1)
    assert rule("pad", (x, (1, 1)), {}, F.pad(x, (1, 1)), st) == [st.tag_of(x)]  # pads the last dim only
    with pytest.raises(Refuse, match="padded along its sharded dimension"):
        rule("pad", (x, (0, 0, 1, 0)), {}, F.pad(x, (0, 0, 1, 0)), st)
    kv = sharded(st, 2, 2, 5, 3, dim=1, src="k")  # 2 kv heads repeated for 4 query heads (GQA)
    out = kv.repeat_interleave(2, 1)
    assert rule("repeat_interleave", (kv, 2, 1), {}, out, st) == [Tag(1, 4, frozenset({"k"}))]


# ------------------------------------------------------------------------------------ styles
def test_sharded_dims_per_style() -> None:
    assert sharded_dim("colwise", "weight", False) == 0 and sharded_dim("colwise", "bias", False) == 0
    assert sharded_dim("colwise", "weight", True) == 1 and sharded_dim("colwise", "bias", True) is None
    assert sharded_dim("rowwise", "weight", False) == 1 and sharded_dim("rowwise", "bias", False) is None
    assert sharded_dim("vocab", "weight", True) == 0
    assert sharded_dim("replicate", "weight", False) is None


def test_local_shapes_match_torch_layouts() -> None:
    # nn.Linear(in, out).weight is (out, in): colwise splits out, rowwise splits in
    assert local_shape((12, 8), "colwise", "weight", False, 4) == (3, 8)
    assert local_shape((12,), "colwise_gather", "bias", False, 4) == (3,)
    assert local_shape((12, 8), "rowwise", "weight", False, 4) == (12, 2)
    assert local_shape((12,), "rowwise", "bias", False, 4) == (12,)
    # nn.Embedding(num, dim).weight is (num, dim): vocab splits num
    assert local_shape((100, 8), "vocab", "weight", True, 4) == (25, 8)
    assert local_shape((12, 8), "replicate", "weight", False, 4) == (12, 8)
    for kind, name, emb in (("colwise", "weight", False), ("rowwise", "weight", False), ("vocab", "weight", True)):
        shape = local_shape((12, 8), kind, name, emb, 2)
        assert local_numel_of((12, 8), kind, name, 2) == shape[0] * shape[1]
    assert local_numel_of((12,), "rowwise", "bias", 2) == 12


def test_style_kinds_of_torch_objects() -> None:
    assert style_kind("rowwise") == "rowwise"
    assert style_kind(ColwiseParallel()) == "colwise"
    assert style_kind(ColwiseParallel(output_layouts=Replicate())) == "colwise_gather"
    assert style_kind(RowwiseParallel()) == "rowwise"
    assert style_kind(RowwiseParallel(input_layouts=Replicate())) == "vocab"
    assert style_kind(SequenceParallel()) == "sequence"
    assert style_kind(PrepareModuleInput()) == "custom"
    assert style_label("colwise") == "colwise" and style_label(SequenceParallel()) == "SequenceParallel"


def test_make_style_round_trips_through_style_kind() -> None:
    for name in ("colwise", "rowwise", "colwise_gather", "vocab", "sequence"):
        assert style_kind(make_style(name)) == name  # type: ignore[arg-type]
    assert make_style("replicate") is None
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'diagonal'"):
        make_style("diagonal")


def test_check_style() -> None:
    obj = RowwiseParallel()
    assert check_style(obj, "'x'") is obj and check_style("vocab", "'x'") == "vocab"
    with pytest.raises(ValueError, match=r"entry 'body\.0': unknown style 'col'\. Use one of colwise, rowwise"):
        check_style("col", "'body.0'")
    with pytest.raises(ValueError, match="unknown style"):
        check_style(nn.Linear, "'x'")


def test_divisors_text() -> None:
    assert divisors_text([12, 8]) == "1, 2, 4"  # gcd 4
    assert divisors_text([7]) == "1, 7"
    assert divisors_text([5, 3]) == "1"
    assert divisors_text([256], limit=16) == "1, 2, 4, 8, 16"
