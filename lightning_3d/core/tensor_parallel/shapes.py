"""Where a sharded dimension goes through shape operations.

Pure functions on shapes and arguments, no torch state. Each returns the output position of the
sharded dimension, or raises :class:`Refuse` with a reason a user can act on. The rule behind all
of them: a tensor-parallel rank holds one contiguous block of the sharded dimension, so an
operation keeps the sharding only if the block of its output that a rank computes from its own
block is again one contiguous block of the same dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Refuse(Exception):
    """An operation does not keep the sharding; the message says why (shown to the user)."""


def norm_dim(dim: int, ndim: int) -> int:
    """Return ``dim`` as a non-negative index for a tensor with ``ndim`` dimensions."""
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise Refuse(f"uses dimension {dim} of a {ndim}-d tensor")
    return dim % max(ndim, 1)


def norm_dims(dims: Any, ndim: int) -> list[int]:
    """Normalise an int or a sequence of ints to non-negative dimension indices."""
    if isinstance(dims, int):
        return [norm_dim(dims, ndim)]
    return [norm_dim(int(d), ndim) for d in dims]


def map_view(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> tuple[int, int]:
    """Follow a sharded dimension through a view/reshape/flatten/unflatten/(un)squeeze.

    Dimensions are grouped the way ``view`` does (runs of dimensions with equal products; size-1
    dimensions belong to no group). The sharded dimension must be the outermost of its input
    group; it then lands on the outermost dimension of the output group.

    Returns:
        ``(output dim, output size)``. When the output size is smaller than the input size the
        dimension was split (e.g. ``(C,) -> (heads, head_dim)``) and the caller must require
        ``output size % tp == 0``.
    """
    ins = [(i, s) for i, s in enumerate(in_shape) if s != 1]
    outs = [(j, s) for j, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(ins) and j < len(outs):
        group_in, group_out = [ins[i]], [outs[j]]
        prod_in, prod_out = ins[i][1], outs[j][1]
        i, j = i + 1, j + 1
        while prod_in != prod_out:
            if prod_in < prod_out and i < len(ins):
                group_in.append(ins[i])
                prod_in *= ins[i][1]
                i += 1
            elif prod_out < prod_in and j < len(outs):
                group_out.append(outs[j])
                prod_out *= outs[j][1]
                j += 1
            else:  # pragma: no cover - shapes with different numel cannot come out of a view
                raise Refuse("is reshaped to a shape with a different number of elements")
        if any(d == dim for d, _ in group_in):
            if group_in[0][0] != dim:
                raise Refuse(
                    "is reshaped so that the sharded feature dimension is merged with the dimensions "
                    "before it (the blocks of one rank would not stay contiguous)"
                )
            return group_out[0]
    raise Refuse("is reshaped in a way the analysis cannot follow")


def permute_perm(name: str, args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> list[int]:
    """Return ``perm`` such that output dimension ``k`` is input dimension ``perm[k]``."""
    perm = list(range(ndim))
    if name in ("transpose", "swapaxes", "swapdims"):
        d0 = args[1] if len(args) > 1 else kwargs.get("dim0", kwargs.get("axis0"))
        d1 = args[2] if len(args) > 2 else kwargs.get("dim1", kwargs.get("axis1"))
        a, b = norm_dim(d0, ndim), norm_dim(d1, ndim)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "permute":
        dims = args[1:] if len(args) > 1 else (kwargs["dims"],)
        if len(dims) == 1 and not isinstance(dims[0], int):
            dims = tuple(dims[0])
        perm = norm_dims(dims, ndim)
    elif name in ("movedim", "moveaxis"):
        src = args[1] if len(args) > 1 else kwargs.get("source")
        dst = args[2] if len(args) > 2 else kwargs.get("destination")
        src_l, dst_l = norm_dims(src, ndim), norm_dims(dst, ndim)
        rest = [d for d in range(ndim) if d not in src_l]
        perm = [-1] * ndim
        for s, d in zip(src_l, dst_l):
            perm[d] = s
        it = iter(rest)
        perm = [p if p >= 0 else next(it) for p in perm]
    elif name in ("t", "adjoint", "mT", "mH"):
        if ndim >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
    elif name in ("T", "H"):
        perm = perm[::-1]
    else:  # pragma: no cover - callers only pass the names above
        raise Refuse(f"`{name}` permutes dimensions in a way the analysis cannot follow")
    return perm


def _is_full_slice(s: slice, size: int) -> bool:
    start_ok = s.start is None or (isinstance(s.start, int) and s.start in (0, -size))
    stop_ok = s.stop is None or (isinstance(s.stop, int) and s.stop >= size)
    return bool(start_ok and stop_ok and s.step in (None, 1))


def map_getitem(index: Any, shape: Sequence[int], dim: int) -> int:
    """Follow a sharded dimension through basic indexing ``x[index]``.

    Ints, slices, ``None`` and ``...`` are understood; the sharded dimension may only be taken in
    full (``:``). Advanced (tensor or list) indexing is refused.
    """
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, (int, slice))) or isinstance(it, bool):
            raise Refuse("is indexed with a tensor or list (advanced indexing)")
    consumed = sum(1 for it in items if isinstance(it, (int, slice)))
    expanded: list[Any] = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - consumed))
        else:
            expanded.append(it)
    in_d = out_d = 0
    for it in expanded:
        if it is None:
            out_d += 1
            continue
        if in_d == dim:
            if isinstance(it, int) or not _is_full_slice(it, shape[dim]):
                raise Refuse(
                    "is sliced along the sharded feature dimension, i.e. split into parts "
                    "(a fused projection?): give an explicit plan or use separate Linears"
                )
            return out_d
        in_d += 1
        out_d += 0 if isinstance(it, int) else 1
    return out_d + (dim - in_d)


def broadcast_pos(dim: int, ndim: int, out_ndim: int) -> int:
    """Position in a broadcast result of dimension ``dim`` of an operand with ``ndim`` dimensions."""
    return dim + (out_ndim - ndim)


def operand_dim_at(out_pos: int, ndim: int, out_ndim: int) -> int | None:
    """Dimension of an operand that broadcasts to output position ``out_pos`` (None if absent)."""
    d = out_pos - (out_ndim - ndim)
    return d if 0 <= d < ndim else None


def parse_einsum(equation: str, n_operands: int) -> tuple[list[str], str]:
    """Split an einsum equation into operand subscripts and output subscripts (no ellipsis)."""
    eq = equation.replace(" ", "")
    if "..." in eq:
        raise Refuse("goes through an einsum with '...', which the analysis does not follow")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != n_operands:
        raise Refuse("goes through an einsum the analysis cannot parse")
    if "->" not in eq:
        letters = "".join(terms)
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, rhs
