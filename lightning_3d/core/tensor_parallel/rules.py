"""Rules: how the sharding of a call's inputs maps to its outputs.

:func:`apply_rule` is asked, for every torch call that gets a tagged (would-be sharded) input,
which tags its outputs carry. It raises :class:`~lightning_3d.core.tensor_parallel.shapes.Refuse` when
the call would need the full activation: it mixes, reduces, splits or contracts the sharded
dimension, combines it with a full-size tensor (a residual) or with a broadcast tensor that needs a
gradient (whose gradient would only be a partial sum on each rank), or is not known at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

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

FUSED = "is split into parts (a fused projection?): give an explicit plan or use separate Linears"
RESIDUAL = "is combined with a full-size tensor that is not sharded the same way (e.g. a residual connection)"
PARTIAL_GRAD = (
    "is combined, by broadcasting, with a tensor that needs a gradient (a parameter or an activation), "
    "whose gradient would only be a partial sum on each rank"
)


@dataclass(frozen=True)
class Tag:
    """Sharding carried by one tensor.

    Attributes:
        dim: index of the dimension that would be sharded (in this tensor's shape).
        size: full (unsharded) size of that dimension.
        srcs: body-relative names of the column-wise candidate Linears it derives from.
    """

    dim: int
    size: int
    srcs: frozenset[str]


class FlowView(Protocol):
    """What the rules read and record in a traced pass: ``flow.FlowState`` is one (``flow`` imports the rules,
    so they see it through this protocol and do not import ``flow`` back)."""

    attention: set[str]

    def tag_of(self, t: torch.Tensor) -> Tag | None: ...

    def is_grad(self, t: torch.Tensor) -> bool: ...

    def union(self, names: Iterable[str]) -> None: ...

    def add_split(self, srcs: Iterable[str], n: int) -> None: ...

    def sums_grad(self, t: torch.Tensor, srcs: Iterable[str]) -> bool: ...


_DUNDER = dict(
    (k, k) for k in "add sub mul div pow matmul neg abs lt le gt ge eq ne getitem setitem".split()
) | {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "pos": "positive",
     "and": "logical_and", "or": "logical_or", "xor": "logical_xor"}  # fmt: skip
_ALIASES = {"rsub": "sub", "subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div",
            "clip": "clamp", "concat": "cat", "concatenate": "cat", "negative": "neg", "swapaxes": "transpose",
            "swapdims": "transpose", "moveaxis": "movedim", "absolute": "abs"}  # fmt: skip


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Shape-preserving element-wise ops of one tensor (extra arguments are scalars).
UNARY = _names("""
    relu gelu silu sigmoid tanh exp expm1 log log1p log2 neg abs sqrt rsqrt square erf erfc softplus softsign
    mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid relu6 rrelu logsigmoid tanhshrink sin cos
    reciprocal sign sgn floor ceil round trunc frac nan_to_num threshold positive dropout alpha_dropout
    feature_alpha_dropout dropout1d dropout2d dropout3d logical_not bitwise_not isnan isinf isfinite conj real imag
""")
# Broadcasting element-wise ops of several tensors.
ELEMENTWISE = _names("""
    add sub mul div floor_divide remainder fmod pow float_power maximum minimum fmax fmin masked_fill where lerp
    addcmul addcdiv eq ne lt le gt ge logical_and logical_or logical_xor atan2 hypot copysign xlogy clamp
    clamp_min clamp_max
""")
# Only the first tensor argument matters (the others, if any, give a dtype/device/shape).
SELF_ONLY = _names("""
    to type type_as float double half bfloat16 contiguous clone detach requires_grad data zeros_like ones_like
    empty_like full_like rand_like randn_like cpu cuda
""")
NO_GRAD = _names("detach zeros_like ones_like empty_like full_like rand_like randn_like")
VIEWS = _names("view reshape flatten unflatten view_as reshape_as squeeze unsqueeze")
PERMUTES = _names("transpose permute movedim t adjoint T mT H mH")
SPLITS = _names("split split_with_sizes chunk tensor_split unbind")
# Reductions and the position of their ``dim`` argument.
REDUCTIONS = dict.fromkeys(
    "sum mean nansum nanmean amax amin prod logsumexp std var all any argmax argmin max min median "
    "count_nonzero".split(), 1) | {"norm": 2}  # fmt: skip
# Ops along one dimension (shape kept), the position of ``dim`` and its default.
ALONG_DIM = dict.fromkeys("softmax log_softmax _softmax cumsum cumprod logcumsumexp cummax cummin glu".split(), 1) | {
    "normalize": 2
}
ALONG_DIM_DEFAULT = {"normalize": 1, "glu": -1}
# Ops on a sharded tensor whose non-tensor results are harmless (shapes are checked by the simulation).
BENIGN = _names("""
    size dim ndimension stride is_contiguous is_floating_point is_complex element_size get_device numel nelement
    len shape dtype device ndim requires_grad is_leaf grad_fn is_cuda is_meta is_cpu layout names data_ptr
    storage_offset is_sparse is_quantized hash
""")


def op_name(func: Callable[..., Any]) -> tuple[str, bool]:
    """Return ``(canonical name, in_place)`` of a function seen by a TorchFunctionMode."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # property access, e.g. ``x.mT`` or ``x.shape``
        return str(getattr(getattr(func, "__self__", None), "__name__", name)), False
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core[:1] in ("r", "i") and core[1:] in _DUNDER:
            return _DUNDER[core[1:]], core[0] == "i"
        return _DUNDER.get(core, core), False
    if name.endswith("_") and not name.startswith("_"):
        base = name[:-1]
        return _ALIASES.get(base, base), True
    return _ALIASES.get(name, name), False


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) structure of tuples, lists and dicts, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def apply_rule(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor], st: FlowView
) -> list[Tag | None]:
    """Tags of ``outs`` of the call ``name(*args, **kwargs)``; raises :class:`Refuse`."""
    if name in ("max", "min") and isinstance(_arg(args, kwargs, 1, "other"), torch.Tensor):
        name = "maximum"
    if name in UNARY or name in SELF_ONLY:
        return _same_as_self(args, outs, st)
    if name in ELEMENTWISE:
        return _elementwise(outs, tensors_in((args, kwargs)), st)
    if name in ("repeat_interleave",):
        return _repeat_interleave(args, kwargs, outs, st)
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    tag = st.tag_of(src) if src is not None else None
    if name in ("cat", "stack"):
        return _cat_stack(name, args, kwargs, outs, st)
    if name in ("matmul", "bmm", "mm"):
        return _matmul(args[0], args[1], outs[0], st)
    if name == "scaled_dot_product_attention":
        return _sdpa(args, kwargs, outs[0], st)
    if name == "einsum":
        return _einsum(args, outs[0], st)
    if name == "expand_as" and st.tag_of(args[1]) is not None:  # e.g. mask.expand_as(scores)
        return _elementwise(outs, [args[0], args[1]], st)
    if tag is None or src is None:
        raise Refuse(f"goes through `{name}`, which the analysis does not know to keep the sharding")
    out = outs[0]
    if name in VIEWS:
        d, n = map_view(src.shape, out.shape, tag.dim)
        if n < tag.size:
            st.add_split(tag.srcs, n)
        return [Tag(d, n, tag.srcs)]
    if name in PERMUTES:
        perm = permute_perm(name, args, kwargs, src.ndim)
        return [Tag(perm.index(tag.dim), tag.size, tag.srcs)]
    if name == "getitem":
        return [Tag(map_getitem(args[1], src.shape, tag.dim), tag.size, tag.srcs)]
    if name in ("select", "narrow"):
        dim = norm_dim(_arg(args, kwargs, 1, "dim"), src.ndim)
        if dim == tag.dim:
            raise Refuse(FUSED)
        return [Tag(tag.dim - (name == "select" and dim < tag.dim), tag.size, tag.srcs)]
    if name in SPLITS:
        dim = norm_dim(_arg(args, kwargs, 1 if name == "unbind" else 2, "dim", 0), src.ndim)
        if dim == tag.dim:
            raise Refuse(FUSED)
        d = tag.dim - (name == "unbind" and dim < tag.dim)
        return [Tag(d, tag.size, tag.srcs) for _ in outs]
    if name in REDUCTIONS:
        dims = _arg(args, kwargs, REDUCTIONS[name], "dim")
        if dims is None or isinstance(dims, bool) or tag.dim in norm_dims(dims, src.ndim):
            raise Refuse(f"is reduced over its sharded dimension by `{name}`")
        d = tag.dim if out.ndim == src.ndim else tag.dim - sum(x < tag.dim for x in norm_dims(dims, src.ndim))
        return [Tag(d, tag.size, tag.srcs) for _ in outs]
    if name in ALONG_DIM:
        dim = _arg(args, kwargs, ALONG_DIM[name], "dim", ALONG_DIM_DEFAULT.get(name))
        if dim is None or norm_dim(dim, src.ndim) == tag.dim:
            raise Refuse(f"is normalised or scanned along its sharded dimension by `{name}`")
        return [Tag(tag.dim, tag.size, tag.srcs) for _ in outs]
    if name in ("layer_norm", "rms_norm"):
        shape = _arg(args, kwargs, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        if tag.dim >= src.ndim - k:
            raise Refuse("is normalised over its sharded feature dimension")
        if any(st.is_grad(t) and not st.sums_grad(t, tag.srcs) for t in tensors_in((args[1:], kwargs))):
            raise Refuse("goes through a norm with a learned weight whose gradient would be a partial sum")
        return [tag]
    if name in ("expand", "expand_as", "broadcast_to", "repeat", "tile"):
        d = tag.dim + out.ndim - src.ndim
        if out.shape[d] != tag.size:
            raise Refuse(f"is repeated along its sharded dimension by `{name}`")
        return [Tag(d, tag.size, tag.srcs)]
    if name in ("roll", "flip", "tril", "triu"):
        dims = _arg(args, kwargs, 2 if name == "roll" else 1, "dims")
        if name == "flip" and len(args) > 2:  # x.flip(0, 1)
            dims = list(args[1:])
        if name in ("tril", "triu"):
            dims = [-1, -2]
        if dims is None or tag.dim in norm_dims(dims, src.ndim):
            raise Refuse(f"is rearranged along its sharded dimension by `{name}`")
        return [tag]
    if name in ("view_as_complex", "view_as_real"):
        if name == "view_as_complex" and tag.dim == src.ndim - 1:
            raise Refuse("is viewed as complex along its sharded dimension")
        return [tag]
    if name == "pad":
        pad = list(_arg(args, kwargs, 1, "pad"))
        k = 2 * (src.ndim - 1 - tag.dim)
        if any(pad[k : k + 2]):
            raise Refuse("is padded along its sharded dimension")
        return [tag]
    raise Refuse(f"goes through `{name}`, which the analysis does not know to keep the sharding")


def _same_as_self(args: tuple[Any, ...], outs: list[torch.Tensor], st: FlowView) -> list[Tag | None]:
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    tag = st.tag_of(src) if src is not None else None
    if tag is None or src is None:
        return [None] * len(outs)
    if any(o.shape != src.shape for o in outs):
        raise Refuse("goes through an operation that changes its shape")
    return [tag] * len(outs)


def _elementwise(outs: list[torch.Tensor], operands: list[torch.Tensor], st: FlowView) -> list[Tag | None]:
    out_nd = outs[0].ndim
    pos = size = None
    srcs: set[str] = set()
    for t in operands:
        tag = st.tag_of(t)
        if tag is None:
            continue
        p = broadcast_pos(tag.dim, t.ndim, out_nd)
        if pos is None:
            pos, size = p, tag.size
        elif (p, tag.size) != (pos, size):
            raise Refuse("is combined with a tensor sharded along a different dimension")
        srcs |= tag.srcs
    assert pos is not None and size is not None
    for t in operands:
        if st.tag_of(t) is not None:
            continue
        d = operand_dim_at(pos, t.ndim, out_nd)
        if d is not None and t.shape[d] != 1:
            raise Refuse(RESIDUAL)
        if st.is_grad(t) and not st.sums_grad(t, srcs):
            raise Refuse(PARTIAL_GRAD)
    if any(o.ndim != out_nd or o.shape[pos] != size for o in outs):
        raise Refuse("is combined with a tensor in a way that changes its sharded dimension")
    st.union(srcs)
    return [Tag(pos, size, frozenset(srcs))] * len(outs)


def _repeat_interleave(
    args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor], st: FlowView
) -> list[Tag | None]:
    src, repeats, dim = args[0], _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
    tag = st.tag_of(src) if isinstance(src, torch.Tensor) else None
    if tag is None or not isinstance(repeats, int) or dim is None:
        raise Refuse("goes through a `repeat_interleave` the analysis does not follow (give an int and a dim)")
    if norm_dim(dim, src.ndim) == tag.dim:  # each rank repeats its own heads: blocks stay contiguous
        return [Tag(tag.dim, tag.size * repeats, tag.srcs)]
    return [tag]


def _cat_stack(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor], st: FlowView
) -> list[Tag | None]:
    parts = list(_arg(args, kwargs, 0, "tensors"))
    tags = [st.tag_of(t) for t in parts]
    first = tags[0]
    if first is None or any(t is None or (t.dim, t.size) != (first.dim, first.size) for t in tags):
        raise Refuse(f"is joined by `{name}` with a tensor that is not sharded the same way")
    nd = parts[0].ndim
    dim = _arg(args, kwargs, 1, "dim", 0)
    if name == "cat":
        if norm_dim(dim, nd) == first.dim:
            raise Refuse("is concatenated along its sharded dimension")
        d = first.dim
    else:
        d = first.dim + (norm_dim(dim, nd + 1) <= first.dim)
    srcs = frozenset().union(*(t.srcs for t in tags if t is not None))
    st.union(srcs)
    return [Tag(d, first.size, srcs)]


def _matmul(a: Any, b: Any, out: torch.Tensor, st: FlowView) -> list[Tag | None]:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.ndim < 2 or b.ndim < 2:
        raise Refuse("goes through a matmul the analysis does not follow")
    nd = out.ndim
    found: list[tuple[int, int]] = []
    for t, contracted, kept_in, kept_out in ((a, a.ndim - 1, a.ndim - 2, nd - 2), (b, b.ndim - 2, b.ndim - 1, nd - 1)):
        tag = st.tag_of(t)
        if tag is None:
            continue
        if tag.dim == contracted:
            raise Refuse("is contracted over its sharded dimension by a matmul outside a row-wise Linear")
        found.append((kept_out if tag.dim == kept_in else broadcast_pos(tag.dim, t.ndim, nd), tag.size))
    pos, size = found[0]
    if len(found) == 2 and (found[1] != found[0] or pos >= nd - 2):
        raise Refuse("meets another sharded tensor in a matmul along different dimensions")
    srcs: frozenset[str] = frozenset()
    for t in (a, b):
        tag = st.tag_of(t)
        if tag is not None:
            srcs |= tag.srcs
            continue
        d = operand_dim_at(pos, t.ndim, nd) if pos < nd - 2 else None
        if d is not None and d < t.ndim - 2 and t.shape[d] != 1:
            raise Refuse(RESIDUAL)
        if st.is_grad(t):
            raise Refuse("is multiplied with a parameter or activation whose gradient would be a partial sum")
    if len(found) == 2:
        st.attention |= srcs
    st.union(srcs)
    return [Tag(pos, size, srcs)]


def _sdpa(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor, st: FlowView) -> list[Tag | None]:
    q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    tags = [st.tag_of(t) for t in (q, k, v)]
    if any(t is None for t in tags):
        raise Refuse("meets unsharded query/key/value in attention (q, k and v must all come from Linears)")
    tq, tk, tv = tags
    assert tq is not None and tk is not None and tv is not None
    if any(t.dim != x.ndim - 3 for t, x in zip(tags, (q, k, v))):  # type: ignore[union-attr]
        raise Refuse("reaches attention sharded along a dimension that is not the heads dimension")
    gqa = bool(_arg(args, kwargs, 7, "enable_gqa", False))
    if tk.size != tv.size or (tq.size != tk.size and not (gqa and tq.size % tk.size == 0)):
        raise Refuse("reaches attention with head counts that do not match")
    mask = _arg(args, kwargs, 3, "attn_mask")
    if isinstance(mask, torch.Tensor):
        tm = st.tag_of(mask)
        if tm is not None:
            if (broadcast_pos(tm.dim, mask.ndim, out.ndim), tm.size) != (out.ndim - 3, tq.size):
                raise Refuse("meets an attention mask sharded differently")
        else:
            d = operand_dim_at(out.ndim - 3, mask.ndim, out.ndim)
            if (d is not None and mask.shape[d] != 1) or st.is_grad(mask):
                raise Refuse("meets a per-head or learned attention mask/bias")
    srcs = (
        tq.srcs
        | tk.srcs
        | tv.srcs
        | (
            st.tag_of(mask).srcs
            if isinstance(mask, torch.Tensor)  # type: ignore[union-attr]
            and st.tag_of(mask) is not None
            else frozenset()
        )
    )
    st.attention |= srcs
    st.union(srcs)
    return [Tag(out.ndim - 3, tq.size, srcs)]


def _einsum(args: tuple[Any, ...], out: torch.Tensor, st: FlowView) -> list[Tag | None]:
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    terms, rhs = parse_einsum(args[0], len(ops))
    letter = size = None
    for t, term in zip(ops, terms):
        tag = st.tag_of(t)
        if tag is None:
            continue
        ch = term[tag.dim]
        if term.count(ch) != 1 or (letter is not None and (ch, tag.size) != (letter, size)):
            raise Refuse("meets another sharded tensor in an einsum along different dimensions")
        letter, size = ch, tag.size
    if letter is None or letter not in rhs:
        raise Refuse("is contracted over its sharded dimension by an einsum")
    for t, term in zip(ops, terms):
        if st.tag_of(t) is None and ((letter in term and t.shape[term.index(letter)] != 1) or st.is_grad(t)):
            raise Refuse(RESIDUAL if letter in term else PARTIAL_GRAD)
    srcs = frozenset().union(*(st.tag_of(t).srcs for t in ops if st.tag_of(t) is not None))  # type: ignore[union-attr]
    if sum(st.tag_of(t) is not None for t in ops) > 1:
        st.attention |= srcs
    st.union(srcs)
    return [Tag(rhs.index(letter), size, srcs)]  # type: ignore[arg-type]
