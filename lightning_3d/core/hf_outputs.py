"""Hugging Face's recorded outputs (``output_hidden_states``, ``output_attentions``, router logits) under pipeline
parallelism.

Transformers 5 records these with forward hooks on the modules of given classes (a model's ``_can_record_outputs``:
BERT's hidden states from each ``BertLayer``, its attentions from each ``BertSelfAttention``), installed the first
time a forward asks for them (``transformers.utils.output_capturing``). A pipeline stage runs the model's forward
with stand-ins for the blocks other stages hold (``stand_ins.py``), which are not of those classes: their hidden
states would be left out of ``outputs.hidden_states``, and a step reading ``hidden_states[i]`` (a mean over the
last layers, a layer-wise loss) on the last stage would read another layer's, or fewer of them, without a word.

So, before the stand-ins are made, :func:`install_recorders` installs Hugging Face's recorders on the whole model,
and :func:`copy_recorders` gives each stand-in the recorders of the module it stands for: it records what it
returns, which is the value carried from the stage that ran the block when the step reads it (``carry.py``: the
stage-boundary check runs the step on the unsplit model, whose recorders show the read), else zeros that the first
step's check refuses if the step reads them. Recorders inside a block (attention weights, a mixture-of-experts
router's logits for its load-balancing loss) cannot run on a stage that does not hold the block: the check tags
those modules' outputs too (``boundary_check``), so a step whose result reads them (Mixtral's load-balancing loss
over every layer's router logits) has them carried from the stage that ran the block, and the stand-in replays the
inner recorders with the received values, in the block's place in the model's order. A forward that asks for an
output recorded inside a block whose values did not reach the stage (the step does not read them, or the check
could not run) is refused, naming what was asked.

Earlier transformers versions collect hidden states in the model's own loop over the blocks (the stand-ins'
outputs are collected as the blocks' would be): nothing to do there.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from . import torch_compat

_CAPTURING = "transformers.utils.output_capturing"
_found: list[ModuleType] = []  # the module once found (a stand-in asks on every call)


def _capturing() -> ModuleType | None:
    """Hugging Face's output-capturing module, when transformers is in use and has one (5.x); never imports
    transformers for a model that is not one of its own."""
    if _found:
        return _found[0]
    if "transformers" not in sys.modules:
        return None
    try:
        import transformers.utils.output_capturing as capturing
    except ImportError:
        return None
    if not all(hasattr(capturing, name) for name in ("maybe_install_capturing_hooks", "_active_collector")):
        return None
    _found.append(capturing)
    return capturing


_INSTALLED = "_output_capturing_hooks_installed"  # Hugging Face's mark on a model whose recorders are installed


def _recordable(model: nn.Module) -> list[nn.Module]:
    """The Hugging Face models inside ``model`` (itself included) that record outputs with hooks."""
    if _capturing() is None:
        return []
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and getattr(m, "_can_record_outputs", None)]


def install_recorders(model: nn.Module) -> None:
    """Install Hugging Face's output recorders on every Hugging Face model inside ``model`` now, as its forward does
    the first time one asks for an output (idempotent)."""
    capturing = _capturing()
    for sub in _recordable(model):
        capturing.maybe_install_capturing_hooks(sub)  # type: ignore[union-attr]


class Recorders:
    """Hugging Face's recorders of a model, taken off it: what each module would record with, kept to be put on
    when a forward first asks for an output (:meth:`install`), and for stand-ins to copy (:meth:`of`).

    Installed, a recorder reads a context variable on every call, which ``torch.compile`` cannot trace: a compiled
    block with one gets graph breaks (``fullgraph=True`` fails) even when nothing is recorded. Hugging Face installs
    them the first time a forward asks; so does this, but from the copy taken while every module of the model was
    in place (a stage's stand-ins swapped in later would hide the modules of another stage on the same rank).
    """

    def __init__(self, hooks: dict[int, tuple[nn.Module, list[Callable[..., Any]]]], roots: list[nn.Module]) -> None:
        self._hooks = hooks  # id(module) -> (module, its recorders in order)
        self._roots = roots  # the models marked as installed by Hugging Face while they were taken
        self.installed = False

    @classmethod
    def taken(cls, model: nn.Module) -> Recorders:
        """Install the recorders of every Hugging Face model inside ``model`` and take the new ones off again
        (recorders installed before stay), leaving ``model`` as it was."""
        roots = [sub for sub in _recordable(model) if not getattr(sub, _INSTALLED, False)]
        before = {id(m): set(map(id, recorders(m))) for m in model.modules()}
        install_recorders(model)
        hooks: dict[int, tuple[nn.Module, list[Callable[..., Any]]]] = {}
        for module in model.modules():
            new = [hook for hook in recorders(module) if id(hook) not in before.get(id(module), set())]
            if new:
                hooks[id(module)] = (module, new)
                torch_compat.remove_forward_hooks(module, new)
        for root in roots:
            setattr(root, _INSTALLED, False)
        return cls(hooks, roots)

    def of(self, module: nn.Module) -> list[Callable[..., Any]]:
        """``module``'s recorders: those on it already (a forward asked before they were taken), then those taken."""
        taken = self._hooks.get(id(module), (module, []))[1]
        return [*(hook for hook in recorders(module) if hook not in taken), *taken]

    def modules(self) -> list[nn.Module]:
        """The modules recorders were taken off (wherever they are in the model now)."""
        return [module for module, _ in self._hooks.values()]

    def forget(self, module: nn.Module) -> None:
        """Drop what was taken off ``module`` and its submodules (a module another stage holds: not kept alive)."""
        for sub in module.modules():
            self._hooks.pop(id(sub), None)

    def install(self) -> None:
        """Put the recorders back on their modules (once) and mark their models installed for Hugging Face."""
        if self.installed:
            return
        self.installed = True
        for module, hooks in self._hooks.values():
            for hook in hooks:
                module.register_forward_hook(hook)
        for root in self._roots:
            setattr(root, _INSTALLED, True)

    def remove(self) -> None:
        """Take the recorders off again and unmark the models (the state :meth:`taken` left)."""
        if not self.installed:
            return
        self.installed = False
        for module, hooks in self._hooks.values():
            torch_compat.remove_forward_hooks(module, hooks)
        for root in self._roots:
            setattr(root, _INSTALLED, False)


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[Recorders]:
    """``model`` with Hugging Face's recorders installed for the duration, and as it was after (a check that runs
    the model on fake tensors must see the recorders, and must not leave them on a model that will be compiled)."""
    taken = Recorders.taken(model)
    taken.install()
    try:
        yield taken
    finally:
        taken.remove()


def on_request(model: nn.Module, then: Callable[[nn.Module], None]) -> None:
    """Call ``then(hf_model)`` before the first forward of each Hugging Face model inside ``model`` that asks for a
    recorded output (``output_hidden_states``, ``output_attentions``, ``output_router_logits``... in the call or in
    its config), before Hugging Face would install its recorders there."""
    for sub in _recordable(model):
        keys = [*dict(getattr(sub, "_can_record_outputs", {}) or {}), "attentions"]
        sub.register_forward_pre_hook(_asking(keys, then), with_kwargs=True)


def _asking(keys: list[str], then: Callable[[nn.Module], None]) -> Callable[..., None]:
    done: list[bool] = []

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if done:
            return
        config = getattr(module, "config", None)
        if any(kwargs.get(f"output_{key}", getattr(config, f"output_{key}", False)) for key in keys):
            done.append(True)
            then(module)

    return hook


def recorders(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks of ``module`` itself that are Hugging Face output recorders."""
    return [hook for hook in torch_compat.forward_hooks(module) if getattr(hook, "__module__", None) == _CAPTURING]


def recorder_spec(hook: Callable[..., Any]) -> tuple[str, int] | None:
    """What a Hugging Face recorder records: its output key (``"router_logits"``) and the place in its module's
    output tuple it records from; ``None`` when the hook does not say (another transformers version)."""
    try:
        found = inspect.getclosurevars(hook).nonlocals
    except (TypeError, ValueError):
        return None
    key, index = found.get("key"), found.get("index")
    return (key, index) if isinstance(key, str) and isinstance(index, int) else None


def inner_recorders(
    module: nn.Module, of: Callable[[nn.Module], list[Callable[..., Any]]] = recorders
) -> list[tuple[str, Callable[..., Any], str, int]]:
    """The recorders of the modules inside ``module`` (not its own; ``of(sub)``: installed ones by default) that
    record something other than hidden states (attention weights, a router's logits), in module order: ``(name
    relative to module, hook, key, index)``; ``index`` is ``-1`` for a recorder whose spec cannot be read."""
    found = []
    for name, sub in module.named_modules():
        if sub is module:
            continue
        for hook in of(sub):
            key, index = recorder_spec(hook) or ("?", -1)
            if key != "hidden_states":
                found.append((name, hook, key, index))
    return found


def copy_recorders(
    real: nn.Module,
    stand_in: nn.Module,
    name: str,
    where: str,
    carried: Callable[[str], dict[int, torch.Tensor]],
    taken: Recorders,
) -> None:
    """Give ``stand_in`` the recorders of ``real`` (the module ``name`` it stands for; ``taken``: the model's, see
    :class:`Recorders`), and replay those of the modules inside ``real`` from what this stage received of their
    outputs (``carried(fqn)``: index -> value, the values the stage-boundary check found the step reads); a forward
    that asks for an output recorded inside ``real`` that was not received is refused (``where`` names the module
    and its stage). A stand-in is never compiled: its recorders are on from the start."""
    for hook in taken.of(real):
        stand_in.register_forward_hook(hook)
    inner = inner_recorders(real, taken.of)
    if inner:
        stand_in.register_forward_hook(_replay_inner(name, inner, where, carried))


def _replay_inner(
    name: str,
    inner: list[tuple[str, Callable[..., Any], str, int]],
    where: str,
    carried: Callable[[str], dict[int, torch.Tensor]],
) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        asked = recorded_inside()
        if not asked:
            return
        for rel, recorder, key, index in inner:
            if key not in asked and index >= 0:
                continue
            # the index-th tensor of the inner module's output tuple: the carried value with that index (the
            # check verified the tuple's tensors up to it are floating-point: ``boundary_check``)
            value = carried(f"{name}.{rel}").get(index) if index >= 0 else None
            if value is None:
                raise ValueError(_refusal(asked, where))
            recorder(module, args, value)

    return hook


def _refusal(asked: list[str], where: str) -> str:
    names = ", ".join(asked)
    return (
        f"lightning_3d: the model's forward asks Hugging Face to record {names} (output_{asked[0]}=True, in the call "
        "or the model's config), which the model records inside its blocks; under pipeline parallelism a stage runs "
        f"only its own blocks, so those of {where} are carried to this stage only when the step's result depends on "
        "them (the stage-boundary check sees that: a mixture of experts' load-balancing loss), and here it did not "
        "or could not run; the tuple would miss them. Leave them off while training with pp > 1, read them in the "
        "step's result, or train at pp=1 (tensor and data parallelism record them as one device does)."
    )


def gather_recorded_heads(model: nn.Module, tp_mesh: Any, taken: Recorders | None = None) -> None:
    """Under tensor parallelism an attention module computes its rank's heads only, so the attention weights Hugging
    Face records from it (``output_attentions=True``) would hold this rank's heads, not the model's: a step reading
    them (a penalty on every layer's attention) would compute another number on each tensor-parallel rank. Each
    attention module of ``model`` with a recorder gets a forward hook, ahead of the recorders, that replaces the
    recorded weights by all the heads, gathered over ``tp_mesh`` (differentiably: each rank's gradient is its heads'
    slice), while they are being recorded and hold ``heads / tp`` heads. The module's own output (the attention
    output the model goes on with) is not touched. Installed with the recorders, when a forward first asks for
    an output (:func:`on_request`): a hook would break a compiled block's graph. ``taken``: a pipeline stage's
    recorders (:class:`Recorders`), whose modules are hooked wherever they are (a stage's stand-ins may hide
    another local stage's modules from the model at that moment)."""

    hooked: set[int] = set()  # (a causal LM and its base model both ask: each module is hooked once)

    def then(hf_model: nn.Module) -> None:
        install_recorders(hf_model)  # (idempotent: a pipeline stage's were put back just before, :class:`Recorders`)
        held = taken.modules() if taken is not None else []
        for sub in held or hf_model.modules():
            if id(sub) in hooked:
                continue
            hooked.add(id(sub))
            heads = getattr(getattr(sub, "config", None), "num_attention_heads", None)
            specs = [spec for hook in recorders(sub) if (spec := recorder_spec(hook)) and "attention" in spec[0]]
            if isinstance(heads, int) and specs:
                sub.register_forward_hook(_gathering(dict(specs), heads, tp_mesh), prepend=True)

    on_request(model, then)


def _gathering(keyed: dict[str, int], heads: int, tp_mesh: Any) -> Callable[..., Any]:
    from torch.distributed.tensor import DTensor, Shard

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        asked = recorded_inside()
        places = {place for key, place in keyed.items() if key in asked}
        if not places or not isinstance(output, tuple):
            return None
        items = list(output)
        for place in places:
            value = items[place] if place < len(items) else None
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] * tp_mesh.size() == heads:
                items[place] = DTensor.from_local(value, tp_mesh, [Shard(1)], run_check=False).full_tensor()
        return type(output)(items)

    return hook


def recorded_inside() -> list[str]:
    """The outputs the running Hugging Face forward records besides hidden states (``attentions``,
    ``router_logits``...): empty when none is being recorded."""
    capturing = _capturing()
    collected = capturing._active_collector.get() if capturing is not None else None
    if not isinstance(collected, dict):
        return []
    return sorted(key for key in collected if not key.startswith("_") and key != "hidden_states")


@contextlib.contextmanager
def not_recording() -> Iterator[None]:
    """Nothing is recorded inside (a stand-in running the real module's meta copy for its output structure: the
    copy has the recorders too, and its meta tensors must not join the outputs)."""
    capturing = _capturing()
    if capturing is None:
        yield
        return
    token = capturing._active_collector.set(None)
    try:
        yield
    finally:
        capturing._active_collector.reset(token)
