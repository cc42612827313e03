"""The tensor-parallel plan a Hugging Face model declares, as torch ``ParallelStyle`` objects.

:func:`hf_tp_plan` finds the ``transformers.PreTrainedModel`` modules inside any ``nn.Module`` (typically a
LightningModule holding one as ``self.model``) and returns their own plan with concrete, root-relative module
names: ``"model.model.layers.0.self_attn.q_proj" -> colwise``.

Where transformers keeps the plan (5.x): the base model's config class declares ``base_model_tp_plan``
(``"layers.*.self_attn.q_proj": "colwise"``, relative to the base model), the head model class ``_tp_plan``
(``{"lm_head": "colwise_gather_output"}``); ``PreTrainedModel.post_init`` merges them into the instance's
``tp_plan`` (base entries under ``base_model_prefix``, e.g. ``"model."``) and adds
``"embed_tokens": "embedding_rowwise"`` for a base model whose ``embed_tokens`` is an ``nn.Embedding`` (5.25; on
older releases, which leave it out, :func:`declared_tp_plan` adds it to a plan transformers made). A ``*``
stands for a layer number between dots (``transformers.distributed.parallel_utils``
``replace_layer_number_by_wildcard``), which is how names are matched here.

The style names, what they mean in ``transformers/distributed/tensor_parallel.py``, and the torch style used here
(:mod:`~lightning_3d.core.tensor_parallel.hf_styles`; Linear and HF ``Conv1D`` alike):

* ``colwise``: weight and bias Shard(0) (output features), input replicated, output Shard(-1) ->
  ``HFColwiseParallel()``.
* ``colwise_gather_output`` (and its alias ``colwise_rep``): the same with the output all-gathered ->
  ``HFColwiseParallel(output_layouts=Replicate())``.
* ``rowwise``: weight Shard(1) (input features), bias whole, input Shard(-1), output all-reduced ->
  ``HFRowwiseParallel()``.
* ``rowwise_split_input`` (and ``rowwise_rep``): the same with a replicated input, split locally ->
  ``HFRowwiseParallel(input_layouts=Replicate())``.
* ``embedding_rowwise``: vocabulary-parallel Embedding, weight Shard(0), partial lookups all-reduced ->
  ``HFRowwiseParallel()`` on the Embedding.
* ``embedding_colwise``: Embedding dim sharded, Shard(1), output gathered ->
  ``HFColwiseParallel(output_layouts=Replicate())`` on the Embedding.
* ``replicated_with_grad_allreduce``: parameters replicated, their gradient summed over tp ->
  ``ReplicatedGradAllReduce()``.
* ``replicate``: nothing sharded (left out of the styles, listed in the notes).

Every other style (``packed_colwise``, ``sequence_parallel``, ``all_reduce``, ``local_params``, the MoE and MLA
styles, ...) is refused with a ``ValueError`` naming the style and the module.

Attention under these plans: Llama / Qwen3 / Gemma attention reshape with ``view(*input_shape, -1,
head_dim)`` and ``reshape(*input_shape, -1)``, so a rank with ``num_heads / tp`` heads computes them
correctly; ``num_key_value_groups = num_attention_heads // num_key_value_heads`` stays valid on every rank,
since both counts are divided by tp and rank r holds q heads ``[r*H/tp, (r+1)*H/tp)`` whose kv heads are exactly
its own ``[r*KV/tp, (r+1)*KV/tp)``. The plan requires ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size`` and (for a vocabulary-sharded embedding / head) ``vocab_size`` to divide by tp, and
raises naming the quantity and the tp values that work otherwise.

GPT-2 (and other models built from HF ``Conv1D`` blocks) declares no plan; :func:`hf_tp_plan` makes one: the MLP
``c_fc`` column- and ``c_proj`` row-parallel with Conv1D's transposed layout, the embedding and LM head
vocabulary-parallel when the vocabulary divides by tp, and the attention replicated (see ``GPT2_ATTENTION_NOTE``).

Tied weights: a parameter shared by several modules (``lm_head.weight`` is the input embedding's weight in GPT-2
and Gemma, and in any model with ``tie_word_embeddings=True``) stays ONE parameter. HF's own plans shard both
uses the same way (the embedding on the vocabulary, ``embedding_rowwise`` -> weight Shard(0); the head
``colwise_gather_output`` -> weight Shard(0)), so the pair is sharded on the vocabulary and the styles hand both
modules the same DTensor parameter (:class:`~lightning_3d.core.tensor_parallel.hf_styles.TiedParams`); the
gradients of both uses add up in it, as in single-device training. If the uses would shard it differently (one
sharded, one not), both modules are left replicated with a note, when that is safe (styles with replicated input
and output); otherwise the plan is refused. Under pipeline parallelism the two uses must be on the same stage to
stay tied.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.core.tensor_parallel.analyzer import divisors_text
from lightning_3d.core.tensor_parallel.hf_styles import (
    PLACEMENTS,
    HFColwiseParallel,
    HFRowwiseParallel,
    ReplicatedGradAllReduce,
    TiedParams,
    module_kind,
)
from lightning_3d.core.tensor_parallel.styles import relative_name

# HF style name -> (direction of PLACEMENTS or "replicated_grad" / "replicate", module kinds it applies to).
SUPPORTED_STYLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "colwise": ("col", ("linear", "conv1d")),
    "colwise_gather_output": ("col", ("linear", "conv1d")),
    "colwise_rep": ("col", ("linear", "conv1d")),
    "rowwise": ("row", ("linear", "conv1d")),
    "rowwise_split_input": ("row", ("linear", "conv1d")),
    "rowwise_rep": ("row", ("linear", "conv1d")),
    "embedding_rowwise": ("row", ("embedding",)),
    "embedding_colwise": ("col", ("embedding",)),
    "replicated_with_grad_allreduce": ("replicated_grad", ()),
    "replicate": ("replicate", ()),
}
"""The Hugging Face style names this module translates."""

# Styles whose module takes a replicated input and returns a replicated output: leaving such a module
# unsharded changes nothing around it (used to resolve tied parameters the plan would shard inconsistently).
_SELF_CONTAINED = frozenset(
    [
        "colwise_gather_output",
        "colwise_rep",
        "rowwise_split_input",
        "rowwise_rep",
        "embedding_rowwise",
        "embedding_colwise",
    ]
)

GPT2_ATTENTION_NOTE = (
    "fused attention left replicated: c_attn packs q|k|v into one Conv1D [hidden, 3*hidden] and GPT2Attention "
    "splits its output with split_size = hidden_size (the global width), so sharding per head needs a strided "
    "q|k|v layout (torch's private _StridedShard) and a changed split_size; the MLP is sharded"
)
"""Why the GPT-2 plan leaves ``attn`` (c_attn, c_proj) replicated."""


@dataclass(frozen=True)
class HFEntry:
    """How one module is sharded.

    Attributes:
        style: the Hugging Face style name (``"colwise"``, ``"embedding_rowwise"``, ...).
        source: where it comes from, e.g. ``"LlamaForCausalLM tp_plan 'model.layers.*.self_attn.q_proj'"`` or
            ``"lightning_3d plan for GPT2LMHeadModel (Conv1D, transposed weights)"``.
    """

    style: str
    source: str


@dataclass
class HFPlan:
    """A Hugging Face model's tensor-parallel plan, with module names relative to the root it was made for.

    Attributes:
        entries: module FQN -> :class:`HFEntry`, in module order.
        notes: module FQN -> why it is left replicated (for the layout print-out).
        tied: groups of parameter FQNs that are one parameter and are sharded together.
        models: FQN of each Hugging Face model found -> its class name.
        ties: the registry that keeps tied parameters one parameter (shared by every style made from this plan).
    """

    entries: dict[str, HFEntry] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)
    ties: TiedParams = field(default_factory=TiedParams, repr=False, compare=False)

    def styles_for(self, prefix: str = "") -> dict[str, ParallelStyle]:
        """``parallelize_module`` plan for the submodule at ``prefix`` (``""``: the root).

        Args:
            prefix: root-relative name of the submodule the plan is applied to.

        Returns:
            Fresh ``ParallelStyle`` objects keyed by names relative to ``prefix``; ``replicate`` entries are
            left out. Styles from all calls share this plan's tied-parameter registry, so the embedding and an
            LM head tied to it stay one parameter even when sharded in separate calls.

        Example:
            >>> plan = hf_tp_plan(lightning_module, tp=2)  # doctest: +SKIP
            >>> parallelize_module(lightning_module, tp_mesh, plan.styles_for())  # doctest: +SKIP
        """
        out: dict[str, ParallelStyle] = {}
        for fqn, entry in self.entries.items():
            key = relative_name(fqn, prefix)
            if key is None:
                continue
            style = make_hf_style(entry.style, self.ties)
            if style is not None:
                out[key] = style
        return out

    @property
    def styles(self) -> dict[str, ParallelStyle]:
        """:meth:`styles_for` the root: ``{module FQN: ParallelStyle}``."""
        return self.styles_for("")

    def describe(self) -> str:
        """One line per sharded or noted module: ``name  style  source`` or ``name  replicate  reason``."""
        rows = [(name, e.style, e.source) for name, e in self.entries.items()]
        rows += [(name, "replicate", note) for name, note in self.notes.items()]
        width = [max((len(r[i]) for r in rows), default=0) for i in range(2)]
        return "\n".join(f"{a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows)


def make_hf_style(style: str, ties: TiedParams | None = None) -> ParallelStyle | None:
    """A fresh torch ``ParallelStyle`` for a Hugging Face style name (None for ``replicate``).

    Args:
        style: a name from :data:`SUPPORTED_STYLES`.
        ties: the tied-parameter registry the style shares with the rest of its plan.

    Raises:
        ValueError: a style this module does not translate.
    """
    if style in ("colwise",):
        return HFColwiseParallel(ties=ties)
    if style in ("colwise_gather_output", "colwise_rep", "embedding_colwise"):
        return HFColwiseParallel(output_layouts=Replicate(), ties=ties)
    if style == "rowwise":
        return HFRowwiseParallel(ties=ties)
    if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return HFRowwiseParallel(input_layouts=Replicate(), ties=ties)
    if style == "replicated_with_grad_allreduce":
        return ReplicatedGradAllReduce()
    if style == "replicate":
        return None
    raise ValueError(f"unsupported Hugging Face tensor-parallel style {style!r}; supported: {_supported()}")


def _supported() -> str:
    return ", ".join(SUPPORTED_STYLES)


def pretrained_model_class() -> type[nn.Module] | None:
    """``transformers.PreTrainedModel``, or None when ``transformers.modeling_utils`` has not been imported.

    A module holding a Hugging Face model has imported it; looking in ``sys.modules`` instead of importing
    spares every other model the seconds transformers takes to import (and works without transformers).
    """
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None)


def find_hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``PreTrainedModel`` modules in ``root`` (``root`` itself included), with their FQNs.

    A head model (``LlamaForCausalLM``) holds its base model (``LlamaModel``), also a ``PreTrainedModel``;
    only the outer one is returned, as its plan covers both.
    """
    base = pretrained_model_class()
    if base is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if isinstance(module, base) and not any(_inside(name, outer) for outer, _ in found):
            found.append((name, module))
    return found


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def declared_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a Hugging Face model declares, names relative to the model, with ``*`` globs.

    The instance's merged ``tp_plan`` (made by ``post_init``; a user may replace it with ``model.tp_plan = {...}``
    or empty it with ``model.tp_plan = None``); for a model that did not run ``post_init``, the same merge done
    here: the class ``_tp_plan`` plus the config's ``base_model_tp_plan`` under ``base_model_prefix``.

    A plan transformers made (not one the user set) gets transformers 5.25's embedding rule on every release:
    the base model's ``embed_tokens``, an ``nn.Embedding`` the plan does not name, is ``embedding_rowwise``
    (:func:`_with_embedding_rule`). Releases before it (5.17) leave that entry out of Llama-family plans, so the
    embedding, the largest matrix of most models, stayed whole on every tp rank.
    """
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict):  # set by post_init, possibly replaced or emptied by the user
        made_by_transformers = plan == _merged_plan(model, children=True)
        return _with_embedding_rule(model, plan) if made_by_transformers else dict(plan)
    return _with_embedding_rule(model, _merged_plan(model, children=False))


def _base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, base model)``: ``("model", model.model)`` for a head model, ``("", model)`` for a base model."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return (prefix, base) if isinstance(base, nn.Module) and base is not model else ("", model)


def _merged_plan(model: nn.Module, children: bool) -> dict[str, str]:
    """What ``post_init`` merges without the embedding rule: the class ``_tp_plan``, the config's
    ``base_model_tp_plan`` (under the base model's prefix) and, with ``children``, the plans the child models'
    own ``post_init`` made (``_tp_plan`` of each direct child, under its name), as transformers merges them."""
    out = dict(getattr(type(model), "_tp_plan", None) or {})
    prefix, base = _base_model(model)
    base_plan = dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})
    if base is model or not children:
        out.update({f"{prefix}.{k}" if prefix else k: v for k, v in base_plan.items()})
    if children:
        for name, child in model.named_children():
            own = getattr(child, "_tp_plan", None)
            if isinstance(own, dict) and own:
                out.update({f"{name}.{k}": v for k, v in own.items()})
    return out


def _with_embedding_rule(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the base model's ``embed_tokens`` vocabulary-parallel (``embedding_rowwise``) when it is an
    ``nn.Embedding`` that the plan does not name and the base model has a plan of its own: transformers 5.25's
    ``init_parallel_plans`` rule, applied here so that older releases shard it alike."""
    prefix, base = _base_model(model)
    key = f"{prefix}.embed_tokens" if prefix else "embed_tokens"
    own = getattr(type(base), "_tp_plan", None) or getattr(getattr(base, "config", None), "base_model_tp_plan", None)
    if not own or key in plan or not isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        return dict(plan)
    return {key: "embedding_rowwise", **plan}


def generic_name(name: str) -> str:
    """``"model.layers.3.mlp"`` -> ``"model.layers.*.mlp"``: layer numbers between dots become ``*`` (HF's rule)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _text_config(model: nn.Module) -> object:
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _expand(model: nn.Module, declared: dict[str, str], who: str) -> dict[str, HFEntry]:
    """Concrete module name (relative to ``model``) -> entry, in module order; refuses unsupported styles."""
    by_generic: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        if name:
            by_generic.setdefault(generic_name(name), []).append(name)
    params = {generic_name(n) for n, _ in model.named_parameters()}
    entries: dict[str, HFEntry] = {}
    for key, style in declared.items():
        names = by_generic.get(key, [])
        if style not in SUPPORTED_STYLES:
            if names:
                where = "module " + ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
            else:
                where = "a parameter" if key in params else "no module of this model"
            raise ValueError(
                f"{who} tensor-parallel plan entry {key!r} ({where}): style {style!r} is not supported by "
                f"lightning_3d. Supported styles: {_supported()}. Pass tp=1, or replace the entry in the "
                "model's tp_plan."
            )
        if not names and key in params:
            raise ValueError(
                f"{who} tensor-parallel plan entry {key!r} names a parameter, not a module; lightning_3d shards "
                f"whole modules (style {style!r})."
            )
        for name in names:
            entries[name] = HFEntry(style, f"{who} tp_plan {key!r}")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(entries.items(), key=lambda kv: order[kv[0]]))


def _check_modules(model: nn.Module, entries: dict[str, HFEntry], who: str) -> None:
    modules = dict(model.named_modules())
    for name, entry in entries.items():
        direction, kinds = SUPPORTED_STYLES[entry.style]
        mod = modules[name]
        if kinds and module_kind(mod) not in kinds:
            raise ValueError(
                f"{who} tensor-parallel plan: style {entry.style!r} on {name} ({type(mod).__name__}) applies to "
                f"{' and '.join(kinds)} modules only."
            )
        if direction == "replicated_grad" and not any(True for _ in mod.parameters(recurse=False)):
            raise ValueError(
                f"{who} tensor-parallel plan: style {entry.style!r} on {name} ({type(mod).__name__}), which has no "
                "parameters of its own."
            )


def _sharded_size(mod: nn.Module, style: str) -> tuple[str, int] | None:
    """The size a style splits: (what, n)."""
    direction, _ = SUPPORTED_STYLES[style]
    kind = module_kind(mod)
    if direction not in ("col", "row") or kind is None:
        return None
    if kind == "embedding":
        emb: nn.Embedding = mod  # type: ignore[assignment]
        return ("num_embeddings", emb.num_embeddings) if direction == "row" else ("embedding_dim", emb.embedding_dim)
    weight = mod.weight  # Linear [out, in]; Conv1D [in, out]
    out_features, in_features = (weight.shape[0], weight.shape[1]) if kind == "linear" else weight.shape[::-1]
    return ("out_features", int(out_features)) if direction == "col" else ("in_features", int(in_features))


def _is_attention(name: str) -> bool:
    return any("attn" in part.lower() or "attention" in part.lower() for part in name.split("."))


def _vocab_modules(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, output head) from ``get_input_embeddings`` / ``get_output_embeddings``; None if absent."""
    found: list[nn.Module | None] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except (NotImplementedError, AttributeError):
            module = None
        found.append(module if isinstance(module, nn.Module) else None)
    return found[0], found[1]


def check_divisible(model: nn.Module, entries: dict[str, HFEntry], tp: int, who: str) -> None:
    """Raise ValueError when a quantity the plan splits is not divisible by ``tp``.

    Checked, when the plan splits them: ``num_attention_heads`` and ``num_key_value_heads`` (any sharded module
    inside an attention block), ``intermediate_size`` (a sharded MLP module with that many features),
    ``vocab_size`` (a sharded input embedding or output head), and each sharded module's split size. The message
    names the quantity and lists the tp values that divide all of them.
    """
    config = _text_config(model)
    modules = dict(model.named_modules())
    sizes = {n: _sharded_size(modules[n], e.style) for n, e in entries.items()}
    sizes = {n: s for n, s in sizes.items() if s is not None}
    vocab_modules = {id(m) for m in _vocab_modules(model) if m is not None}
    checks: list[tuple[str, int]] = []
    if any(_is_attention(n) for n in sizes):
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                checks.append((f"config.{attr}", value))
    mlp_values = {
        n for name, (_, n) in sizes.items() if not _is_attention(name) and id(modules[name]) not in vocab_modules
    }
    value = getattr(config, "intermediate_size", None)
    if isinstance(value, int) and value in mlp_values:
        checks.append(("config.intermediate_size", value))
    value = getattr(config, "vocab_size", None)
    on_vocab = [n for n, (what, _) in sizes.items() if id(modules[n]) in vocab_modules and what != "embedding_dim"]
    if isinstance(value, int) and on_vocab:
        checks.append(("config.vocab_size", value))
    checks += [(f"{name}.{what}", n) for name, (what, n) in sizes.items()]
    works = divisors_text([n for _, n in checks])
    for label, n in checks:
        if n % tp:
            raise ValueError(
                f"Tensor parallel cannot shard {who} with tp={tp}: {label} = {n} is not divisible by tp={tp}. "
                f"tp values that work: {works}."
            )


def _conv1d_plan(model: nn.Module, tp: int, who: str) -> tuple[dict[str, HFEntry], dict[str, str]]:
    """lightning_3d's plan for a model built from HF ``Conv1D`` blocks (GPT-2), which declares none."""
    entries: dict[str, HFEntry] = {}
    notes: dict[str, str] = {}
    source = f"lightning_3d plan for {who} (Conv1D, transposed weights)"
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if module_kind(mod) != "conv1d":
            continue
        parent, _, leaf = name.rpartition(".")
        if _is_attention(parent):
            if parent not in notes and (module_kind(modules.get(f"{parent}.c_attn")) == "conv1d"):
                notes[parent] = GPT2_ATTENTION_NOTE
            continue
        sibling = f"{parent}.c_proj" if leaf == "c_fc" else f"{parent}.c_fc"
        if leaf in ("c_fc", "c_proj") and module_kind(modules.get(sibling)) == "conv1d":
            entries[name] = HFEntry("colwise" if leaf == "c_fc" else "rowwise", source)
    if not entries:
        return {}, {}
    # The vocabulary pair (input embedding, LM head tied to it): vocabulary-parallel when the vocabulary
    # divides by tp; otherwise left replicated (a choice this plan can make, unlike a model's own plan).
    names = {id(m): n for n, m in modules.items()}
    pair = []
    for module, style in zip(_vocab_modules(model), ("embedding_rowwise", "colwise_gather_output")):
        name = names.get(id(module)) if module is not None else None
        if name and module_kind(module) == ("embedding" if style == "embedding_rowwise" else "linear"):
            pair.append((name, style))
    vocab = getattr(_text_config(model), "vocab_size", None)
    for name, style in pair:
        if isinstance(vocab, int) and vocab % tp == 0:
            entries[name] = HFEntry(style, source)
        else:
            notes[name] = f"vocabulary of {vocab} not divisible by tp={tp}: embedding and LM head left replicated"
    order = {name: i for i, name in enumerate(modules)}
    return dict(sorted(entries.items(), key=lambda kv: order[kv[0]])), notes


def _placement(modules: dict[str, nn.Module], entries: dict[str, HFEntry], param_fqn: str) -> str:
    """How ``param_fqn`` is laid out under the plan: ``"Shard(0)"``, ``"replicate"``, ``"replicate+grad_allreduce"``."""
    owner, _, pname = param_fqn.rpartition(".")
    entry = entries.get(owner)
    if entry is None:
        return "replicate"
    direction, _ = SUPPORTED_STYLES[entry.style]
    if direction == "replicate":
        return "replicate"
    if direction == "replicated_grad":
        return "replicate+grad_allreduce"
    kind = module_kind(modules[owner])
    placement: Placement | None = PLACEMENTS[direction].get(kind or "", {}).get(pname)
    return repr(placement) if placement is not None else "replicate"


def _resolve_ties(root: nn.Module, plan: HFPlan) -> None:
    """Keep tied parameters one parameter: record groups sharded alike, unshard groups sharded differently."""
    groups: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    modules = dict(root.named_modules(remove_duplicate=False))
    for names in groups.values():
        if len(names) < 2:
            continue
        layouts = {n: _placement(modules, plan.entries, n) for n in names}
        if len(set(layouts.values())) == 1:
            if next(iter(layouts.values())) != "replicate":
                plan.tied.append(tuple(names))
            continue
        owners = sorted({n.rpartition(".")[0] for n in names if n.rpartition(".")[0] in plan.entries})
        unsafe = [o for o in owners if plan.entries[o].style not in _SELF_CONTAINED]
        shown = ", ".join(f"{n} ({layouts[n]})" for n in names)
        if unsafe:
            raise ValueError(
                f"Tied parameters {shown} would be sharded differently, and {', '.join(unsafe)} cannot simply be "
                "left unsharded (its input or output is sharded). Untie them or give both uses the same style."
            )
        for owner in owners:
            del plan.entries[owner]
            plan.notes[owner] = f"left replicated: its weight is tied to {', '.join(names)}, sharded differently"


def hf_tp_plan(root: nn.Module, tp: int) -> HFPlan | None:
    """The Hugging Face models' own tensor-parallel plans in ``root``, as torch styles with concrete names.

    Args:
        root: any module, e.g. a LightningModule holding a ``LlamaForCausalLM`` as ``self.model``. Parameters
            may be on the meta device.
        tp: tensor-parallel size (the plan is the same for any tp; tp is used for the divisibility checks).

    Returns:
        The plan, keyed by module names relative to ``root`` (``"model.model.layers.0.self_attn.q_proj"``), or
        None when ``root`` holds no Hugging Face model, or none with a plan (the model declares none and is
        not built from ``Conv1D`` blocks like GPT-2).

    Raises:
        ValueError: tp < 1; a style that is not supported (naming the style and the module); a style on a
            module it does not apply to; a split quantity not divisible by tp (naming it and the tp values
            that work); tied parameters sharded inconsistently in a way that cannot be resolved.

    Example:
        >>> plan = hf_tp_plan(lit_module, tp=2)  # doctest: +SKIP
        >>> plan.entries["model.model.layers.0.self_attn.q_proj"].style  # doctest: +SKIP
        'colwise'
        >>> parallelize_module(lit_module, tp_mesh, plan.styles)  # doctest: +SKIP
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"Tensor-parallel size must be a positive int, got tp={tp!r}.")
    found = find_hf_models(root)
    if not found:
        return None
    plan = HFPlan()
    for prefix, model in found:
        who = type(model).__name__
        declared = declared_tp_plan(model)
        if declared:
            entries = _expand(model, declared, who)
            notes: dict[str, str] = {}
        else:
            entries, notes = _conv1d_plan(model, tp, who)
            if not entries:
                continue
        entries = _with_learned_activations(model, entries, who)
        entries = _with_adapters(model, entries, who)
        _check_modules(model, entries, who)
        check_divisible(model, entries, tp, f"{who}{f' ({prefix})' if prefix else ''}")
        plan.models[prefix] = who
        for name, entry in entries.items():
            if entry.style == "replicate":
                notes.setdefault(name, f"{entry.source}: replicate")
            else:
                plan.entries[_join(prefix, name)] = entry
        plan.notes.update({_join(prefix, n): note for n, note in notes.items()})
    if not plan.models:
        return None
    _resolve_ties(root, plan)
    return plan


def _lora_adapters(module: nn.Module) -> list[str] | None:
    """The adapter names of a PEFT LoRA layer (a wrapper holding ``base_layer`` and ``lora_A`` / ``lora_B``
    ``ModuleDict`` s), or ``None`` for any other module."""
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not isinstance(getattr(module, "base_layer", None), nn.Module) or not isinstance(lora_a, nn.ModuleDict):
        return None
    return [name for name in lora_a if isinstance(lora_b, nn.ModuleDict) and name in lora_b]


def _saved_copies(module: nn.Module) -> list[str] | None:
    """The adapter names of a PEFT ``modules_to_save`` wrapper (``original_module`` and a ``modules_to_save``
    ``ModuleDict`` of trainable copies), or ``None`` for any other module."""
    copies = getattr(module, "modules_to_save", None)
    if not isinstance(getattr(module, "original_module", None), nn.Module) or not isinstance(copies, nn.ModuleDict):
        return None
    return list(copies)


def _with_adapters(model: nn.Module, entries: dict[str, HFEntry], who: str) -> dict[str, HFEntry]:
    """``entries`` with each PEFT LoRA layer's style moved to what it wraps, Megatron's LoRA layout (and PEFT's own
    under Hugging Face's tensor parallelism): a column-parallel base layer's ``lora_B`` is column-parallel too and
    its ``lora_A`` replicated (its input is replicated, the gradient the sharded ``lora_B`` hands back is summed
    over tp); a row-parallel base layer's ``lora_A`` is row-parallel (its output all-reduced) and its ``lora_B``
    replicated. Each adapter's output then has the base layer's layout, and ``base + B(A(x))`` adds alike shards.
    A ``modules_to_save`` wrapper (a head trained whole beside the adapters) gives the style to its original and
    to each trained copy.

    A LoRA layer on an embedding gives the style to its base alone: its adapters are parameters, not modules, and
    stay whole (the embedding styles' outputs are whole).
    """
    modules = dict(model.named_modules())
    out: dict[str, HFEntry] = {}
    for name, entry in entries.items():
        copies = _saved_copies(modules[name])
        if copies is not None:  # modules_to_save: the frozen original and each trainable copy, sharded alike
            source = f"{entry.source}, on the PEFT wrapper's original and trained copies"
            for inner in ["original_module", *(f"modules_to_save.{c}" for c in copies)]:
                out[f"{name}.{inner}"] = HFEntry(entry.style, source)
            continue
        adapters = _lora_adapters(modules[name])
        direction = SUPPORTED_STYLES.get(entry.style, ("", ()))[0]
        if adapters is None or direction not in ("col", "row"):
            out[name] = entry
            continue
        if module_kind(modules[f"{name}.base_layer"]) == "embedding":
            # PEFT's embedding adapters are parameters (``lora_embedding_A`` / ``_B``) that its forward looks up and
            # multiplies itself, not modules a style could shard. Both embedding styles hand on a whole (replicated)
            # output, so the adapters stay whole beside the sharded base: ``base(x) + B(A[x])`` adds whole tensors,
            # and every tp rank computes the same adapter gradients from the same whole upstream gradient.
            if entry.style not in _SELF_CONTAINED:
                raise ValueError(
                    f"{who} tensor-parallel plan: {name} is a LoRA layer on an embedding ({entry.style!r}): its "
                    "adapters stay whole, which needs a style with a whole output ('embedding_rowwise', "
                    "'embedding_colwise'). Use one of those, leave the embedding out of the LoRA target_modules, or "
                    "use tp=1."
                )
            out[f"{name}.base_layer"] = HFEntry(
                entry.style, f"{entry.source}, on the LoRA layer's base (adapters whole)"
            )
            continue
        source = f"{entry.source}, moved to the LoRA layer's base and adapters"
        out[f"{name}.base_layer"] = HFEntry(entry.style, source)
        for adapter in adapters:
            out[f"{name}.{'lora_B' if direction == 'col' else 'lora_A'}.{adapter}"] = HFEntry(entry.style, source)
    return out


_ACTIVATION_NAMES = frozenset(["act", "act_fn", "activation", "activation_fn", "act_func"])


def _with_learned_activations(model: nn.Module, entries: dict[str, HFEntry], who: str) -> dict[str, HFEntry]:
    """``entries`` plus ``replicated_with_grad_allreduce`` for each activation with learned parameters that sits
    between a column-parallel and a row-parallel Linear of one MLP and that the plan leaves out.

    Such an activation (Apertus' xIELU, ``alpha_p`` / ``alpha_n``) acts on the rank's share of the hidden features,
    so its parameters' gradient on each rank is a partial sum: without the all-reduce over tp it would be silently
    wrong. An activation is a module defined in ``transformers.activations`` or registered under an activation's
    name (``act_fn``, ``act``, ``activation``); its siblings must include a ``colwise`` and a ``rowwise`` Linear.
    """
    modules = dict(model.named_modules())
    added: dict[str, HFEntry] = {}
    for name, mod in modules.items():
        parent, _, leaf = name.rpartition(".")
        if not name or name in entries or not any(p.requires_grad for p in mod.parameters()):
            continue
        if type(mod).__module__ != "transformers.activations" and leaf not in _ACTIVATION_NAMES:
            continue
        siblings = {entries[n].style for n in entries if n.rpartition(".")[0] == parent}
        if {"colwise", "rowwise"} <= siblings and not any(n.startswith(f"{name}.") for n in entries):
            added[name] = HFEntry(
                "replicated_with_grad_allreduce",
                f"lightning_3d: a learned activation between {who}'s column- and row-parallel MLP Linears (its "
                "gradient summed over tp; the model's plan leaves it out)",
            )
    if not added:
        return entries
    order = {n: i for i, n in enumerate(modules)}
    return dict(sorted({**entries, **added}.items(), key=lambda kv: order[kv[0]]))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


__all__ = [
    "GPT2_ATTENTION_NOTE",
    "SUPPORTED_STYLES",
    "HFEntry",
    "HFPlan",
    "check_divisible",
    "declared_tp_plan",
    "find_hf_models",
    "generic_name",
    "hf_tp_plan",
    "make_hf_style",
]
