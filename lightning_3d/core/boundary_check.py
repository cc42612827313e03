"""Checking a model's stage boundaries at setup, on fake tensors: what crosses between pipeline stages.

Under pipeline parallelism a stage boundary carries the tensor flowing from block to block (``stage_exec.py``) and
the outputs of modules that later stages read (``carry.py``): an encoder's output read by the decoder's blocks, a
position bias the first block returns for the others, an embedding's output added after the blocks. What this
module finds, before any rank communicates, by running the unsplit model's ``forward`` once on the
LightningModule's ``example_input_array`` under a ``FakeTensorMode`` (shapes and autograd graphs, no data, no
compute, no collective, the random state untouched):

* every stage unit (a block or a module with parameters outside the blocks) has each floating-point tensor of its
  output replaced by a fresh leaf tagged with the unit, the tensor's place in the output and the unit's stage, and
  the first argument of each stage's first block by a leaf of that stage (what the stage receives);
* each unit's output, and the forward's result (the last stage's), may depend on leaves of its own stage and on
  earlier stages' module outputs: those are the values to carry (:class:`Checked`'s ``carry``), each up to the
  last stage that reads it;
* refused, each named: a value computed between two blocks on either side of a boundary (a stage's first block
  must get exactly the previous block's output: anything computed in between would be lost), a later stage's
  module used by an earlier stage, and a module with parameters called by a stage that does not hold it.

A module without an ``example_input_array`` is checked the same way before the first batch of each step hook: at
setup :func:`make_skeleton` keeps a structure-only copy of the unsplit model (parameters and buffers on the meta
device, no real memory), and :func:`check_first_step` runs that copy's ``training_step`` (or the evaluation step
whose batch comes first, as sanity validation's does) on fake tensors shaped like the first micro-batch, on every
rank before any pipeline communication of the step, so every rank finds the same values to carry and raises the
same error. When the code cannot run on fake tensors (data-dependent Python control flow, ``.item()``, a custom
kernel), nothing but the flowing tensor crosses a boundary, and the first training step's real forward checks that
(``StageExecutor._check_no_skip``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch.func import functional_call

from . import hf_outputs, torch_compat
from .blocks import BLOCKS_CONTRACT, ModelSplit, layer_drop
from .carry import Carried, CarryPlan, map_floating
from .checkpointing import inside_reentrant_checkpoint, reentrant_checkpoint_message
from .step import extract_loss

FOUND_AT_SETUP = "(found at setup by running forward(example_input_array) on fake tensors)"
FOUND_AT_FIRST_STEP = (
    "(found before the first training step, on every rank, by running training_step on the first micro-batch's "
    "shapes on fake tensors)"
)


@dataclass(frozen=True)
class _Tag:
    name: str
    stage: int
    order: int  # model order, to name the module closest to a boundary (-1: a stage's received activation)
    index: int = 0  # which floating-point tensor of the module's output (``carry.map_floating``'s numbering)


@dataclass(frozen=True)
class Checked:
    """What a check of the stage boundaries found.

    Attributes:
        not_checked: ``None`` when the check ran, else why it could not (the check is then left to the first
            training step's real forward, and nothing but the flowing tensor crosses a boundary).
        carry: the module outputs a later stage reads, which the boundaries carry besides the flowing tensor.
    """

    not_checked: str | None = None
    carry: CarryPlan = field(default_factory=CarryPlan)


@dataclass
class _Trace:
    split: ModelSplit
    blocks: list[str]  # block names in container order
    tags: dict[int, _Tag] = field(default_factory=dict)  # id(leaf) -> tag
    leaves: list[torch.Tensor] = field(default_factory=list)  # keeps tagged leaves alive (ids stay unique)
    next_block: int = 0
    prev_output: torch.Tensor | None = None  # None: the previous block's output had no tensor to tag (a mapping)
    found: str = FOUND_AT_SETUP  # how the check ran, ending every message
    carried: list[Carried] = field(default_factory=list)  # module outputs later stages read
    training: bool = False  # the step checked is a training step (its stage boundaries carry gradients)

    def stage_now(self) -> int:
        """The stage whose segment of the forward is running: the stage of the next block to be called."""
        if self.next_block < len(self.blocks):
            return self.split.stage_of(self.blocks[self.next_block])
        return self.split.num_stages - 1

    def first_block_of(self, stage: int) -> str:
        assert self.split.container is not None
        return self.split.container.block_fqn(self.split.stage_blocks[stage][0])

    def leaf(self, value: torch.Tensor, tag: _Tag) -> torch.Tensor:
        leaf = value.detach().requires_grad_(True)
        self.tags[id(leaf)] = tag
        self.leaves.append(leaf)
        return leaf

    def foreign(self, value: Any, stage: int) -> list[_Tag]:
        """Tagged leaves of stages other than ``stage`` that the floating-point tensors in ``value`` depend on."""
        found: dict[int, _Tag] = {}
        seen: set[Any] = set()
        todo = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
        todo += [t for t in _tensors(value) if id(t) in self.tags]  # a tagged leaf returned as it is
        while todo:
            node = todo.pop()
            if isinstance(node, torch.Tensor):
                tag = self.tags[id(node)]
                if tag.stage != stage:
                    found[id(node)] = tag
                continue
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in self.tags:
                tag = self.tags[id(variable)]
                if tag.stage != stage:
                    found[id(variable)] = tag
            todo.extend(next_node for next_node, _ in node.next_functions)
        return sorted(found.values(), key=lambda t: t.order)

    def refuse_foreign(self, value: Any, stage: int, user: str, carry: bool = True) -> None:
        """Record the earlier stages' module outputs ``value`` (computed on ``stage``) depends on: the boundaries
        carry them (``carry.py``). Refuse what cannot be carried: a later stage's output, an earlier stage's
        received activation, and (``carry=False``) anything of another stage."""
        foreign = self.foreign(value, stage)
        if not foreign:
            return
        carried = [t for t in foreign if carry and t.stage < stage and t.order >= 0]
        self.carried += [Carried(t.stage, t.order, t.name, t.index, stage) for t in carried]
        foreign = [t for t in foreign if t not in carried]
        if not foreign:
            return
        first = self.first_block_of(stage)
        earlier = [t for t in foreign if t.stage < stage]
        if earlier:
            source = earlier[-1]  # the closest to the boundary
            raise ValueError(
                f"lightning_3d: pipeline stage {stage} (from {first}) uses {source.name}, which another stage "
                f"holds: a skip connection crosses the stage boundary between {source.name} and {first} (in {user}). "
                "A stage boundary carries the tensor flowing from block to block and the outputs of modules that "
                "later stages read (an encoder's output, a position bias the first layer returns for the others), "
                "not a value computed between two blocks; residuals must be added inside the blocks. Choose stage "
                f"boundaries that no such value crosses. {self.found} {BLOCKS_CONTRACT}"
            )
        source = foreign[0]
        raise ValueError(
            f"lightning_3d: pipeline stage {stage} (from {first}) uses the output of {source.name} (in {user}), but "
            f"the later stage {source.stage} holds {source.name}. Put it on stage {stage} with "
            f"ThreeDStrategy(stages=...). {self.found}"
        )

    def plan(self) -> CarryPlan:
        return CarryPlan.merged(CarryPlan(tuple(self.carried)))


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, a tuple / list, a mapping or a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _tag_outputs(value: Any, make: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[Any, torch.Tensor | None]:
    """``value`` with its ``i``-th floating-point tensor replaced by ``make(i, tensor)`` (``carry.map_floating``:
    tuples, lists, mappings and ``ModelOutput`` objects rebuilt or copied, never changed), and the replacement of its
    first tensor (the tensor itself, or a tuple / list's first element; ``None`` for a mapping), which flows to the
    next block.

    Every output is tagged, not only the first: a block that also returns a value the next blocks use (T5's position
    bias, made by the first block) or a module before the blocks that returns an object (an encoder's output, used by
    the decoder's blocks) is carried to the later stages that read it."""
    new = map_floating(value, make)
    if isinstance(value, torch.Tensor):
        return new, new if value.is_floating_point() else None
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return new, new[0] if value[0].is_floating_point() else None
    return new, None


def _path_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | int, torch.Tensor] | None:
    # the same rule as StageExecutor._receive: the first positional tensor, else a conventional keyword
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    for key in ("hidden_states", "x", "hidden", "input", "inputs"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return key, kwargs[key]
    return None


def check_stage_boundaries(module: nn.Module, split: ModelSplit, example_input: Any) -> Checked:
    """Run ``module``'s forward on fake tensors with ``example_input``: find what crosses a stage boundary (carried
    or refused).

    Args:
        module: the LightningModule, unsplit (its parameters real or on the meta device; they are not touched).
        split: the stage assignment to check (with a block container and more than one stage).
        example_input: Lightning's ``example_input_array``: a tensor, a tuple of positional arguments or a dict
            of keyword arguments.

    Returns:
        What the check found (:class:`Checked`): the values to carry, or why it could not run (the check is then
        left to the first training step).

    Raises:
        ValueError: a value computed between blocks crosses a stage boundary, or a module is used on a stage that
            does not hold it (each message names the modules).
    """

    def forward(model: nn.Module, inputs: Any) -> Any:
        if isinstance(inputs, tuple):
            output = model(*inputs)
        elif isinstance(inputs, dict):
            output = model(**inputs)
        else:
            output = model(inputs)
        # the first tensor of the result, as training_step would use it (a loss, logits; not extra outputs)
        return _tensors(output)[:1]

    return trace_stage_boundaries(
        module, split, forward, example_input, what="forward(example_input_array)", found=FOUND_AT_SETUP
    )


def trace_stage_boundaries(
    module: nn.Module,
    split: ModelSplit,
    call: Callable[[nn.Module, Any], Any],
    inputs: Any,
    *,
    what: str,
    found: str,
    device: torch.device | None = None,
    training: bool = False,
) -> Checked:
    """Run ``call(module, inputs)`` on fake tensors with the stage hooks in place: record the module outputs later
    stages read (the plan of what the boundaries carry) and refuse what cannot cross a boundary.

    ``module``'s parameters and buffers are swapped for fakes of the same shapes for the call (the module itself is
    not changed), and every tensor in ``inputs`` for a fake of the same shape.

    Args:
        module: the unsplit module (parameters real or on the meta device).
        split: the stage assignment to check.
        call: runs the model (a forward, a ``training_step``) and returns what the last stage's result depends on
            (a tensor or tensors; checked against the last stage).
        inputs: the real (or meta) inputs to fake: a tensor, or a collection of tensors.
        what: names the call in the reason returned when it cannot run.
        found: how the check ran, ending each message.
        device: the device of the fakes (default: the module's first real parameter's, else the CPU).
        training: ``call`` is a training step: a block at a stage boundary called inside a reentrant checkpoint is
            refused (its boundary would get no gradient).

    Returns:
        What the check found (:class:`Checked`).

    Raises:
        ValueError: what cannot cross a stage boundary (each message names the modules).
    """
    container = split.container
    if container is None or split.num_stages < 2:
        return Checked()
    trace = _Trace(split, [container.block_fqn(b) for b in container.names], found=found, training=training)
    order = {name: i for i, name in enumerate([*split.first, *trace.blocks, *split.last])}
    wrapper = _Call(module, call)
    try:
        # an evaluation step's check runs inside Lightning's inference mode, where no autograd graph is recorded;
        # every block runs (LayerDrop off), so the check sees what any draw of skipped blocks could need
        with (
            torch.inference_mode(False),
            torch_compat.fake_tensor_mode(),
            _fork_rng(),
            torch.enable_grad(),
            _every_block_runs(module),
            _experts_on_fake_tensors(module),
            hf_outputs.recording(module),  # the recorders inside the blocks seen, and off the model after
        ):
            device = device if device is not None else _device(module)
            state = {}
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                fake = fake_like(tensor, device)
                state[f"inner.{name}"] = fake.requires_grad_(tensor.requires_grad)
            fake_inputs = fake_like(inputs, device)
            with _hooks(module, split, trace, order):
                result = functional_call(wrapper, state, (fake_inputs,))
            if trace.next_block != len(trace.blocks):
                return Checked(f"{what} ran {trace.next_block} of the {len(trace.blocks)} blocks")
            trace.refuse_foreign(result, split.num_stages - 1, f"the {what}'s result")
    except ValueError as err:
        if str(err).startswith("lightning_3d:"):
            raise
        return Checked(f"{type(err).__name__}: {err}")
    except Exception as err:  # the code cannot run on fake tensors: leave the check to the first step's real forward
        return Checked(f"{type(err).__name__}: {err}")
    return Checked(None, trace.plan())


@contextlib.contextmanager
def _every_block_runs(module: nn.Module) -> Iterator[None]:
    """LayerDrop off in ``module`` for the check (its ``torch.rand([]) < layerdrop`` cannot run on fake tensors):
    the modules' own ``layerdrop`` and a Hugging Face config's (speech encoders read ``self.config.layerdrop``)."""
    holders: list[Any] = [module.get_submodule(name) for name, _ in layer_drop(module)]
    for sub in module.modules():
        config = getattr(sub, "config", None)
        rate = getattr(config, "layerdrop", None)
        if isinstance(rate, float) and rate > 0 and all(config is not h for h in holders):
            holders.append(config)
    rates = [h.layerdrop for h in holders]
    try:
        for holder in holders:
            holder.layerdrop = 0.0
        yield
    finally:
        for holder, rate in zip(holders, rates, strict=True):
            holder.layerdrop = rate


_GROUPED = "grouped_mm"


@contextlib.contextmanager
def _experts_on_fake_tensors(module: nn.Module) -> Iterator[None]:
    """Hugging Face's mixture-of-experts layers run their experts with ``grouped_mm`` by default, whose shape rule
    in torch takes bfloat16 only (the CPU kernel takes float32 too); for the check, configs that chose it use
    ``batched_mm``, the same computation with the same inputs and outputs, which runs on fake tensors (``eager``
    does not: it loops over the experts a data-dependent ``nonzero`` found)."""
    configs = {id(c): c for sub in module.modules() if (c := getattr(sub, "config", None)) is not None}
    chosen = [c for c in configs.values() if getattr(c, "_experts_implementation_internal", None) == _GROUPED]
    try:
        for config in chosen:
            config._experts_implementation_internal = "batched_mm"
        yield
    finally:
        for config in chosen:
            config._experts_implementation_internal = _GROUPED


class _Call(nn.Module):
    """Holds the module to check as a submodule so ``functional_call`` swaps its parameters for any call."""

    def __init__(self, inner: nn.Module, call: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.inner = inner
        self.__dict__["_call"] = call

    def forward(self, inputs: Any) -> Any:
        return self._call(self.inner, inputs)


def make_skeleton(module: nn.Module) -> nn.Module | str:
    """A structure-only copy of ``module`` for :func:`check_first_step`: its parameters and buffers on the meta
    device (no real memory), other tensor attributes and non-module objects (the trainer, configs) shared, not
    copied; ``log`` and ``log_dict`` only keep the tensors logged (the check counts them with the step's result).

    Args:
        module: the unsplit LightningModule (before its modules are pruned to this rank's stages).

    Returns:
        The copy, or why none could be made (the check is then left to the first step's real forward).
    """
    skeleton = meta_copy(module)
    if isinstance(skeleton, str):
        return skeleton
    if "_trainer" in vars(module):  # LightningModule.__getstate__ drops the trainer reference; keep it
        skeleton.__dict__["_trainer"] = module.__dict__["_trainer"]
    logged = _Logged()
    skeleton.__dict__["log"] = logged.log
    skeleton.__dict__["log_dict"] = logged.log_dict
    return skeleton


def meta_copy(module: nn.Module) -> nn.Module | str:
    """A copy of ``module`` with its parameters and buffers on the meta device (no real memory); other tensor
    attributes and non-module objects (the trainer, configs) shared, not copied; or why none could be made."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, (list, tuple, dict, set)):
                _share_tensors_in(value, memo)  # a list of outputs kept by the user: not copied
                continue
            if id(value) in memo or isinstance(value, (nn.Module, str, bytes, int, float)):
                continue
            if value is None or isinstance(value, bool):
                continue
            memo[id(value)] = value  # a tensor attribute, a trainer, a config: shared with the real module
    try:
        skeleton = copy.deepcopy(module, dict(memo))  # a copy: a failed deepcopy leaves entries behind
    except Exception:  # a hook or attribute that cannot be copied: try again with the hooks shared
        try:
            skeleton = copy.deepcopy(module, {**memo, **_shared_hooks(module)})
        except Exception as err:  # an attribute that cannot be copied (a lock, a file)
            return f"the model could not be copied ({type(err).__name__}: {err})"
    return skeleton


def _share_tensors_in(value: Any, memo: dict[int, Any], depth: int = 4) -> None:
    """Memo entries that share the tensors inside (nested) lists, tuples, dicts and sets of a module attribute with
    the copy: a LightningModule's list of step outputs or of cached batches costs the copy no memory."""
    if isinstance(value, torch.Tensor):
        memo.setdefault(id(value), value)
    elif depth and isinstance(value, (list, tuple, set)):
        for item in value:
            _share_tensors_in(item, memo, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            _share_tensors_in(item, memo, depth - 1)


def _shared_hooks(module: nn.Module) -> dict[int, Any]:
    """A deepcopy memo entry for every hook registered on ``module``'s modules: the copy calls the same hooks.

    Some hooks hold what cannot be copied: Lightning's ``PyTorchProfiler`` wraps each module's forward in
    ``record_function`` hooks whose open records refuse ``deepcopy``, which left the stage-boundary check to the
    first step's real forward under the profiler. Shared, such a hook records the copy's fake forward too."""
    return {id(hook): hook for sub in module.modules() for hook in torch_compat.every_hook(sub)}


class _Logged:
    """The skeleton's ``self.log`` / ``self.log_dict``: keep the tensors logged. On the pipeline the last stage's
    logged values are the ones that count, so what they read of earlier stages' modules must be carried too, as for
    the loss (an evaluation step that only logs its loss returns nothing)."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.values.append(value)

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value)

    @classmethod
    def taken_from(cls, model: nn.Module) -> list[torch.Tensor]:
        """The tensors ``model`` (a skeleton) logged since the last call."""
        logged = getattr(model.__dict__.get("log"), "__self__", None)
        if not isinstance(logged, cls):
            return []
        values, logged.values = logged.values, []
        return values


def check_first_step(
    skeleton: nn.Module, split: ModelSplit, hook: str, micro_batch: Any, rest: tuple[Any, ...]
) -> Checked:
    """Run ``skeleton``'s ``hook`` (``training_step``, or the first evaluation step) on fake tensors shaped like
    ``micro_batch``: what crosses a stage boundary, the first-step counterpart of :func:`check_stage_boundaries`.

    Args:
        skeleton: from :func:`make_skeleton`.
        split: the stage assignment to check.
        hook: the step method to run (``"training_step"``, ``"validation_step"``, ...).
        micro_batch: the first micro-batch of the hook's first batch (real tensors; only shapes are used).
        rest: the step's other arguments (the batch index).

    Returns:
        What the check found (:class:`Checked`).

    Raises:
        ValueError: what cannot cross a stage boundary (each message names the modules).
    """

    def step(model: nn.Module, batch: Any) -> Any:
        _Logged.taken_from(model)
        result = getattr(model, hook)(batch, *rest)
        loss = extract_loss(result, hook) if isinstance(result, (torch.Tensor, Mapping)) else None
        # the loss first (what the last stage's result is), then what the step logged
        return [loss if isinstance(loss, torch.Tensor) else None, *_Logged.taken_from(model)]

    devices = [t.device for t in _collection_tensors(micro_batch)]
    return trace_stage_boundaries(
        skeleton,
        split,
        step,
        micro_batch,
        what=f"{hook}(first micro-batch)",
        found=FOUND_AT_FIRST_STEP,
        device=devices[0] if devices else torch.device("cpu"),
        training=hook == "training_step",
    )


def _collection_tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


def _device(module: nn.Module) -> torch.device:
    real = [t.device for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"]
    return real[0] if real else torch.device("cpu")


def fake_like(value: Any, device: torch.device) -> Any:
    """Inside a fake mode: ``value`` (a tensor, or any collection of tensors Lightning moves to a device: tuples,
    lists, mappings, dataclasses) with each tensor a fake of the same shape, strides and dtype on ``device``."""
    return apply_to_collection(
        value, torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    )


@contextlib.contextmanager
def _fork_rng() -> Iterator[None]:
    # fake dropout draws no numbers, but keep the real generators exactly as they were whatever the forward does
    with torch.random.fork_rng(devices=[]):
        yield


@contextlib.contextmanager
def _hooks(module: nn.Module, split: ModelSplit, trace: _Trace, order: dict[str, int]) -> Iterator[None]:
    handles = []
    block_index = {name: i for i, name in enumerate(trace.blocks)}
    try:
        for name in [*split.first, *trace.blocks, *split.last]:
            sub = module.get_submodule(name)
            stage = split.stage_of(name)
            tag = _Tag(name, stage, order[name])
            if name in block_index:
                handles.append(
                    sub.register_forward_pre_hook(_block_pre_hook(trace, block_index[name]), with_kwargs=True)
                )
            else:
                handles.append(sub.register_forward_pre_hook(_outside_pre_hook(trace, tag)))
            # ahead of Hugging Face's output recorders (``hf_outputs.py``), which then record the tagged output
            # that a later stage's read carries; after any other hook (one replacing the output gets it tagged)
            before_recorders = bool(hf_outputs.recorders(sub))
            output_hook = _output_hook(trace, tag, block_index.get(name))
            handles.append(sub.register_forward_hook(output_hook, prepend=before_recorders))
            # modules inside it that Hugging Face records from (attention weights, router logits): their outputs are
            # tagged too, ahead of the recorders, so a later stage's read of what was recorded is carried
            for rel in dict.fromkeys(rel for rel, _, _, _ in hf_outputs.inner_recorders(sub)):
                inner = sub.get_submodule(rel)
                specs = [hf_outputs.recorder_spec(hook) for hook in hf_outputs.recorders(inner)]
                keyed = {spec[0]: spec[1] for spec in specs if spec is not None and spec[0] != "hidden_states"}
                inner_tag = _Tag(f"{name}.{rel}", stage, order[name])
                handles.append(inner.register_forward_hook(_inner_output_hook(trace, inner_tag, keyed), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _block_pre_hook(trace: _Trace, index: int) -> Any:
    name = trace.blocks[index]
    stage = trace.split.stage_of(name)
    starts_stage = index > 0 and trace.split.stage_of(trace.blocks[index - 1]) != stage
    ends_stage = index < len(trace.blocks) - 1 and trace.split.stage_of(trace.blocks[index + 1]) != stage

    def hook(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index != trace.next_block:
            due = trace.next_block
            when = f"when {trace.blocks[due]} was due" if due < len(trace.blocks) else "again after the last block"
            raise ValueError(
                f"lightning_3d: the forward called {name} {when}: pipeline stages need every block of the container "
                f"called once, in order. {trace.found} {BLOCKS_CONTRACT}"
            )
        if trace.training and (starts_stage or ends_stage) and inside_reentrant_checkpoint():
            where = "first" if starts_stage else "last"
            raise ValueError(f"{reentrant_checkpoint_message(name, stage, where)} {trace.found}")
        if not starts_stage:
            return None
        found = _path_argument(args, kwargs)
        if found is None:
            raise ValueError(
                f"lightning_3d: {name}, the first block of pipeline stage {stage}, was called without a tensor as its "
                f"first argument; the tensor flowing from block to block must be the first argument. {trace.found} "
                f"{BLOCKS_CONTRACT}"
            )
        key, value = found
        if trace.prev_output is not None and value is not trace.prev_output:
            trace.refuse_foreign(value, stage, f"the input of {name}", carry=False)
            previous = trace.blocks[index - 1]
            raise ValueError(
                f"lightning_3d: the input of {name} (the first block of pipeline stage {stage}) is not the output of "
                f"{previous}: what the forward computes between them would be lost at the stage boundary. Only a "
                f"block's output crosses stages; choose another boundary or move that computation into a block. "
                f"{trace.found} {BLOCKS_CONTRACT}"
            )
        received = trace.leaf(value, _Tag(f"{name} (its input)", stage, -1))
        if isinstance(key, int):
            return (received, *args[1:]), kwargs
        return args, {**kwargs, key: received}

    return hook


def _outside_pre_hook(trace: _Trace, tag: _Tag) -> Any:
    def hook(sub: nn.Module, args: tuple[Any, ...]) -> None:
        running = trace.stage_now()
        if running != tag.stage:
            where = (
                "before the blocks"
                if trace.next_block == 0
                else "after the blocks"
                if trace.next_block == len(trace.blocks)
                else f"before {trace.blocks[trace.next_block]}"
            )
            raise ValueError(
                f"lightning_3d: the forward calls {tag.name} {where}, which is pipeline stage {running}'s part of the "
                f"forward, but stage {tag.stage} holds it. Put {tag.name} on stage {running} in "
                f"ThreeDStrategy(stages=...) (modules before the blocks go with the first stage and modules after "
                f"them with the last by default). {trace.found}"
            )

    return hook


def _inner_output_hook(trace: _Trace, tag: _Tag, keyed: dict[str, int]) -> Any:
    """Tag the output of a module inside a stage unit while Hugging Face records from it (``keyed``: its recorders'
    keys and the place in its output each records), when what each records (``output[place]``, or the output
    itself) is its ``place``-th floating-point tensor: the numbering a stand-in replays the recorders with
    (``hf_outputs``). Otherwise nothing is tagged, and a stage without the module refuses the recording when asked.
    What the output read of other stages is recorded first (the tags then cut that path, as a unit's do)."""

    def hook(sub: nn.Module, args: Any, output: Any) -> Any:
        asked = hf_outputs.recorded_inside()
        places = [place for key, place in keyed.items() if key in asked]
        if not places:
            return None
        trace.refuse_foreign(output, tag.stage, tag.name)
        if isinstance(output, torch.Tensor):
            numbered = output.is_floating_point() and all(place == 0 for place in places)
        else:
            head = list(output[: max(places, default=0) + 1]) if isinstance(output, (tuple, list)) else []
            numbered = len(head) > max(places, default=0) and all(
                isinstance(t, torch.Tensor) and t.is_floating_point() for t in head
            )
        if not numbered:
            return None
        new, _ = _tag_outputs(output, lambda i, t: trace.leaf(t, replace(tag, index=i)))
        return new

    return hook


def _output_hook(trace: _Trace, tag: _Tag, index: int | None) -> Any:
    def hook(sub: nn.Module, args: Any, output: Any) -> Any:
        trace.refuse_foreign(output, tag.stage, tag.name)
        new, leaf = _tag_outputs(output, lambda i, t: trace.leaf(t, replace(tag, index=i)))
        if index is not None:
            trace.next_block = index + 1
            trace.prev_output = leaf
        return new

    return hook
