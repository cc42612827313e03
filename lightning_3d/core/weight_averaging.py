"""Lightning's weight-averaging callbacks (``EMAWeightAveraging`` / ``WeightAveraging``,
``StochasticWeightAveraging``) on a split and sharded model.

Both callbacks copy the LightningModule in their ``setup`` hook, which Lightning calls before the strategy's
``setup``: the copy is the whole single-device model, while after setup this rank's module holds its stages only,
with DTensor parameters under tensor and data parallelism. The callbacks then pair the copy's parameters with the
module's by position (``zip``), so at pp > 1 a later stage averaged the wrong tensors (a shape error, or silently a
broadcast), and under dp or tp a DTensor met a plain tensor.

:func:`rebuild_averaged_copies` replaces each copy, once the model is set up, by one of this rank's part
(:func:`stage_copy`): the same names, order and layout as the module's own parameters and buffers, so the
callbacks' own code (update, swap for validation, transfer at the end, ``state_dict``) runs unchanged on each rank,
each rank averaging the tensors it trains. A plain tree of modules is built instead of a ``deepcopy`` of the set-up
module: FSDP2 refuses ``deepcopy``, and the copy needs no forward, hooks or pipeline wrappers.

The copies the callbacks make in ``setup`` are thus thrown away, and making them did harm:
``WeightAveraging.setup`` calls ``configure_model`` itself, outside the strategy's meta-device context, so every
rank built the whole model for real and copied it (twice the whole model's memory before the strategy ran), and
``StochasticWeightAveraging.setup`` deep-copies the module at every stage, which FSDP2 refuses once the model is
sharded (a ``validate`` after ``fit`` on the same Trainer failed). :func:`defer_copies_to_setup_end` makes those
setups leave a placeholder instead.

This module reads the two callbacks' private attributes (``_average_model``, ``_device``, ``_use_buffers``,
``_kwargs``), Lightning 2.6's names; one place to change if they move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from .tied import canonical_names, install_alias_hooks
from .torch_compat import child_modules, own_buffers, own_parameters

STAGE_COPY_ATTR = "_lightning_3d_stage_copy"

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has SWA only
    WeightAveraging = None  # type: ignore[assignment,misc]


def stage_copy(module: nn.Module) -> nn.Module:
    """A plain module tree holding detached copies of ``module``'s parameters and buffers under the same names.

    ``parameters()``, ``buffers()`` and ``state_dict()`` of the copy list the same names in the same order as
    ``module``'s (a tensor shared by two names stays shared; a tied weight is keyed once, canonically, as the module
    keys it); DTensors stay DTensors with their placements. The copy has no forward.
    """
    tensors: dict[int, Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def copy_of(tensor: Tensor, parameter: bool) -> Tensor:
        if id(tensor) not in tensors:
            data = tensor.detach().clone()
            tensors[id(tensor)] = nn.Parameter(data, requires_grad=False) if parameter else data
        return tensors[id(tensor)]

    def build(src: nn.Module) -> nn.Module:
        if id(src) in modules:
            return modules[id(src)]
        dst = modules[id(src)] = nn.Module()
        for name, param in own_parameters(src).items():
            dst.register_parameter(name, None if param is None else copy_of(param, True))  # type: ignore[arg-type]
        for name, buf, persistent in own_buffers(src):
            dst.register_buffer(name, None if buf is None else copy_of(buf, False), persistent=persistent)
        for name, child in child_modules(src).items():
            dst.add_module(name, None if child is None else build(child))
        return dst

    copy = build(module)
    setattr(copy, STAGE_COPY_ATTR, True)
    groups: dict[str, list[str]] = {}
    for alias, canonical in canonical_names(module).items():
        groups.setdefault(canonical, [canonical]).append(alias)
    install_alias_hooks(copy, list(groups.values()))
    return copy


def _copy_of(callback: Any) -> nn.Module | None:
    copy = getattr(callback, "_average_model", None)
    return getattr(copy, "module", copy)  # WeightAveraging's AveragedModel holds the copy as ``.module``


def averaging_callbacks(callbacks: Sequence[Any]) -> list[Any]:
    """The weight-averaging callbacks among ``callbacks`` whose model copy is not (yet) a :func:`stage_copy`: made
    by the callback's ``setup`` from the module as it was before the strategy's."""
    kinds = tuple(k for k in (WeightAveraging, StochasticWeightAveraging) if k is not None)
    return [
        c
        for c in callbacks
        if isinstance(c, kinds) and _copy_of(c) is not None and not getattr(_copy_of(c), STAGE_COPY_ATTR, False)
    ]


def rebuild_averaged_copies(callbacks: Sequence[Any], module: nn.Module) -> list[Any]:
    """Replace the model copy of each weight-averaging callback by a copy of this rank's set-up ``module``.

    Call once the model is split and sharded, before the first step, at every setup: a copy made by an earlier
    setup of the same Trainer (already a stage copy, holding the averages so far) is kept. The callbacks' other
    state (steps counted, schedulers) is left alone: a checkpoint restores it afterwards.

    Returns:
        The callbacks whose copy was replaced.
    """
    rebuilt = averaging_callbacks(callbacks)
    for callback in rebuilt:
        if WeightAveraging is not None and isinstance(callback, WeightAveraging):
            device = callback._device or getattr(module, "device", None)
            callback._average_model = AveragedModel(
                model=stage_copy(module), device=device, use_buffers=callback._use_buffers, **callback._kwargs
            )
        else:  # StochasticWeightAveraging keeps the copy itself and moves it to the device when averaging starts
            callback._average_model = stage_copy(module)
    return rebuilt


def _placeholder(callback: Any) -> nn.Module:
    """What stands in for a callback's copy until :func:`rebuild_averaged_copies` (no parameters)."""
    if WeightAveraging is not None and isinstance(callback, WeightAveraging):
        return AveragedModel(nn.Module())
    return nn.Module()


def defer_copies_to_setup_end(callbacks: Sequence[Any]) -> Callable[[], None]:
    """Make the averaging callbacks' ``setup`` leave the model alone: no whole-model copy, no ``configure_model``.

    ``WeightAveraging.setup`` (for fit) builds the model by calling ``configure_model`` outside the strategy's
    meta-device context and copies it; ``StochasticWeightAveraging.setup`` (every stage) deep-copies the module,
    which FSDP2 refuses once the strategy has sharded it (a ``validate`` after ``fit`` on the same Trainer). Both
    copies are thrown away after the strategy's setup anyway: a placeholder stands in until
    :func:`rebuild_averaged_copies` makes the copy of this rank's part, and Lightning's own ``configure_model``
    call builds the model under the strategy. A subclass with a ``setup`` of its own keeps it. Returns the undo
    (call it at teardown).
    """
    own = {WeightAveraging: "fit", StochasticWeightAveraging: None}  # the class whose setup copies; at which stage
    patched = []
    for callback in callbacks:
        kind = next((k for k in own if k is not None and isinstance(callback, k)), None)
        if kind is None or "setup" in callback.__dict__ or type(callback).setup is not kind.setup:
            continue
        patched.append(callback)

        def setup(trainer: Any, pl_module: Any, stage: str, _callback: Any = callback, _when: Any = own[kind]) -> None:
            if _when is None or stage == _when:
                _callback._average_model = _placeholder(_callback)  # replaced by rebuild_averaged_copies

        callback.setup = setup  # an instance attribute: Lightning looks the hook up on the object

    def undo() -> None:
        for callback in patched:
            callback.__dict__.pop("setup", None)

    return undo
