"""What a pipeline stage finds in place of the modules other stages hold.

Every stage runs the model's own forward (``stage_exec.py``), so the forward meets every module of the model, also
those another stage holds. Those are replaced on each rank by stand-ins that let the forward go on:

* :class:`Skipped`, a block another stage holds. Only the blocks before a stage's first block are ever called (the
  stage stops at its last block); the one just before returns the received activation as the tensor flowing on
  (what that block's output is), and the stage's first block also gets it from a pre-hook (a model that skips
  blocks may not call that one). A forward that calls the first block through ``torch.utils.checkpoint`` thus
  hands the checkpoint the received tensor, which its recomputation in the backward runs the block on again.
  A stand-in returns what the real block would, in structure: a block returning ``(hidden, attn_weights)`` or
  ``(hidden, position_bias, cross_bias)`` is unpacked by the model's loop, so the stand-in returns a tuple of the
  same shape, its first entry the tensor flowing through, other tensors zeros of their real shapes (marked, so the
  first step's check refuses them if the stage uses them: their real values live on another stage) and other
  entries as the block returns them (``None`` for attention weights not asked for). The structure comes from the
  real block's copy on the meta device, run once per input signature (shapes, dtypes, flags), then cached. Where
  the stage received the real value of one of those tensors (``carry.py``: a position bias the block made on an
  earlier stage), the stand-in returns that value in its place; the same for :class:`Elsewhere` (an encoder's
  output).
* :class:`Elsewhere`, a module outside the blocks another stage holds: before the blocks (embeddings) it returns
  zeros shaped like the stage's input, which the stage's first block then replaces; after them (final norm, head) it
  raises if ever reached.

Both answer attribute reads as the real module would, from its meta copy: plain attributes (``attention_type``,
``layer_idx``, a config) as they are, a submodule as another stand-in, and a parameter or buffer as
:class:`Absent`, a tensor whose shape, dtype and device can be read (``self.embeddings.patch_embeddings.projection
.weight.dtype``, which Hugging Face's ViT reads to cast its pixels on every stage) but whose values cannot: any
computation with it raises, naming the module and the stage that holds it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn

from . import hf_outputs
from .blocks import BLOCKS_CONTRACT
from .carry import map_floating


class _Executor(Protocol):
    """What a stand-in asks of the stage executor (``stage_exec.StageExecutor``)."""

    current: Any  # the stage running now (``stage_exec._Running``) or None
    split: Any  # the model's split (``blocks.ModelSplit``)
    device: torch.device | None

    def stand_in_output(self, value: Any, fqn: str) -> Any: ...

    def carried_output(self, fqn: str) -> dict[int, torch.Tensor]: ...

    def reached(self, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...

    def flowing_past(self, fqn: str) -> torch.Tensor | None: ...

    def remember(self, fqn: str, value: torch.Tensor, output: Any) -> None: ...

    def replayed(self, fqn: str, value: torch.Tensor) -> Any: ...


def outside_steps_message(fqn: str, holder: int) -> str:
    """Why a module of another stage was reached with no stage running: the model was called outside the steps."""
    return (
        f"lightning_3d: the model was called outside the training, validation, test and predict steps (in a hook such "
        f"as on_validation_epoch_end, in a callback, or after fit), and reached {fqn}, which pipeline stage {holder} "
        "holds. Under pipeline parallelism each rank holds only its stages' modules, and the model runs through the "
        "pipeline only inside the steps, once per step. What needs the whole model on one rank, such as "
        "generate() for sample text during training, works at pp=1 (tensor and data parallelism); with pp > 1, "
        "generate after training from the saved weights: trainer.strategy.save_hf(path) on every rank, or "
        "YourModule.load_from_checkpoint(checkpoint_folder) on one device. (Inside a training step's backward this "
        "is a torch.utils.checkpoint call around modules of several stages, the whole forward for one, recomputed: "
        "checkpoint the blocks one by one, or set ThreeDStrategy(activation_checkpointing='full').)"
    )


def _read_message(name: str, holder: int, stage: int, what: str) -> str:
    return (
        f"lightning_3d: {name} {what} on pipeline stage {stage}, but it is held by stage {holder}: a stage holds only "
        "its own modules, and of another stage's tensors only the shape, dtype and device can be read. Call the "
        "module instead of reading its parameters (a head that reuses the embedding's weight: tie them as modules, "
        "self.head.weight = self.embed.weight, and they stay one weight across the stages), or keep the value in a "
        "buffer of the LightningModule, which every stage holds."
    )


# ---------------------------------------------------------------------------------------------- absent tensors
_GETTERS = {
    torch.Tensor.dtype.__get__,
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_sparse.__get__,
    torch.Tensor.itemsize.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
}
_DEVICE = torch.Tensor.device.__get__
_ON_DEVICE = {torch.Tensor.is_cuda.__get__: "cuda", torch.Tensor.is_cpu.__get__: "cpu"}


class Absent(torch.Tensor):
    """A tensor another pipeline stage holds, as a stage that does not hold it sees it: its shape, dtype,
    ``requires_grad`` and device (the stage's own) can be read; any computation with it raises, naming it.

    Made by :func:`absent`; its data lives on the meta device (no memory)."""

    _name: str
    _holder: int
    _stage: int
    _device: torch.device

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self = args[0] if args else None
        if isinstance(self, Absent):
            if func in _GETTERS:
                return torch.Tensor.__torch_function__(func, (torch.Tensor,), args, kwargs)
            if func == _DEVICE:
                return self._device
            if func in _ON_DEVICE:
                return self._device.type == _ON_DEVICE[func]
            if func == torch.Tensor.__repr__:
                return f"Absent({self._name}: held by pipeline stage {self._holder}, shape {tuple(self.shape)})"
        absent = next((a for a in _flat(args, kwargs) if isinstance(a, Absent)), self)
        if not isinstance(absent, Absent):  # held where the arguments' structure hides it
            raise RuntimeError("lightning_3d: a tensor another pipeline stage holds was used in a computation.")
        raise RuntimeError(_read_message(absent._name, absent._holder, absent._stage, "was used in a computation"))


def _flat(args: Any, kwargs: Any) -> list[Any]:
    found: list[Any] = []
    apply_to_collection((args, kwargs or {}), torch.Tensor, found.append)
    return found


def absent(like: torch.Tensor, name: str, holder: int, stage: int, device: torch.device | None) -> Absent:
    """An :class:`Absent` shaped like ``like`` (a meta copy of the real tensor)."""
    tensor = torch.empty_like(like, device="meta").requires_grad_(like.requires_grad).as_subclass(Absent)
    tensor._name, tensor._holder, tensor._stage = name, holder, stage
    tensor._device = device if device is not None else torch.device("cpu")
    return tensor


# ---------------------------------------------------------------------------------------------- attribute reads
def _holder_and_stage(executor: _Executor, owner: str, fqn: str) -> tuple[int, int]:
    holder = executor.split.stage_of(owner)
    current = executor.current
    if current is None:
        raise AttributeError(outside_steps_message(fqn, holder))
    return holder, current.stage


def foreign_attribute(executor: _Executor, owner: str, fqn: str, like: nn.Module | None, name: str) -> Any:
    """``name`` read from the module ``fqn`` (``owner`` or a submodule of it, which another stage holds), answered
    from ``like``, its meta copy (see the module docstring).

    Raises:
        AttributeError: the real module has no such attribute, or it is a method (it would run on no data), or the
            model is called outside the steps (:func:`outside_steps_message`).
    """
    holder, stage = _holder_and_stage(executor, owner, fqn)
    value = getattr(like, name, _MISSING) if like is not None else _MISSING
    if value is _MISSING or inspect.ismethod(value):  # a method would run on the meta copy
        raise AttributeError(_read_message(f"{fqn}.{name}", holder, stage, "was read"))
    if isinstance(value, torch.Tensor):
        return absent(value, f"{fqn}.{name}", holder, stage, executor.device)
    if isinstance(value, nn.Module):
        return Remote(owner, f"{fqn}.{name}", value, executor)
    return value


_MISSING = object()


def foreign_item(executor: _Executor, owner: str, fqn: str, like: nn.Module | None, key: Any) -> Remote:
    """``module[key]`` of a container another stage holds (``self.embeddings[0]``), as a :class:`Remote`."""
    holder, stage = _holder_and_stage(executor, owner, fqn)
    child = like[key] if like is not None and hasattr(type(like), "__getitem__") else None
    name = next((n for n, m in like.named_children() if m is child), None) if isinstance(child, nn.Module) else None
    if name is None:
        raise TypeError(_read_message(f"{fqn}[{key!r}]", holder, stage, "was read"))
    return Remote(owner, f"{fqn}.{name}", child, executor)


class Remote:
    """A submodule of a module another stage holds, read through its stand-in (``self.embeddings.patch_embeddings``):
    attributes as :func:`foreign_attribute` answers them; calling it raises."""

    def __init__(self, owner: str, fqn: str, like: nn.Module, executor: _Executor) -> None:
        self._owner, self._fqn, self._like, self._executor = owner, fqn, like, executor

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_owner", "_fqn", "_like", "_executor"):
            raise AttributeError(name)
        return foreign_attribute(self._executor, self._owner, self._fqn, self._like, name)

    def __getitem__(self, key: Any) -> Remote:
        return foreign_item(self._executor, self._owner, self._fqn, self._like, key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        holder, stage = _holder_and_stage(self._executor, self._owner, self._fqn)
        raise RuntimeError(_read_message(self._fqn, holder, stage, "was called"))


class _StandIn(nn.Module):
    """What both stand-ins share: the name of the module stood in for, the executor and the real module's meta copy
    (not a submodule: its meta parameters are not the model's)."""

    _whole_tensor = False  # a template for an output that is one tensor too (else: ``None``, the input flows on)

    def __init__(self, fqn: str, executor: _Executor, like: nn.Module | None) -> None:
        super().__init__()
        self.fqn = fqn
        self.__dict__["_executor"] = executor
        self.__dict__["_like"] = like
        self.__dict__["_templates"] = {}

    def _template(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Template | None:
        """The real module's output structure for these arguments (cached per signature), or ``None``."""
        like = self.__dict__.get("_like")
        if like is None:
            return None
        key = (self.training, torch.is_grad_enabled(), _signature(args), _signature(kwargs))
        templates = self.__dict__["_templates"]
        if key not in templates:
            templates[key] = _run_meta(like, self.training, args, kwargs, self._whole_tensor)
        return templates[key]

    def _mark(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._executor.stand_in_output(tensor, self.fqn)

    def _with_carried(self, output: Any) -> Any:
        """``output`` with the values of the real module's output that this stage received (``carry.py``) in their
        places: what an earlier stage's module made and this stage reads (an encoder's output, a position bias)."""
        carried = self._executor.carried_output(self.fqn)
        if not carried:
            return output
        return map_floating(output, lambda index, tensor: carried.get(index, tensor))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        executor, fqn = self.__dict__.get("_executor"), self.__dict__.get("fqn")
        if executor is None or fqn is None or name.startswith("__"):  # half-made (copy, unpickling): a plain miss
            raise AttributeError(name)
        return foreign_attribute(executor, fqn, fqn, self.__dict__.get("_like"), name)

    def __getitem__(self, key: Any) -> Remote:
        return foreign_item(self._executor, self.fqn, self.fqn, self.__dict__.get("_like"), key)

    def convert_like(self, convert: Callable[[nn.Module], Any]) -> None:
        """Apply the precision plugin's module conversion to the meta copy as to the model (dtype reads agree)."""
        like = self.__dict__.get("_like")
        if like is not None:
            convert(like)


# ---------------------------------------------------------------------------------------------- block outputs
def _signature(value: Any) -> Any:
    """A hashable summary of a call's arguments: what a block's output structure can depend on."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, Mapping):
        return ("M", tuple((k, _signature(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__qualname__


def _to_meta(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: torch.empty_like(t, device="meta"))


class _Template:
    """A block's output structure: its first tensor is the one flowing to the next block."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def fill(
        self, value: torch.Tensor | None, device: torch.device, mark: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        """The structure with ``value`` as its first tensor (``None``: zeros there too) and zeros, passed through
        ``mark``, for its other tensors."""
        first = [value is not None]

        def leaf(meta: torch.Tensor) -> torch.Tensor:
            if first[0]:
                first[0] = False
                return value
            return mark(torch.zeros(meta.shape, dtype=meta.dtype, device=device))

        return apply_to_collection(self.output, torch.Tensor, leaf)


class Skipped(_StandIn):
    """A block held by another pipeline stage: returns the structure the block returns, with the tensor flowing
    through it in the first place (see the module docstring).

    Args:
        fqn: the block's name in the model.
        executor: the stage executor (what the stand-in returns is recorded there:
            :meth:`~lightning_3d.core.stage_exec.StageExecutor.stand_in_output`).
        like: the real block's meta copy, or ``None`` (then the first argument is returned as it is).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._executor.reached(self.fqn, args, kwargs)  # a later stage's block: this stage ends here
        value = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(value, torch.Tensor):
            return self._with_carried(self._mark(value))
        if self._executor.current is None:  # a backward's recomputation of a checkpoint around several blocks
            replayed = self._executor.replayed(self.fqn, value)
            if replayed is not None:
                return replayed
        # the block just before the running stage's first one: its output is what the stage received
        received = self._executor.flowing_past(self.fqn)
        flowing = received if received is not None and received.shape == value.shape else self._mark(value)
        template = self._template(args, kwargs)
        output = self._with_carried(flowing if template is None else template.fill(flowing, value.device, self._mark))
        if flowing is not value and self._executor.current is not None:  # (an output holding ``value`` is not kept)
            self._executor.remember(self.fqn, value, output)
        return output


def _run_meta(
    like: nn.Module, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any], whole_tensor: bool = False
) -> _Template | None:
    """The module's output structure from its meta copy, or ``None`` where the copy cannot run on the meta device (a
    value read back to the host) or returns one tensor and ``whole_tensor`` is false (a block: the stand-in then
    returns its input)."""
    like.train(training)
    try:
        with torch.no_grad(), hf_outputs.not_recording():
            output = like(*_to_meta(args), **_to_meta(kwargs))
    except Exception:
        return None
    return None if isinstance(output, torch.Tensor) and not whole_tensor else _Template(output)


class Elsewhere(_StandIn):
    """A module outside the blocks that another stage holds.

    Args:
        fqn: its name in the model.
        role: ``"first"`` (before the blocks: stands in with zeros shaped like the real module's output, from its
            meta copy, else like the stage's input; the stage's first block then gets the received activation) or
            ``"last"`` (after the blocks: reaching it ends an earlier stage whose last block the model skipped;
            reaching it with no stage running, the model called outside the steps, is an error).
        executor: the executor whose current stage input the zeros are shaped like.
        like: the real module's meta copy (attribute reads), or ``None``.
    """

    _whole_tensor = True  # zeros shaped like the real output (a speech encoder's features are not the hidden size)

    def __init__(self, fqn: str, role: str, executor: _Executor, like: nn.Module | None = None) -> None:
        super().__init__(fqn, executor, like)
        self.role = role

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.role == "last":
            self._executor.reached(self.fqn, args, kwargs)  # past the running stage's blocks: it ends here
        current = self._executor.current
        # Before the stage's first block its output is never used (the block's input is replaced by the received
        # activation): a module the user placed on an earlier stage (``stages=``) may run there too.
        if current is not None and current.received is not None and (self.role == "first" or not current.started):
            # zeros shaped like the real output (an encoder's output object, for the later stages of its decoder)
            template = self._template(args, kwargs)
            if template is None:
                return self._with_carried(self._mark(torch.zeros_like(current.received)))
            return self._with_carried(template.fill(None, current.received.device, self._mark))
        if current is None:
            raise RuntimeError(outside_steps_message(self.fqn, self._executor.split.stage_of(self.fqn)))
        stage = current.stage
        raise RuntimeError(
            f"lightning_3d: {self.fqn} is held by pipeline stage {self._executor.split.stage_of(self.fqn)}, but stage "
            f"{stage} reached it {'before' if self.role == 'last' else 'without'} its blocks. Modules registered "
            "before the block container run on the first stage and modules after it on the last unless "
            "ThreeDStrategy(stages=...) places them; name the container with ThreeDStrategy(blocks=...) if another one "
            f"was meant. {BLOCKS_CONTRACT}"
        )
