"""The tensor-parallel plan of a model body: automatic analysis plus the user's explicit entries.

Names in a :class:`TPPlan` are relative to the body (the ``nn.Sequential``), e.g. ``"3.attn.q_proj"``;
messages and explicit patterns use LightningModule-relative names (``"body.3.attn.q_proj"``).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.core.tensor_parallel.analyzer import (
    AnalysisError,
    AutoPlan,
    analyze,
    candidates,
    divisors_text,
    example_input_for,
)
from lightning_3d.core.tensor_parallel.hf_plan import make_hf_style
from lightning_3d.core.tensor_parallel.hf_styles import TiedParams
from lightning_3d.core.tensor_parallel.styles import (
    STYLE_NAMES,
    CopiedOutput,
    check_style,
    local_numel_of,
    make_style,
    relative_name,
    sharded_dim,
    style_kind,
)


@dataclass(frozen=True)
class PlanEntry:
    """How one module is sharded.

    Attributes:
        style: a name from :data:`STYLE_NAMES` or a user's ``ParallelStyle`` object.
        source: ``"auto"`` (found by the analysis) or ``"explicit"`` (the user's plan).
        reason: why, e.g. ``"q_proj/k_proj/v_proj -> out_proj (attention, 12 heads)"``.
    """

    style: str | ParallelStyle
    source: str
    reason: str = ""


@dataclass
class TPPlan:
    """Styles by body-relative module name, plus notes on modules deliberately left replicated.

    ``tied`` lists groups of parameter names that are one parameter of several sharded modules (an LM head tied
    to the input embedding, both sharded on the vocabulary); their modules' styles share the ``ties`` registry,
    so the parameter stays one DTensor parameter whichever module is sharded first, in whichever call.
    """

    entries: dict[str, PlanEntry] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    ties: TiedParams = field(default_factory=TiedParams, repr=False, compare=False)
    copied: set[str] = field(default_factory=set)  # modules whose output the forward modifies in place

    def styles_for(self, prefix: str) -> dict[str, ParallelStyle]:
        """``parallelize_module`` plan for the submodule at body-relative ``prefix``.

        Args:
            prefix: body-relative name of the submodule (e.g. ``"3"`` for one pipeline stage's
                layer); ``""`` is the whole body.

        Returns:
            Fresh ``ParallelStyle`` objects keyed by names relative to ``prefix`` (``""`` if the
            submodule itself has a style); ``replicate`` entries are left out.

        Example:
            >>> plan.styles_for("3")  # doctest: +SKIP
            {'attn.q_proj': ColwiseParallel(...), ..., 'mlp.proj': RowwiseParallel(...)}
        """
        out: dict[str, ParallelStyle] = {}
        tied_owners = {name.rpartition(".")[0] for group in self.tied for name in group}
        for fqn, entry in self.entries.items():
            key = relative_name(fqn, prefix)
            if key is None:
                continue
            style = _tie_aware(entry.style, self.ties) if fqn in tied_owners else make_style(entry.style)
            if style is not None:
                out[key] = CopiedOutput(style) if fqn in self.copied else style
        return out


# the tie-aware Hugging Face styles that shard as these style names do
#: The Hugging Face style (``hf_plan.make_hf_style``) of each automatic-plan style that has one: the same layout,
#: tie-aware. Read in both directions (``parallelize._outer_only`` maps a Hugging Face plan's outer entries back).
HF_STYLE_OF = {"vocab": "embedding_rowwise", "colwise_gather": "colwise_gather_output", "colwise": "colwise",
               "rowwise": "rowwise"}  # fmt: skip


def _tie_aware(style: str | ParallelStyle, ties: TiedParams) -> ParallelStyle | None:
    """``make_style(style)``, but one that gives a parameter already distributed for a module tied to this one
    the very same DTensor parameter (``hf_styles.TiedParams``)."""
    if isinstance(style, str) and style in HF_STYLE_OF:
        return make_hf_style(HF_STYLE_OF[style], ties)
    return make_style(style)


def _shown(body_prefix: str, fqn: str) -> str:
    return ".".join(p for p in (body_prefix, fqn) if p)


def _match_explicit(
    body: nn.Module, explicit: Mapping[str, str | ParallelStyle], body_prefix: str
) -> dict[str, tuple[str | ParallelStyle, str]]:
    """Body-relative name -> (style, pattern) for every module an explicit pattern matches (last wins)."""
    names = [fqn for fqn, _ in body.named_modules(remove_duplicate=False)]
    matched: dict[str, tuple[str | ParallelStyle, str]] = {}
    for pattern, style in explicit.items():
        check_style(style, repr(pattern))
        hits = [f for f in names if fnmatchcase(_shown(body_prefix, f), pattern) or (f and fnmatchcase(f, pattern))]
        if not hits:
            _no_match(pattern, [_shown(body_prefix, f) for f in names if f], "the model body", body_prefix)
        for f in hits:
            matched[f] = (style, pattern)
    return matched


def _no_match(pattern: str, shown: list[str], what: str, prefix: str) -> None:
    close = difflib.get_close_matches(pattern, shown, n=5, cutoff=0.5) or shown[:5]
    raise ValueError(
        f"Tensor-parallel plan pattern {pattern!r} matches no module of {what}. Closest module "
        f"names: {', '.join(close)}. Patterns are fnmatch globs on LightningModule-relative names, "
        f"e.g. '{_shown(prefix, '*.attn.q_proj')}'."
    )


def split_explicit(
    module: nn.Module, container: str, explicit: Mapping[str, str | ParallelStyle]
) -> tuple[dict[str, str | ParallelStyle], dict[str, str | ParallelStyle]]:
    """The user's plan for a model split at its blocks, as two plans: the patterns that name modules in the block
    container (for :func:`resolve_plan` of the blocks, which also matches names relative to the container) and
    those that name modules outside it (for :func:`resolve_outer_plan`); a pattern may be in both.

    Raises:
        ValueError: a pattern that names no module at all (with the closest names).
    """
    names = [f for f, _ in module.named_modules(remove_duplicate=False) if f]
    inner = [f for f in names if f == container or f.startswith(container + ".")]
    outer = [f for f in names if f not in inner]
    blocks: dict[str, str | ParallelStyle] = {}
    rest: dict[str, str | ParallelStyle] = {}
    relative = [f[len(container) + 1 :] for f in inner if f != container]
    for pattern, style in explicit.items():
        check_style(style, repr(pattern))
        if any(fnmatchcase(f, pattern) for f in inner + relative):
            blocks[pattern] = style
        if any(fnmatchcase(f, pattern) for f in outer):
            rest[pattern] = style
        if pattern not in blocks and pattern not in rest:
            _no_match(pattern, names, "the model", container)
    return blocks, rest


def _check_explicit(
    body: nn.Module,
    matched: Mapping[str, tuple[str | ParallelStyle, str]],
    tp: int,
    body_prefix: str,
    splits: Mapping[str, set[int]],
) -> None:
    """Raise ValueError for an explicit style that does not fit its module or does not divide by tp."""
    modules = dict(body.named_modules(remove_duplicate=False))
    for fqn, (style, pattern) in matched.items():
        if not isinstance(style, str) or style in ("sequence", "replicate"):
            continue
        mod, name = modules[fqn], _shown(body_prefix, fqn)
        what = f"{name} ({type(mod).__name__}, {style}, explicit plan {pattern!r})"
        if (
            not fqn
            or not isinstance(mod, (nn.Linear, nn.Embedding))
            or (style == "vocab" and not isinstance(mod, nn.Embedding))
        ):
            kinds = "nn.Embedding" if style == "vocab" else "nn.Linear and nn.Embedding"
            raise ValueError(f"Tensor-parallel plan: {what}: style {style!r} applies to {kinds} modules only.")
        if isinstance(mod, nn.Linear):
            size = ("out_features", mod.out_features) if style != "rowwise" else ("in_features", mod.in_features)
        elif style in ("colwise", "colwise_gather"):
            size = ("embedding_dim", mod.embedding_dim)
        else:
            size = ("num_embeddings", mod.num_embeddings)
        checks = [size] + [("number of attention heads", n) for n in sorted(splits.get(fqn, ())) if style == "colwise"]
        works = divisors_text([n for _, n in checks])
        for label, n in checks:
            if n % tp:
                raise ValueError(
                    f"Tensor parallel cannot shard {what} with tp={tp}: its {label} = {n} is not "
                    f"divisible by tp={tp}. tp values that work: {works}."
                )


def _pins(body: nn.Module, matched: Mapping[str, tuple[str | ParallelStyle, str]]) -> dict[str, str]:
    """What the analysis must take as given: "colwise", "rowwise", "replicate" or "other"."""
    pins: dict[str, str] = {}
    for fqn, (style, _) in matched.items():
        kind = style_kind(style)
        pins[fqn] = kind if kind in ("colwise", "rowwise", "replicate") else "other"
    names = [fqn for fqn, _ in body.named_modules(remove_duplicate=False)]
    for fqn, (style, _) in matched.items():
        if style == "replicate":
            for sub in names:
                if not fqn or sub.startswith(fqn + "."):
                    pins.setdefault(sub, "replicate")
    return pins


def _on_device(example: Any, body: nn.Module) -> Any:
    param = next(body.parameters(), None)
    if param is None:
        return example
    if isinstance(example, torch.Tensor):
        return example.to(param.device)
    if isinstance(example, (tuple, list)):
        return type(example)(_on_device(e, body) for e in example)
    if isinstance(example, dict):
        return {k: _on_device(v, body) for k, v in example.items()}
    return example


def _analyze(body: nn.Module, tp: int, example_input: Any, pins: dict[str, str], body_prefix: str) -> Any:
    """Run the analysis on the given example, or on ``example_input_for(body)``; a default
    ``(1, in_features)`` input for a first Linear is retried as ``(1, 2, in_features)`` (a sequence)."""
    if example_input is not None:
        examples = [_on_device(example_input, body)]
    else:
        first = example_input_for(body)
        if first is None:
            raise AnalysisError(
                "no example input for a body whose first layer is not an Embedding or a Linear (pass example_input=...)"
            )
        examples = [first] + ([first.unsqueeze(1).expand(-1, 2, -1)] if first.is_floating_point() else [])
    for i, example in enumerate(examples):
        try:
            return analyze(body, tp, example, pins, display=lambda f: _shown(body_prefix, f))
        except AnalysisError:
            if i == len(examples) - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def resolve_plan(
    body: nn.Module,
    tp: int,
    *,
    explicit: Mapping[str, str | ParallelStyle] | None = None,
    body_prefix: str = "body",
    example_input: Any | None = None,
    auto: bool = True,
    hint: str = "",
) -> TPPlan:
    """Build the tensor-parallel plan of ``body`` for ``tp`` ranks.

    The automatic analysis (if ``auto``) runs the body once on a tiny example input and shards the
    MLP and attention pairs it recognises from the data flow, the final projection and the
    embeddings (see :mod:`lightning_3d.core.tensor_parallel.analyzer`). Explicit entries are applied on
    top and win for the modules they match; ``"replicate"`` on a module also keeps everything
    inside it replicated.

    Args:
        body: the model body (an ``nn.Sequential``); it is left unchanged. Parameters may be on the
            meta device.
        tp: tensor-parallel size. With 1 the plan is empty (explicit patterns are still checked).
        explicit: ``{fnmatch pattern: style}``; a pattern is matched against LightningModule-relative
            names (``f"{body_prefix}.{name}"``) and body-relative names. Later patterns win.
        body_prefix: attribute name of the body in the LightningModule (for patterns and messages).
        example_input: input of the body for the analysis; default :func:`example_input_for`.
        auto: run the automatic analysis.
        hint: added to the warning and the notes when the analysis cannot run the body (what would let it).

    Returns:
        The plan; modules the analysis left replicated are explained in ``notes``.

    Raises:
        ValueError: an unknown style name; a pattern that matches no module (the message lists the
            closest names); an explicit style on a module it does not apply to; a size not
            divisible by ``tp`` (explicit entries, and MLP hidden sizes / attention heads found by
            the analysis), with the tp values that would work.

    Example:
        >>> plan = resolve_plan(model.body, tp=2, explicit={"body.*.attn.c_attn": "replicate"})  # doctest: +SKIP
        >>> parallelize_module(model.body, tp_mesh, plan.styles_for(""))  # doctest: +SKIP
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"Tensor-parallel size must be a positive int, got tp={tp!r}.")
    matched = _match_explicit(body, explicit or {}, body_prefix)
    if tp == 1:
        return TPPlan()
    pins = _pins(body, matched)
    result = None
    if auto:
        try:
            result = _analyze(body, tp, example_input, pins, body_prefix)
        except AnalysisError as error:
            found, _ = candidates(body)
            msg = (
                f"automatic tensor-parallel analysis could not run the body: {error}; modules without an "
                "explicit plan entry stay replicated"
            )
            if hint:
                msg += f" ({hint})"
            warnings.warn(f"{msg}.", stacklevel=2)
            notes = {f: msg for f in found if f not in pins}
            _check_explicit(body, matched, tp, body_prefix, {})
            return _merge(body, matched, None, notes)
    _check_explicit(body, matched, tp, body_prefix, result.splits if result else {})
    for message in result.warnings if result else []:
        warnings.warn(f"{message}.", stacklevel=2)
    return _merge(body, matched, result, result.notes if result else {})


def resolve_outer_plan(
    module: nn.Module,
    tp: int,
    container: str,
    example_input: Any | None,
    *,
    explicit: Mapping[str, str | ParallelStyle] | None = None,
    auto: bool = True,
    root: str = "",
) -> TPPlan:
    """The plan of the modules of ``module`` outside its block container (embeddings, LM head).

    A model split at its blocks has its blocks planned on their own (:func:`resolve_plan` on the container);
    what lies outside them is found here, from one analysis of the whole forward on ``example_input`` with
    every module inside the container taken as replicated: the input embeddings become vocabulary-sharded,
    a final projection whose output leaves the forward column-wise with its output all-gathered, exactly as
    in an ``nn.Sequential`` body. Each of those styles takes and gives full tensors, so it composes with any
    plan of the blocks. Nothing automatic fails a run: a forward the analysis cannot follow, or a size ``tp`` does
    not divide, leaves the outer modules replicated, with the reason in the plan's notes. Explicit entries win for
    the modules they match, as in :func:`resolve_plan`, and are checked the same way.

    Args:
        module: the LightningModule (unsharded, possibly on the meta device); left unchanged.
        tp: tensor-parallel size (> 1).
        container: module-relative name of the block container.
        example_input: the input of ``root``'s forward: ``module``'s ``example_input_array`` (one micro-batch's
            input), or a Hugging Face model's ``dummy_inputs`` (``block_calls.trace_input``); without one the
            outer modules stay replicated (the notes say how to have them sharded).
        explicit: ``{fnmatch pattern: style}`` on module-relative names (``split_explicit``'s outer part).
        auto: run the analysis (else only the explicit entries).
        root: the submodule whose forward the analysis runs (``""``: ``module`` itself; else the Hugging Face
            model holding the blocks); modules outside it stay replicated.

    Returns:
        Entries and notes keyed by module-relative names, for modules outside the container only.
    """

    def inside(fqn: str) -> bool:
        return fqn == container or fqn.startswith(container + ".")

    matched = {f: m for f, m in _match_explicit(module, explicit or {}, "").items() if not inside(f)}
    _check_explicit(module, matched, tp, "", {})
    found, ineligible = candidates(module)
    outer = [f for f in [*found, *ineligible] if not inside(f) and f not in matched]
    if not auto:
        return _merge(module, matched, None, {})
    if example_input is None:
        why = (
            "left replicated: modules outside the blocks (embeddings, LM head) are sharded when the LightningModule "
            "sets example_input_array (one micro-batch's input), on which the analysis runs the whole forward"
        )
        return _merge(module, matched, None, dict.fromkeys(outer, why))
    pins = {f: "replicate" for f in found if inside(f)} | _pins(module, matched)
    target, prefix = module.get_submodule(root), f"{root}." if root else ""
    pins = {f[len(prefix) :]: kind for f, kind in pins.items() if f.startswith(prefix)}
    example = _on_device(example_input, module)
    # A weight tied across outer modules (the head sharing the token embedding's matrix) is analysed untied, and
    # kept sharded only when every module holding it shards it alike (the embedding and the head both on the
    # vocabulary, Megatron's layout); a group sharded differently is analysed again tied, which leaves it whole.
    all_groups = _tie_groups(module, inside)
    groups = list(all_groups)
    for _ in range(len(groups) + 1):
        try:
            with _untied(module, groups):
                result = _prefixed(analyze(target, tp, example, pins), prefix)
        except (AnalysisError, ValueError) as error:
            what = f"{root}'s forward on its dummy_inputs" if root else "the whole forward on example_input_array"
            why = f"left replicated: the analysis of {what} failed ({error})"
            return _merge(module, matched, None, dict.fromkeys(outer, why))
        plan = _merge(module, matched, result, result.notes)
        unlike = [g for g in groups if not _sharded_alike(module, plan, g)]
        if not unlike:
            break
        groups = [g for g in groups if g not in unlike]
    for group in all_groups:  # the user's entries must not split a tie
        styled = [f for f, _ in group if f in matched and style_kind(matched[f][0]) != "replicate"]
        objects = [f for f in styled if not isinstance(matched[f][0], str)]
        if styled and (group not in groups or objects):
            shown = ", ".join(f"{f}.{p}" for f, p in group)
            how = "as a ParallelStyle object (it would make its own copy)" if objects else "unlike its other holders"
            raise ValueError(
                f"Tensor-parallel plan: {', '.join(objects or styled)} (explicit plan) would shard the tied parameter "
                f"{shown} {how}. Give every holder a style name that splits it alike (an Embedding 'vocab' with a "
                "Linear 'colwise' or 'colwise_gather'), or leave them to the analysis."
            )
    plan.entries = {f: e for f, e in plan.entries.items() if not inside(f)}
    plan.copied = {f for f in plan.copied if not inside(f)}
    plan.notes = {f: n for f, n in plan.notes.items() if not inside(f)}
    for group in groups:
        names = tuple(f"{owner}.{pname}" for owner, pname in group)
        plan.tied.append(names)
        for owner, pname in group:
            entry = plan.entries[owner]
            others = ", ".join(n for n in names if n != f"{owner}.{pname}")
            plan.entries[owner] = PlanEntry(entry.style, entry.source, f"{entry.reason}; {pname} tied to {others}")
    return plan


def _prefixed(result: AutoPlan, prefix: str) -> AutoPlan:
    """``result`` of a submodule's analysis, its names made relative to the whole module."""
    if not prefix:
        return result

    def name(fqn: str) -> str:
        return f"{prefix}{fqn}" if fqn else prefix[:-1]

    return AutoPlan(
        {name(f): v for f, v in result.styles.items()},
        {name(f): v for f, v in result.notes.items()},
        {name(f): v for f, v in result.splits.items()},
        list(result.warnings),
        {name(f): v for f, v in result.inplace.items()},
    )


def _tie_groups(module: nn.Module, inside: Any) -> list[list[tuple[str, str]]]:
    """Parameters held by several Linear / Embedding modules, every one of them outside the blocks: each as its
    ``(module name, parameter name)`` pairs, the first as registered."""
    modules = dict(module.named_modules(remove_duplicate=False))
    holders: dict[int, list[tuple[str, str]]] = {}
    for fqn, mod in modules.items():
        for pname, param in mod.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((fqn, pname))
    return [
        group
        for group in holders.values()
        if len(group) > 1
        and len({id(modules[f]) for f, _ in group}) == len(group)
        and all(f and not inside(f) and isinstance(modules[f], (nn.Linear, nn.Embedding)) for f, _ in group)
    ]


@contextmanager
def _untied(module: nn.Module, groups: list[list[tuple[str, str]]]) -> Iterator[None]:
    """Give every holder but the first of each group its own parameter (the same storage) while the analysis
    runs, so that it plans each module on its own; the tie is restored on exit."""
    saved = []
    try:
        for group in groups:
            for fqn, pname in group[1:]:
                mod = module.get_submodule(fqn)
                param = getattr(mod, pname)
                saved.append((mod, pname, param))
                setattr(mod, pname, nn.Parameter(param.detach(), requires_grad=param.requires_grad))
        yield
    finally:
        for mod, pname, param in saved:
            setattr(mod, pname, param)


def _sharded_alike(module: nn.Module, plan: TPPlan, group: list[tuple[str, str]]) -> bool:
    """Whether every module of a tie group shards the tied parameter, along the same dimension."""
    dims = set()
    for fqn, pname in group:
        entry = plan.entries.get(fqn)
        kind = style_kind(entry.style) if entry is not None else "replicate"
        dims.add(sharded_dim(kind, pname, isinstance(module.get_submodule(fqn), nn.Embedding)))
    return len(dims) == 1 and None not in dims


def _merge(
    body: nn.Module, matched: Mapping[str, tuple[str | ParallelStyle, str]], result: Any, notes: dict[str, str]
) -> TPPlan:
    plan = TPPlan()
    inplace = result.inplace if result is not None else {}
    for fqn, _ in body.named_modules(remove_duplicate=False):
        if fqn in matched:
            style, pattern = matched[fqn]
            plan.entries[fqn] = PlanEntry(style, "explicit", f"explicit plan {pattern!r}")
        elif result is not None and fqn in result.styles:
            style, reason = result.styles[fqn]
            plan.entries[fqn] = PlanEntry(style, "auto", reason)
        elif fqn in notes:
            plan.notes[fqn] = notes[fqn]
        entry = plan.entries.get(fqn)
        if entry is not None and fqn in inplace and style_kind(entry.style) in _SHARDED_KINDS:
            plan.copied.add(fqn)
            reason = f"{entry.reason}; output copied (modified in place by {inplace[fqn]})"
            plan.entries[fqn] = PlanEntry(entry.style, entry.source, reason)
    return plan


_SHARDED_KINDS = frozenset(["colwise", "rowwise", "colwise_gather", "vocab"])


def local_numel(param_fqn: str, full_shape: tuple[int, ...], plan: TPPlan, tp: int) -> int:
    """Expected number of elements of one rank's part of a parameter under ``plan``.

    Column-wise (and colwise_gather): weight and bias / tp; row-wise: weight / tp, bias whole;
    vocab: weight / tp; anything else whole. ``ParallelStyle`` objects count as the style they
    are (see :func:`~lightning_3d.core.tensor_parallel.styles.style_kind`); unknown objects as whole.

    Args:
        param_fqn: body-relative parameter name, e.g. ``"3.attn.q_proj.weight"``.
        full_shape: the parameter's full (unsharded) shape.
        plan: the plan.
        tp: tensor-parallel size.

    Returns:
        The local number of elements.
    """
    module, _, pname = param_fqn.rpartition(".")
    entry = plan.entries.get(module)
    kind = style_kind(entry.style) if entry is not None and tp > 1 else "replicate"
    return local_numel_of(tuple(full_shape), kind, pname, tp)


__all__ = ["STYLE_NAMES", "PlanEntry", "TPPlan", "local_numel", "resolve_outer_plan", "resolve_plan", "split_explicit"]
