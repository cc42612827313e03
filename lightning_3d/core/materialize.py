"""Materialising meta-device layers one at a time, and loading full (single-device) weights into shards.

Large models are built in ``configure_model()`` on the meta device, so no rank ever allocates the whole
model. After the body is pruned to a rank's stages, each kept layer is materialised on its own: allocate
it (full size, one layer at a time), initialise every submodule with ``reset_parameters()`` under a seed
derived from the run seed and the submodule's name, then let tensor parallelism shard it, which frees the
full copy. Seeding by name makes the initial model the same whatever the (tp, pp, dp) layout, and the same
on every rank of a tensor-parallel group, with no communication.

Under FSDP (``data_parallel="fsdp"``) a layer is never allocated in the model at full size: :class:`ShardedInit`
keeps a meta copy of each held layer, the model is tensor-sharded and wrapped with ``fully_shard`` while still on
the meta device, ``to_empty`` then allocates only this rank's shards, and each layer's full initial values are
computed on its meta copy (the same :func:`materialize`, same seeds, so the same values as one device), one layer
at a time, and only this rank's slice of each tensor is copied in before the copy is dropped. A rank's peak during
setup is therefore its share plus one layer's full weights.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import torch_compat
from .tied import canonical_keys, canonical_names


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=True))


def _tensors(module: nn.Module, recurse: bool) -> Iterable[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


Initializer = Callable[[nn.Module], None]


def library_initializers(root: nn.Module) -> dict[int, Initializer]:
    """Modules that a library initialises itself, by ``id``: every module inside a Hugging Face model is initialised
    by that model's own ``_init_weights`` (RMSNorm, rotary tables and all), as ``from_config`` would; a PEFT LoRA
    layer's adapters as PEFT initialises them (:class:`AdapterInit`)."""
    out: dict[int, Initializer] = {}
    for _, model in root.named_modules():  # pre-order: the outermost Hugging Face model wins
        init = getattr(model, "_init_weights", None)
        if callable(init) and hasattr(model, "config") and hasattr(model, "base_model_prefix"):
            for sub in model.modules():
                out.setdefault(id(sub), init)
    for _, holder in root.named_modules():  # a PEFT model (PeftModel, LoraModel) keeps its adapters' configs
        configs = getattr(holder, "peft_config", None)
        if isinstance(configs, Mapping):
            for sub in holder.modules():
                if callable(getattr(sub, "reset_lora_parameters", None)) and isinstance(
                    getattr(sub, "lora_A", None), nn.ModuleDict
                ):
                    out[id(sub)] = AdapterInit(configs)
                elif isinstance(getattr(sub, "original_module", None), nn.Module) and isinstance(
                    getattr(sub, "modules_to_save", None), nn.ModuleDict
                ):
                    out[id(sub)] = AdapterInit(configs)
    return out


@dataclass(frozen=True)
class AdapterInit:
    """PEFT's initialisation of a LoRA layer's adapters, run after its children's (``lora_A`` and ``lora_B`` are
    ``nn.Linear`` s inside a Hugging Face model, whose ``_init_weights`` draws both from a normal): ``lora_B`` zero
    (on an embedding ``lora_embedding_A``), so that the adapted model starts as the base model, the other as the
    adapter's ``init_lora_weights`` says (``True``: Kaiming-uniform, ``"gaussian"``; ``False`` leaves them random),
    by PEFT's own ``reset_lora_parameters``. Initialisations computed from the base weights (PiSSA, OLoRA, LoftQ,
    EVA, CorDA, DoRA's magnitudes) cannot be computed on the meta device: refused, naming the layer. A
    ``modules_to_save`` wrapper's trained copies start as its original, as PEFT's deep copy makes them (each was
    drawn on its own)."""

    configs: Mapping[str, Any]

    def __call__(self, layer: nn.Module) -> None:
        copies = getattr(layer, "modules_to_save", None)
        if isinstance(copies, nn.ModuleDict):  # modules_to_save: each trained copy starts as the original (PEFT's)
            original = layer.original_module.state_dict()  # type: ignore[union-attr]
            for copy_ in copies.values():
                copy_.load_state_dict(original)
            return
        embedding = getattr(layer, "lora_embedding_A", None)  # a LoRA layer on an embedding keeps its adapters here
        adapters = [*layer.lora_A, *(embedding if isinstance(embedding, nn.ParameterDict) else ())]  # type: ignore[union-attr]
        for adapter in dict.fromkeys(adapters):
            flag = getattr(self.configs.get(adapter), "init_lora_weights", True)
            dora = bool(getattr(layer, "use_dora", {}).get(adapter, False))
            if dora or not (isinstance(flag, bool) or flag == "gaussian"):
                what = "use_dora=True" if dora else f"init_lora_weights={flag!r}"
                raise ValueError(
                    f"lightning_3d: the LoRA adapter {adapter!r} of a {type(layer).__name__} was built on the meta "
                    f"device (in configure_model) with {what}, which PEFT computes from the base layer's weights; "
                    "those do not exist on the meta device. Build the PEFT model in __init__ (on real weights), or "
                    "use init_lora_weights=True or 'gaussian'."
                )
            layer.reset_lora_parameters(adapter, flag)  # type: ignore[operator]


def check_materializable(module: nn.Module, prefix: str, initializers: Mapping[int, Initializer] | None = None) -> None:
    """Refuse meta tensors that nothing would initialise (modules without ``reset_parameters`` that no library
    initialiser covers, see :func:`library_initializers`).

    Raises:
        ValueError: naming every such module and what it holds.
    """
    initializers = initializers or {}
    missing = []
    for name, sub in module.named_modules(prefix=prefix):
        own = [n for n, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)] if t.is_meta]
        if own and not callable(getattr(sub, "reset_parameters", None)) and id(sub) not in initializers:
            missing.append(f"{name or type(sub).__name__} ({type(sub).__name__}: {', '.join(own)})")
    if missing:
        raise ValueError(
            "These modules were built on the meta device (in configure_model) and own tensors that nothing can "
            "initialise: " + "; ".join(missing) + ". Give each a reset_parameters() method that initialises its own "
            "parameters and buffers (nn.Linear, nn.Embedding and nn.LayerNorm already have one), or build the "
            "model in __init__."
        )


def module_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed for one submodule, from the run seed and the submodule's name."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def materialize(
    module: nn.Module,
    device: torch.device,
    base_seed: int,
    prefix: str,
    initializers: Mapping[int, Initializer] | None = None,
    exclude: Collection[nn.Module] = (),
) -> None:
    """Allocate the meta tensors of ``module`` on ``device`` and initialise them, children first, seeded by name.

    Children are reset before their parents so that a parent's ``reset_parameters`` may override its
    children's default initialisation (e.g. GPT-2's scaled residual projections). A module in ``initializers``
    is initialised by its library's initialiser instead. Tensors that are already real are left alone, so a
    weight tied to a module materialised earlier keeps its values (it is initialised once, by its first module).
    The modules in ``exclude`` (and everything inside them) stay on the meta device.
    """
    initializers = initializers or {}
    excluded = {id(m) for e in exclude for m in e.modules()}
    named = [(n, m) for n, m in module.named_modules(prefix=prefix, remove_duplicate=False) if id(m) not in excluded]
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # a parameter registered in several modules (tied)
    for _, sub in named:
        for pname, param in sub.named_parameters(recurse=False):
            shared.setdefault(id(param), []).append((sub, pname))
    fresh: list[tuple[str, nn.Module]] = []
    for name, sub in named:
        if any(t.is_meta for t in _tensors(sub, recurse=False)):
            sub.to_empty(device=device, recurse=False)
            fresh.append((name, sub))
    for owners in shared.values():  # to_empty allocated each owner's copy anew: tie them again to the first
        first_owner, first_name = owners[0]
        for owner, pname in owners[1:]:
            owner.register_parameter(pname, getattr(first_owner, first_name))
    fresh_ids = {id(sub) for _, sub in fresh}
    for name, sub in reversed(named):  # reverse pre-order: children before parents
        library_init = initializers.get(id(sub))
        if library_init is not None:
            # a library's initialiser covers the module's own tensors; PEFT's, the adapters inside the LoRA layer
            covered = sub.modules() if isinstance(library_init, AdapterInit) else [sub]
            if not any(id(s) in fresh_ids for s in covered):
                continue
            init: Callable[[], Any] = lambda sub=sub, library_init=library_init: library_init(sub)  # noqa: E731
        else:
            reset = getattr(sub, "reset_parameters", None)
            if not callable(reset) or not any(id(s) in fresh_ids for s in sub.modules()):
                continue
            init = reset
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(module_seed(base_seed, name))
            init()


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(recurse=False, remove_duplicate=False),
        *module.named_buffers(recurse=False, remove_duplicate=False),
    ]


class ShardedInit:
    """Initialise FSDP-sharded modules with their single-device values, never allocating more than one whole.

    Build it on the meta-device modules before anything shards them (it keeps a meta copy of each); then shard and
    wrap the real modules on the meta device, call :meth:`allocate` on the wrapped stage modules (``to_empty``:
    only this rank's shards get memory) and :meth:`fill`, which initialises each copy in turn exactly as
    :func:`materialize` would initialise the module itself and copies this rank's slice of every tensor in.

    Args:
        modules: ``(name, module)`` in materialisation order (the owner of a tied weight first), still on meta.
        initializers: library initialisers of the real modules, by ``id`` (see :func:`library_initializers`).
    """

    def __init__(
        self, modules: Sequence[tuple[str, nn.Module]], initializers: Mapping[int, Initializer] | None = None
    ) -> None:
        initializers = initializers or {}
        self.modules = [m for _, m in modules]
        self._pending: list[tuple[str, nn.Module, list[tuple[nn.Module, nn.Module]], dict[int, Initializer]]] = []
        for name, module in modules:
            twin = _hookless_copy(module)  # meta: no memory
            pairs = list(zip(module.modules(remove_duplicate=False), twin.modules(remove_duplicate=False), strict=True))
            inits = {id(t): initializers[id(r)] for r, t in pairs if id(r) in initializers}
            self._pending.append((name, twin, pairs, inits))

    def allocate(self, wrapped: Iterable[nn.Module], device: torch.device) -> None:
        """``to_empty`` the wrapped stage modules (FSDP re-registers its shards), keeping tensors that were real."""
        for stage in wrapped:
            kept = [
                (owner, name, (t.to_local() if isinstance(t, DTensor) else t).detach().clone())
                for owner in stage.modules()
                for name, t in _own_tensors(owner)
                if not t.is_meta
            ]
            stage.to_empty(device=device)
            with torch.no_grad():
                for owner, name, value in kept:
                    t = getattr(owner, name)
                    (t.to_local() if isinstance(t, DTensor) else t).copy_(value)

    def fill(self, device: torch.device, base_seed: int) -> None:
        """Compute each module's full initial values (one module at a time) and copy this rank's slices in."""
        done: set[int] = set()
        while self._pending:
            # in a function of its own, so that no local keeps a part of this copy alive into the next one's
            _fill_one(*self._pending.pop(0), device, base_seed, done)


def _hookless_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` and its submodules without their hooks (the copy is only initialised).

    A hook can be a bound method of an object that holds the whole model (the stage executor's hooks on a stage's
    first and last block): ``deepcopy`` copies that object too, and the copy refers back to itself, so it would
    outlive the layer's fill until the garbage collector runs, keeping that layer's full values alive while the
    next layer is computed (measured: two blocks whole at once on a stage whose first block has a hook).
    """
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for attr, value in vars(sub).items():
            if "hooks" in attr and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(module, memo)


def _fill_one(
    name: str,
    twin: nn.Module,
    pairs: list[tuple[nn.Module, nn.Module]],
    inits: Mapping[int, Initializer],
    device: torch.device,
    base_seed: int,
    done: set[int],
) -> None:
    materialize(twin, device, base_seed, prefix=name, initializers=inits)
    with torch.no_grad():
        for real, full in pairs:
            values = dict(_own_tensors(full))
            for tname, target in _own_tensors(real):
                if id(target) in done:  # a weight tied to an earlier module: its first owner's values
                    continue
                done.add(id(target))
                _copy_slice(target, values[tname])


def _copy_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``target`` (a plain tensor, or a DTensor sharded any way) its part of the full tensor ``full``."""
    full = full.detach()
    if not isinstance(target, DTensor):
        target.copy_(full.to(target.device, target.dtype))
        return
    local = _local_view(full, target)
    if local is None:  # a placement the view does not know: DTensor's own split (it may copy)
        local = distribute_tensor(
            full.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
    target.to_local().copy_(local)


def _local_view(full: torch.Tensor, target: DTensor) -> torch.Tensor | None:
    """This rank's part of ``full`` as a view (no copy) for ``target``'s mesh and placements, as DTensor splits:
    ``torch.chunk`` per sharded mesh dimension, an empty slice past the last chunk. ``None`` for placements other
    than shard / strided shard / replicate. A strided shard (FSDP2 over tensor parallelism's dim-0 shards) splits
    the later dimensions' shards, so with one the dimensions are applied last to first."""
    strided = torch_compat.strided_shard_type()
    placements, mesh = target.placements, target.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    order = list(range(len(placements)))
    if any(isinstance(p, strided) for p in placements):
        order.reverse()
    local = full
    for i in order:
        placement = placements[i]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, strided)):
            return None
        dim = placement.dim
        chunks = torch.chunk(local, mesh.size(i), dim=dim)
        local = chunks[coordinate[i]] if coordinate[i] < len(chunks) else local.narrow(dim, 0, 0)
    return local


@dataclass
class LoadReport:
    """What :func:`load_full_state_dict` did."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _local_targets(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every parameter and persistent buffer held here. A weight tied across stages goes by its
    canonical name; when a rank holds two copies of it (both ends of a V schedule), both are listed under it."""
    persistent = set(module.state_dict(keep_vars=True).keys())
    aliases = canonical_names(module)
    targets = [(aliases.get(n, n), p) for n, p in module.named_parameters()]
    targets += [(n, b) for n, b in module.named_buffers() if n in persistent]
    return targets


def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    full_keys: Iterable[str] | None = None,
    strict: bool = True,
) -> LoadReport:
    """Copy a single-device (unsharded, unsplit) state dict into this rank's shard of the model.

    Each rank takes the slices of the tensors it holds: tensor-parallel shards of DTensors are cut locally
    (no communication), and layers of other pipeline stages are ignored. Nothing is changed unless every
    check passes.

    Args:
        module: the rank's (pruned, sharded) module, e.g. the LightningModule after setup.
        state_dict: full tensors keyed like the single-device module's ``state_dict()``.
        full_keys: every key of the unsplit model (to tell "another stage's key" from "unexpected");
            defaults to the local keys.
        strict: raise on missing or unexpected keys and on shape mismatches.

    Returns:
        A :class:`LoadReport`.

    Raises:
        KeyError: with ``strict``, naming missing and unexpected keys.
        ValueError: a tensor's shape differs from the model's.
    """
    targets = _local_targets(module)
    state_dict = canonical_keys(state_dict, module)  # a plain model's state dict names a tied weight twice
    keys = {k for k, _ in targets}
    known = set(full_keys) if full_keys is not None else keys
    report = LoadReport(
        missing=sorted(k for k in keys if k not in state_dict),
        unexpected=sorted(k for k in state_dict if k not in known and k not in keys),
    )
    if strict and (report.missing or report.unexpected):
        raise KeyError(
            f"State dict does not match the model: missing keys {report.missing[:10]}"
            f"{' ...' if len(report.missing) > 10 else ''}, unexpected keys {report.unexpected[:10]}"
            f"{' ...' if len(report.unexpected) > 10 else ''}. Nothing was loaded."
        )
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    loaded: set[str] = set()
    for name, target in targets:
        if name not in state_dict:
            continue
        full = state_dict[name]
        shape = tuple(target.shape)  # DTensor: the global shape
        if tuple(full.shape) != shape:
            raise ValueError(
                f"Shape mismatch for {name!r}: checkpoint {tuple(full.shape)}, model {shape}. Nothing was loaded."
            )
        if isinstance(target, DTensor):
            local = distribute_tensor(
                full.detach().to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            staged.append((target.to_local(), local))
        else:
            staged.append((target, full.detach()))
        if name not in loaded:  # (both copies of a tied weight: one key)
            loaded.add(name)
            report.loaded.append(name)
    with torch.no_grad():
        for dst, src in staged:
            dst.copy_(src.to(dst.device, dst.dtype))
    return report


def gather_full_state_dict(module: nn.Module, *, writer: bool, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Assemble the single-device state dict of the whole model on global rank ``dst`` (CPU tensors).

    Collective: every rank must call it. Tensor-parallel shards are gathered over their tp group
    (``full_tensor``); each stage's tensors are then sent to ``dst`` by one "writer" rank per stage (e.g. the
    rank with dp and tp coordinates 0). Memory: ``dst`` ends up holding the whole model.

    Args:
        module: the rank's module (e.g. the LightningModule after setup).
        writer: whether this rank contributes its stage's tensors.
        dst: global rank that receives the result.

    Returns:
        The full state dict on ``dst``, ``None`` elsewhere.
    """
    import torch.distributed as dist

    local: dict[str, torch.Tensor] = {}
    with torch_compat.quiet_sequential_gathers():  # FSDP x tp parameters: two all-gathers each, correct
        for name, tensor in module.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if writer:
                local[name] = full.detach().cpu().clone()
    if not dist.is_initialized():
        return local
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(local, parts if dist.get_rank() == dst else None, dst=dst)
    if dist.get_rank() != dst:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged
