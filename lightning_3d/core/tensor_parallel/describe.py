"""A printable table of a tensor-parallel plan (rank 0 prints it once)."""

from __future__ import annotations

from torch import nn

from lightning_3d.core.tensor_parallel.plan import TPPlan
from lightning_3d.core.tensor_parallel.styles import local_shape, style_kind, style_label


def _shape(mod: nn.Module, kind: str, tp: int) -> str:
    weight = getattr(mod, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return "-"
    full = tuple(weight.shape)
    local = local_shape(full, kind, "weight", isinstance(mod, nn.Embedding), tp)
    return f"{full} -> {local}" if local != full else f"{full} (whole)"


def describe_plan(body: nn.Module, plan: TPPlan, tp: int, *, body_prefix: str = "body") -> str:
    """Render ``plan`` as a table: one row per module that is sharded, explicitly set, or noted.

    Columns: LightningModule-relative name, module type, style, weight shape full -> local, reason.

    Args:
        body: the model body the plan was made for (unsharded or on the meta device).
        plan: the plan from :func:`~lightning_3d.core.tensor_parallel.resolve_plan`.
        tp: tensor-parallel size.
        body_prefix: attribute name of the body in the LightningModule.

    Returns:
        The table as one string (no trailing newline).

    Example:
        >>> print(describe_plan(model.body, plan, tp=2))  # doctest: +SKIP
        Tensor-parallel plan (tp=2): 9 modules sharded, 1 left replicated
        module              type       style           weight                     reason
        body.0.wte          Embedding  vocab           (64, 32) -> (32, 32)       vocabulary-sharded: ...
    """
    rows = []
    sharded = replicated = 0
    for fqn, mod in body.named_modules(remove_duplicate=False):
        name = ".".join(p for p in (body_prefix, fqn) if p)
        if fqn in plan.entries:
            entry = plan.entries[fqn]
            kind = style_kind(entry.style) if tp > 1 else "replicate"
            sharded += kind not in ("replicate", "heads", "grad_allreduce")  # these shard no parameter of their own
            replicated += kind == "replicate"
            rows.append((name, type(mod).__name__, style_label(entry.style), _shape(mod, kind, tp), entry.reason))
        elif fqn in plan.notes:
            replicated += 1
            rows.append((name, type(mod).__name__, "replicate", _shape(mod, "replicate", tp), plan.notes[fqn]))
    header = ("module", "type", "style", "weight (full -> local)", "reason")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = [f"Tensor-parallel plan (tp={tp}): {sharded} modules sharded, {replicated} left replicated"]
    for row in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    return "\n".join(line.rstrip() for line in lines)
