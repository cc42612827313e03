"""The automatic tensor-parallel plan: which Linears and Embeddings to shard, from the data flow.

The body runs once on a tiny example input (meta device or CPU, no grad, eval mode, RNG state
restored) while :mod:`flow` follows which tensors derive from which Linear. In execution order, a
Linear whose input is unsharded becomes a column-wise candidate; a Linear whose input is sharded
along its input features becomes row-wise and joins the group of the Linears it came from
(q/k/v -> out through attention, fc -> proj through an activation, w1 * w3 -> w2). A group any of
whose tensors meets an operation that would need the full activation is left replicated, the run
is repeated without it (its row-wise Linear may pair with a later one instead), and finally
:mod:`simulate` checks the chosen plan with the local shapes of one rank. An attention group that fails
that check because its module reshapes by its own head count (``view(bsz, -1, self.num_heads, ...)``) is
checked once more with those counts divided by tp (:func:`head_counts`); if the local shapes then
match, the plan gives the module a :class:`~lightning_3d.core.tensor_parallel.styles.LocalHeadCounts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_3d.core.tensor_parallel.flow import FlowMode, FlowState
from lightning_3d.core.tensor_parallel.hf_styles import ReplicatedGradAllReduce
from lightning_3d.core.tensor_parallel.rules import PARTIAL_GRAD, Tag, tensors_in
from lightning_3d.core.tensor_parallel.simulate import simulate
from lightning_3d.core.tensor_parallel.styles import LocalHeadCounts
from lightning_3d.core.torch_compat import leaf_probe

FINAL = "final:"  # marks, in the escaped set, the last module called in the forward pass


class AnalysisError(RuntimeError):
    """The body could not be run on the example input (the plan then needs explicit entries)."""


@dataclass
class AutoPlan:
    """Result of the analysis: ``styles[fqn] = (style, reason)`` and ``notes[fqn] = reason``; a style is a name,
    or a :class:`LocalHeadCounts` for an attention module that reshapes by its own head counts."""

    styles: dict[str, tuple[str | LocalHeadCounts, str]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    splits: dict[str, set[int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    inplace: dict[str, str] = field(default_factory=dict)


@dataclass
class _Group:
    members: list[str]
    colwise: list[str]
    rowwise: list[str]
    reason: str | None
    origin: str
    escaped: bool
    attention: bool


def divisors_text(sizes: list[int], limit: int = 128) -> str:
    """``"1, 2, 4, ..."``: the tp values (up to ``limit``) that divide every size in ``sizes``."""
    g = 0
    for s in sizes:
        g = math.gcd(g, int(s))
    return ", ".join(str(d) for d in range(1, min(g, limit) + 1) if g % d == 0) or "1"


def example_input_for(body: nn.Module) -> torch.Tensor | None:
    """A tiny input the analysis can run the whole body on.

    Looks at the first leaf module with parameters of ``body[0]`` (registration order): an
    ``nn.Embedding`` gets ``zeros(1, 2, dtype=long)`` (one sequence of two tokens), an
    ``nn.Linear`` ``zeros(1, in_features)``. The tensor is put on the device of the body's
    parameters (the meta device included).

    Args:
        body: the model body (an ``nn.Sequential``).

    Returns:
        The example input, or None when the first layer is of another kind.

    Example:
        >>> body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        >>> example_input_for(body).shape
        torch.Size([1, 8])
    """
    children = list(body.children())
    first = children[0] if children else body
    leaf = next(
        (
            m
            for m in first.modules()
            if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
        ),
        None,
    )
    param = next(body.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if isinstance(leaf, nn.Embedding):
        return torch.zeros(1, 2, dtype=torch.long, device=device)
    if isinstance(leaf, nn.Linear):
        return torch.zeros(1, leaf.in_features, dtype=leaf.weight.dtype, device=device)
    return None


def candidates(body: nn.Module) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """Linears and Embeddings the analysis may shard, and notes for those it must not touch."""
    notes: dict[str, str] = {}
    first_name: dict[int, str] = {}
    owners: dict[int, list[str]] = {}
    for fqn, mod in body.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{fqn}.{pname}" if fqn else pname)
    found: dict[str, nn.Module] = {}
    for fqn, mod in body.named_modules(remove_duplicate=False):
        if not isinstance(mod, (nn.Linear, nn.Embedding)) or not fqn:
            continue
        if id(mod) in first_name:
            other = first_name[id(mod)]
            notes[fqn] = notes[other] = f"the same module is registered twice ({other} and {fqn})"
            found.pop(other, None)
            continue
        first_name[id(mod)] = fqn
        base = nn.Linear if isinstance(mod, nn.Linear) else nn.Embedding
        tied = [o for p in mod.parameters(recurse=False) for o in owners[id(p)] if o.rsplit(".", 1)[0] != fqn]
        if tied:
            notes[fqn] = f"its weight is shared with {', '.join(tied)} (tied weights): sharding would untie them"
        elif next(mod.children(), None) is not None or not (type(mod).forward is base.forward or acts_as_linear(mod)):
            notes[fqn] = f"a {type(mod).__name__} with its own forward: give an explicit plan if it can be sharded"
        elif isinstance(mod, nn.Embedding) and (mod.max_norm is not None or mod.sparse or mod.scale_grad_by_freq):
            notes[fqn] = "an Embedding with max_norm, sparse or scale_grad_by_freq is not vocabulary-sharded"
        else:
            found[fqn] = mod
    return found, notes


def acts_as_linear(mod: nn.Module) -> bool:
    """Whether a subclass of ``nn.Linear`` with a forward of its own computes what ``nn.Linear`` does.

    Falcon's ``FalconLinear`` writes ``input @ self.weight.T + self.bias``: the same function, so the same styles
    shard it. The forward is run once on a small probe (a copy of the module's attributes with a random 3 x 5 float64
    weight and bias, on the CPU) and compared with ``F.linear``; anything else (a different result, an error, another
    output) keeps the module out of the plan.
    """
    if not isinstance(mod, nn.Linear) or isinstance(mod, nn.Embedding):
        return False
    g = torch.Generator().manual_seed(0)
    cpu = {"generator": g, "dtype": torch.float64, "device": "cpu"}  # whatever the default device (meta included)
    weight = torch.randn(3, 5, **cpu)  # type: ignore[arg-type]
    bias = torch.randn(3, **cpu) if mod.bias is not None else None  # type: ignore[arg-type]
    probe = leaf_probe(mod, {"weight": nn.Parameter(weight), "bias": None if bias is None else nn.Parameter(bias)})
    probe.in_features, probe.out_features = 5, 3
    x = torch.randn(2, 4, 5, **cpu)  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            out = type(mod).forward(probe, x)
    except Exception:  # any failure means "not a plain Linear"
        return False
    expected = torch.nn.functional.linear(x, weight, bias)
    return isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected, 1e-12, 1e-12)


class _Runner:
    """Runs the body on the example input under the analysis (eval mode, no grad, RNG restored)."""

    def __init__(self, body: nn.Module, example: Any) -> None:
        self.body, self.example = body, example

    def __call__(self) -> Any:
        if isinstance(self.example, dict):  # keyword arguments, as Lightning's example_input_array dicts
            return self.body(**self.example)
        args = self.example if isinstance(self.example, (tuple, list)) else (self.example,)
        return self.body(*args)

    def context_run(self, fn: Callable[[], Any]) -> Any:
        flags = [(m, m.training) for m in self.body.modules()]
        devices = [d for d in {t.device for t in tensors_in(self.example)} if d.type == "cuda"]
        try:
            self.body.eval()
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                return fn()
        finally:
            for m, flag in flags:
                m.training = flag


def _trace(
    runner: _Runner, modules: dict[str, nn.Module], forced: set[str], pins: Mapping[str, str]
) -> tuple[FlowState, dict[str, set[str]], set[str]]:
    """One traced forward pass. Returns the flow state, the roles each Linear took, escaped sources."""
    st = FlowState()
    st.watch = {id(p): fqn for fqn, mod in modules.items() for p in mod.parameters()}
    st.owners = {
        id(p): f"{fqn}.{pname}" if fqn else pname
        for fqn, mod in runner.body.named_modules()
        if fqn not in modules
        for pname, p in mod.named_parameters(recurse=False)
        if p.requires_grad
    }
    roles: dict[str, set[str]] = {}
    calls: list[str] = []
    handles = []

    def pre(_m: nn.Module, _inputs: tuple[Any, ...]) -> None:
        st.passthrough += 1

    def post(fqn: str) -> Callable[..., None]:
        def hook(mod: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            # still in passthrough: the tensor attributes read here must not count as uses
            x = inputs[0] if inputs else None
            tag = st.tag_of(x) if isinstance(x, torch.Tensor) else None
            grad = any(p.requires_grad for p in mod.parameters()) or (x is not None and st.is_grad(x))
            new: Tag | None = None
            if isinstance(mod, nn.Embedding) or x is None:
                role = "replicate"
                if tag is not None:
                    st.refuse(tag.srcs, f"feeds {fqn}, which cannot take a sharded input")
            else:
                role = _linear_role(fqn, mod, x, tag, st, forced, pins)  # type: ignore[arg-type]
                if role == "colwise":
                    new = Tag(out.ndim - 1, int(mod.out_features), frozenset({fqn}))
                    st.union([fqn])
            roles.setdefault(fqn, set()).add(role)
            calls.append(fqn)
            st.set_tag(out, new, grad)
            if isinstance(out, torch.Tensor):
                st.outputs[id(out)] = fqn
            st.events.append((f"module:{fqn}", [tuple(out.shape)], [new]))
            st.passthrough -= 1

        return hook

    for fqn, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post(fqn)))
    escaped: set[str] = set()

    def run() -> None:
        for t in tensors_in(runner.example):
            st.set_tag(t, None, t.is_floating_point())
        with FlowMode(st):
            out = runner()
        for t in tensors_in(out):
            tag = st.tag_of(t)
            if tag is not None:
                escaped.update(tag.srcs)
        if calls and roles[calls[-1]] == {"colwise"}:
            # The last module called: gathering its output makes everything after it see full
            # tensors, whatever the ops (e.g. log_softmax over the classes).
            escaped.add(FINAL + calls[-1])

    try:
        runner.context_run(run)
    except Exception as error:
        raise AnalysisError(f"{type(error).__name__}: {error}") from error
    finally:
        for h in handles:
            h.remove()
    _summed_or_refused(st)
    return st, roles, escaped


def _summed_or_refused(st: FlowState) -> None:
    """A parameter that meets sharded tensors (a per-head norm's weight) can have its gradient summed over tp only if
    every parameter of its module is used on sharded tensors alone; otherwise the groups it meets are refused."""
    by_module: dict[str, list[str]] = {}
    for name in [*st.summed, *st.full_uses]:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    for names in by_module.values():
        full = next((f"{n} ({st.full_uses[n]})" for n in names if n in st.full_uses), None)
        if full is None:
            continue
        for name in names:
            srcs = st.summed.pop(name, set())
            st.refuse(srcs, f"{PARTIAL_GRAD}: {full} is also used on unsharded tensors")


def summed_params(sharded: Collection[str], st: FlowState) -> dict[str, list[str]]:
    """Modules whose parameters meet only sharded tensors of groups the plan shards: ``module -> parameters``."""
    out: dict[str, list[str]] = {}
    for name, srcs in st.summed.items():
        if srcs and all(s in sharded for s in srcs):
            module, _, pname = name.rpartition(".")
            out.setdefault(module, []).append(pname)
    return out


def _linear_role(
    fqn: str, mod: nn.Linear, x: torch.Tensor, tag: Tag | None, st: FlowState, forced: set[str], pins: Mapping[str, str]
) -> str:
    pin = pins.get(fqn)
    if fqn in forced or pin in ("replicate", "other"):
        if tag is not None:
            st.refuse(tag.srcs, f"feeds {fqn}, which is left replicated")
        return "replicate"
    if pin == "colwise" or (pin is None and tag is None):
        if tag is not None:
            st.refuse(tag.srcs, f"feeds {fqn}, which is explicitly column-wise")
        return "colwise"
    if pin == "rowwise" or (tag is not None and tag.dim == x.ndim - 1 and tag.size == mod.in_features):
        if tag is not None:
            st.union([*tag.srcs, fqn])
        return "rowwise"
    assert tag is not None
    st.refuse(tag.srcs, f"reaches {fqn} sharded along a dimension other than its input features")
    return "replicate"


def _groups(
    st: FlowState, roles: dict[str, set[str]], escaped: set[str], display: Callable[[str], str]
) -> list[_Group]:
    by_root: dict[str, list[str]] = {}
    for fqn in roles:
        by_root.setdefault(st.find(fqn), []).append(fqn)
    groups = []
    for members in by_root.values():
        col = [m for m in members if "colwise" in roles[m]]
        row = [m for m in members if "rowwise" in roles[m]]
        if not col and not row:
            continue
        reason = next((st.reasons[m] for m in members if m in st.reasons), None)
        if reason is None and any(len(roles[m]) > 1 for m in members):
            reason = "a Linear of this group is called several times in different roles"
        esc = any(m in escaped for m in members)
        if not row and len(col) == 1 and FINAL + col[0] in escaped:
            reason, esc = None, True
        if reason is None and esc and (row or len(col) > 1):
            reason = "its sharded output leaves the body without passing through a row-wise Linear"
        origin = next((m for m in members if m in st.reasons), members[0])
        if reason is not None and origin in st.reasons:
            reason = f"the output of {display(origin)} {reason}"
        groups.append(_Group(members, col, row, reason, origin, esc, any(m in st.attention for m in members)))
    return groups


def _short(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    k = 0
    while all(len(p) > k + 1 for p in parts) and len({p[k] for p in parts}) == 1:
        k += 1
    return "/".join(".".join(p[k:]) for p in parts)


def _describe(g: _Group, st: FlowState) -> str:
    short = _short(g.colwise + g.rowwise).split("/")
    cols, rows = "/".join(short[: len(g.colwise)]), "/".join(short[len(g.colwise) :])
    if not g.attention:
        return f"{cols} -> {rows} (MLP)"
    heads = sorted({max(st.splits[m]) for m in g.colwise if st.splits.get(m)}, reverse=True)
    if len(heads) == 1:
        kind = f"attention, {heads[0]} heads"
    elif heads:
        kind = f"attention, {heads[0]} query heads, {heads[-1]} key/value heads"
    else:
        kind = "attention"
    return f"{cols} -> {rows} ({kind})"


def _check_pair(g: _Group, tp: int, modules: dict[str, nn.Module], st: FlowState, display: Callable[[str], str]) -> str:
    """Raise ValueError when a pair (MLP or attention) cannot be split ``tp`` ways; return its description."""
    desc = _describe(g, st)
    checks: list[tuple[str, str, str, int]] = []
    most = max((n for m in g.colwise for n in st.splits.get(m, ())), default=0)
    for m in g.colwise:
        for n in sorted(st.splits.get(m, ())):
            label = "number of parts its output is split into"
            if g.attention:
                label = "number of key/value heads" if n < most else "number of attention heads"
            checks.append((m, "colwise", label, n))

    def label(attr: str) -> str:
        return attr if g.attention else f"MLP hidden size ({attr})"

    for m in g.colwise:
        checks.append((m, "colwise", label("out_features"), int(modules[m].out_features)))
    for m in g.rowwise:
        checks.append((m, "rowwise", label("in_features"), int(modules[m].in_features)))
    works = divisors_text([n for *_, n in checks])
    for m, style, label, n in checks:
        if n % tp:
            raise ValueError(
                f"Tensor parallel cannot shard {display(m)} ({type(modules[m]).__name__}, {style}, {desc}) "
                f"with tp={tp}: its {label} = {n} is not divisible by tp={tp}. tp values that work: {works}. "
                f"(Or keep this group replicated with an explicit plan entry {{'{display(m)}': 'replicate', ...}}.)"
            )
    return desc


def _is_count_name(name: str) -> bool:
    low = name.lower()
    return "head" in low and not any(word in low for word in ("dim", "size", "scale", "width"))


def head_counts(body: nn.Module, members: list[str], heads: set[int], tp: int) -> dict[str, dict[str, int]]:
    """Integer head-count attributes of the modules around an attention group, by module name.

    Looked for on the modules from the group's Linears up to their nearest common ancestor (the attention
    module): attributes named like a head count (``num_heads``, ``n_head``, ``num_key_value_heads``; not
    ``head_dim``) whose value is one of the group's head counts ``heads`` (the numbers of parts its projections'
    outputs are viewed as) and divisible by ``tp``.

    Returns:
        ``{module name: {attribute: full count}}``; empty when there is none.
    """
    parts = [m.split(".")[:-1] for m in members]
    common = 0
    while all(len(p) > common for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    names = {".".join(p[:k]) for p in parts for k in range(common, len(p) + 1)}
    found: dict[str, dict[str, int]] = {}
    for name in sorted(names):
        mod = body.get_submodule(name)
        for attr, value in vars(mod).items():
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and _is_count_name(attr)
                and value in heads
                and value % tp == 0
            ):
                found.setdefault(name, {})[attr] = value
    return found


@contextmanager
def _local_counts(body: nn.Module, counts: Mapping[str, Mapping[str, int]], tp: int) -> Iterator[None]:
    """The head counts of one rank in place while the simulation runs; restored on exit."""
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for name, attrs in counts.items():
            mod = body.get_submodule(name)
            for attr, full in attrs.items():
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, full // tp)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def _counts_text(counts: Mapping[str, Mapping[str, int]], tp: int) -> str:
    return ", ".join(f"{attr} {n} -> {n // tp}" for attrs in counts.values() for attr, n in attrs.items())


def analyze(
    body: nn.Module, tp: int, example: Any, pins: Mapping[str, str], display: Callable[[str], str] = str
) -> AutoPlan:
    """Find the automatic plan of ``body`` for ``tp`` ranks.

    Args:
        body: the model body; left unchanged (hooks removed, modes exited, flags and RNG restored).
        tp: tensor-parallel size (> 1).
        example: input of the body (a tensor, a tuple of positional arguments or a dict of keyword arguments).
        pins: explicit entries by body-relative name: "colwise", "rowwise", "replicate" or "other";
            they are taken as given and never appear in the result.
        display: maps a body-relative name to the name shown in messages.

    Returns:
        The styles and notes of the modules the analysis decided on.

    Raises:
        ValueError: an MLP or attention pair cannot be split ``tp`` ways (hidden size or heads).
        AnalysisError: the body does not run on ``example``.
    """
    modules, ineligible = candidates(body)
    forced = {f for f in modules if pins.get(f) == "replicate"}
    why: dict[str, str] = {}
    runner = _Runner(body, example)
    counts: dict[frozenset[str], dict[str, dict[str, int]]] = {}  # attention group -> its modules' head counts
    tried: set[frozenset[str]] = set()
    unfit: dict[frozenset[str], str] = {}  # pairs of the user's plan that fail the local-shape check
    for _ in range(3 * len(modules) + 2):
        st, roles, escaped = _trace(runner, modules, forced, pins)
        new_forced = {f for f in st.direct if f not in pins and f not in ineligible}
        for f in new_forced:
            ineligible[f] = (
                f"its weight is also used outside its own forward ({st.direct[f]}): sharding it would break that use"
            )
            if isinstance(modules[f], nn.Linear):
                forced.add(f)
        if new_forced:
            continue
        groups = _groups(st, roles, escaped, display)
        for g in (g for g in groups if g.reason):
            for m in g.members:
                why[m] = g.reason if m == g.origin else f"grouped with {display(g.origin)}: {g.reason}"  # type: ignore[assignment]
            new_forced |= {m for m in g.colwise if m not in pins and m not in forced}
        if new_forced:
            forced |= new_forced
            continue
        plan = AutoPlan(splits=st.splits, inplace=st.inplace)
        simulated: list[_Group] = []
        descs: dict[frozenset[str], str] = {}
        for g in (g for g in groups if not g.reason):
            auto = [m for m in g.members if m not in pins]
            if g.colwise and g.rowwise:
                desc = descs[frozenset(g.members)] = _check_pair(g, tp, modules, st, display)
                plan.styles.update({m: ("colwise" if m in g.colwise else "rowwise", desc) for m in auto})
                # a pair the user's plan shards (in part) is checked too: it is theirs, but wrong numbers are not
                kinds = {pins.get(m) for m in g.members}
                if frozenset(g.members) not in unfit and kinds <= {None, "colwise", "rowwise"}:
                    simulated.append(g)
            elif len(g.colwise) == 1 and g.escaped and auto:
                out = int(modules[auto[0]].out_features)
                if out % tp == 0:
                    plan.styles[auto[0]] = (
                        "colwise_gather",
                        "final projection: its full output leaves the body (all-gathered after the matmul)",
                    )
                else:
                    why[auto[0]] = (
                        f"final projection with {out} outputs, not divisible by tp={tp} "
                        f"(tp values that work: {divisors_text([out])})"
                    )
            else:
                why.update({m: "its output does not reach a row-wise Linear (no MLP/attention pair)" for m in auto})
        # a parameter meeting the tensors of a sharded group and of one left whole: its gradient could not be summed
        sharded = set(plan.styles) | {m for m, kind in pins.items() if kind in ("colwise", "rowwise")}
        mixed = {
            src
            for srcs in st.summed.values()
            if not all(x in sharded for x in srcs)
            for src in srcs
            if src in sharded and src not in pins and src not in forced
        }
        if mixed:
            for m in mixed:
                why[m] = f"{PARTIAL_GRAD} (a parameter it meets also meets a group left replicated)"
            forced |= mixed
            continue
        if simulated:
            col = {m for g in simulated for m in g.colwise}
            row = {m for g in simulated for m in g.rowwise}
            local = {n: a for g in simulated for n, a in counts.get(frozenset(g.members), {}).items()}
            with _local_counts(body, local, tp):
                failure = runner.context_run(partial(simulate, runner, st, tp, modules, col, row))
            if failure is not None:
                named = [g for g in simulated if set(g.members) & failure.srcs]
                for g in named or simulated:
                    key = frozenset(g.members)
                    # an attention module that reshapes by its own head counts: try them divided by tp, once
                    if named and g.attention and key not in tried:
                        tried.add(key)
                        heads = {n for m in g.colwise for n in st.splits.get(m, ())}
                        found = head_counts(body, g.members, heads, tp)
                        if found and not any(n in pins for n in found):
                            counts[key] = found
                            continue
                    counts.pop(key, None)
                    if any(m in pins for m in g.members):  # the user's pair: kept as given, with a warning
                        unfit[key] = str(failure)
                        continue
                    why.update({m: str(failure) for m in g.members})
                    forced |= set(g.colwise)
                continue
            for g in simulated:
                for name, attrs in counts.get(frozenset(g.members), {}).items():
                    desc = descs[frozenset(g.members)]
                    plan.styles[name] = (
                        LocalHeadCounts(attrs),
                        f"{_counts_text({name: attrs}, tp)} per rank: {desc}",
                    )
        for module, pnames in summed_params(sharded, st).items():
            if module in pins:  # the user's entry for that module wins
                continue
            groups_met = sorted({s for p in pnames for s in st.summed[f"{module}.{p}" if module else p]})
            plan.styles[module] = (
                ReplicatedGradAllReduce(),
                f"gradient of {', '.join(pnames)} summed over tp: it meets the sharded outputs of "
                f"{_short(groups_met)} (each rank sees its own part)",
            )
        plan.warnings = [
            f"the explicit tensor-parallel plan shards {'/'.join(display(m) for m in sorted(key))}, but {reason}; "
            "this gives wrong numbers or fails: keep them replicated or change the model code"
            for key, reason in unfit.items()
        ]
        _embeddings(plan, {f: m for f, m in modules.items() if f not in ineligible}, roles, pins, tp, why)
        for fqn in list(modules) + list(ineligible):
            if fqn not in plan.styles and fqn not in pins:
                plan.notes[fqn] = (
                    ineligible.get(fqn)
                    or why.get(fqn)
                    or ("never called as a module during the forward pass" if fqn not in roles else "not shardable")
                )
        return plan
    raise AnalysisError("the analysis did not settle")  # pragma: no cover - forced grows every round


def _embeddings(
    plan: AutoPlan,
    modules: dict[str, nn.Module],
    roles: dict[str, set[str]],
    pins: Mapping[str, str],
    tp: int,
    why: dict[str, str],
) -> None:
    for fqn, mod in modules.items():
        if not isinstance(mod, nn.Embedding) or fqn in pins or fqn not in roles:
            continue
        n = mod.num_embeddings
        if n % tp == 0:
            plan.styles[fqn] = ("vocab", f"vocabulary-sharded: {n} rows, {n // tp} per rank; output all-reduced")
        else:
            why[fqn] = f"{n} embeddings are not divisible by tp={tp} (tp values that work: {divisors_text([n])})"
