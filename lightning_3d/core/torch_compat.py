"""Every private torch symbol lightning_3d touches, behind small named functions and classes.

torch keeps much of what a 3D-parallel strategy needs behind leading underscores: the registry of process
groups and their timeouts, the pipeline schedules' stages and point-to-point helpers, the stage's shape
inference, the column-parallel input conversion. Those names change between torch releases without notice.
Here, and only here, are they spelled out, so a torch upgrade that renames one fails in one named place
(``tests/unit/test_torch_compat.py`` checks each symbol and its signature against the installed torch), and
the rest of the package (tools, benchmarks and examples included) reads like it uses a public API
(``tests/unit/test_torch_compat.py`` scans them; tests themselves may look inside torch to check what the
package left behind).

A symbol that has gone missing raises :class:`TorchCompatError` naming this module, never a bare
``AttributeError`` deep inside a training step, and never a silent fallback: :func:`shape_inference_done`
in particular fails closed, because guessing "done" would run the user's ``training_step`` during torch's
shape inference.

Wrapping torch functions (the pipeline's point-to-point helpers, a schedule's loss call) is owned here too:
each ``wrap_*`` function installs one wrapper and returns the function that removes it again; several
wrappers of one function stack (first installed innermost) and can be removed in any order.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import increment_version
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "ColwiseParallelWithInputHook",
    "PipelineStageWithShapeInferenceHook",
    "TorchCompatError",
    "TorchDispatchMode",
    "child_modules",
    "compile_seconds",
    "compiled_split_backward_problem",
    "current_batch_p2p",
    "current_wait_batch_p2p",
    "default_group",
    "default_store",
    "foreach_default_devices",
    "foreach_non_finite",
    "foreach_norm",
    "fsdp_collective_names",
    "fsdp_comm_buffers",
    "global_optimizer_hooks",
    "group_timeout",
    "in_backward",
    "is_view",
    "leaf_probe",
    "looped_bfs_placed",
    "max_abs_carries_nan",
    "op_name",
    "own_buffers",
    "own_parameters",
    "p2p_functions_are_torchs",
    "process_groups",
    "quiet_sequential_gathers",
    "record_scaler_found_inf",
    "replicate",
    "saved_attention_and_collective_ops",
    "schedule_has_loss",
    "schedule_micro_batches",
    "schedule_stages",
    "schedule_step",
    "set_donated_buffers",
    "set_group_timeout",
    "settle_async_collective",
    "shape_inference_done",
    "split_backward_functions",
    "tensor_version",
    "torch_release",
    "tree_leaves",
    "unscale_grads_",
    "view_base",
    "wrap_batch_p2p",
    "wrap_method",
    "wrap_schedule_loss",
    "wrap_wait_batch_p2p",
]

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Takes the function being wrapped, returns its replacement."""


class TorchCompatError(RuntimeError):
    """The installed torch lacks a private symbol lightning_3d relies on (see ``lightning_3d/core/torch_compat.py``)."""


def _missing(what: str, purpose: str) -> TorchCompatError:
    return TorchCompatError(
        f"lightning_3d: torch {torch.__version__} has no {what}, which lightning_3d/core/torch_compat.py uses "
        f"({purpose}). This torch version is not supported yet: torch_compat.py is the one place to adapt "
        "(tests/unit/test_torch_compat.py lists every private symbol it needs)."
    )


def _private(owner: Any, name: str, purpose: str) -> Any:
    """``getattr(owner, name)``, or a :class:`TorchCompatError` that says what it was for."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise _missing(f"{where}.{name}", purpose) from None


def _schedules_module() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


# ---------------------------------------------------------------------------------------------- process groups
def process_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to (the default group and the mesh's sub-groups among them)."""
    return list(_private(dist.distributed_c10d, "_pg_map", "listing the process groups"))


def default_group() -> dist.ProcessGroup:
    """The default (world) process group; ``dist.init_process_group`` must have run."""
    return _private(dist.distributed_c10d, "_get_default_group", "finding the default process group")()


def default_store() -> dist.Store:
    """The store the default process group was created with (rendezvous key-value store)."""
    return _private(dist.distributed_c10d, "_get_default_store", "reaching the rendezvous store")()


def set_group_timeout(timeout: timedelta, group: dist.ProcessGroup) -> None:
    """Change the timeout of ``group``'s collectives (what torchtitan does after its first step).

    Raises:
        ValueError, AssertionError: as torch does for a group this rank is not part of.
    """
    _private(dist.distributed_c10d, "_set_pg_timeout", "changing process-group timeouts")(timeout, group)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The current timeout of a process group's backend (``None`` when no backend reports one).

    Args:
        group: the group (default: the default group).
    """
    group = group or default_group()
    purpose = "reading a process group's timeout"
    for device in _private(group, "_device_types", purpose):
        options = getattr(_private(group, "_get_backend", purpose)(device), "options", None)
        if options is not None and hasattr(options, "_timeout"):
            return options._timeout
    return None


# ---------------------------------------------------------------------------------------------- device meshes
def unflatten_mesh(mesh: Any, dim: str, sizes: Sequence[int], names: Sequence[str]) -> Any:
    """``mesh`` with its dimension ``dim`` split into dimensions of ``sizes`` named ``names`` (row-major: the first
    name outermost), over the same ranks and the same root mesh (``DeviceMesh._unflatten``).

    The other dimensions keep their process groups; the new ones get theirs here, so every rank must call it, in
    the same order. Sharing the root mesh lets FSDP2 combine a sub-mesh of the result with the tensor-parallel
    sub-mesh of ``mesh`` (2-D parameters of HSDP x TP).
    """
    unflatten = _private(mesh, "_unflatten", "HSDP's (dp_replicate, dp_shard) mesh")
    # by index: torch 2.11 refuses every dimension given by its name (its check is inverted)
    return unflatten(list(mesh.mesh_dim_names).index(dim), tuple(sizes), tuple(names))


# ---------------------------------------------------------------------------------------------- modules, tensors
def replicate(module: nn.Module, mesh: Any, mp_policy: Any = None) -> nn.Module:
    """torch's FSDP2-based ``replicate`` (DDP semantics over ``mesh``), which lives in a private module.

    ``mp_policy``: a ``MixedPrecisionPolicy`` (e.g. its ``reduce_dtype``); ``None`` keeps torch's default."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    except ImportError as err:
        raise _missing("torch.distributed._composable.replicate_with_fsdp.replicate", "data parallelism") from err
    if mp_policy is None:
        return torch_replicate(module, mesh=mesh)
    return torch_replicate(module, mesh=mesh, mp_policy=mp_policy)


def accumulate_unreduced_grads_as_computed(module: nn.Module) -> None:
    """Keep the gradients FSDP2 / ``replicate`` have not reduced yet in the dtype autograd computed them in.

    With a ``reduce_dtype`` in the policy, torch moves a parameter's gradient into the reduce dtype after every
    backward that does not reduce (``FSDPParam.to_accumulated_grad_if_needed``), so micro-batches and accumulation
    batches would be summed in that dtype: meant for a wider reduce dtype (bf16 gradients summed in fp32), a
    precision loss for a narrower one (fp32 gradients summed in bf16). Without that step the gradients stay on the
    unsharded parameter in their own dtype, exactly as without a policy, and only the reduction's buffer is of the
    reduce dtype (the cast is its flattening copy). Applies to every FSDP unit under ``module``.
    """
    purpose = "gradient compression (grad_reduce_dtype)"
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = _private(_private(sub, "_get_fsdp_state", purpose)(), "_fsdp_param_group", purpose)
        for fsdp_param in group.fsdp_params if group is not None else ():
            _private(fsdp_param, "to_accumulated_grad_if_needed", purpose)  # present: torch still has the step
            fsdp_param.to_accumulated_grad_if_needed = _keep_grad


def fsdp_collective_names() -> tuple[str, str]:
    """The ``torch.distributed`` functions FSDP2 reduce-scatters and all-gathers with, as (reduce-scatter,
    all-gather): ``*_single`` from torch 2.13, ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` before (for
    diagnostics that count or replace them)."""
    if hasattr(dist, "reduce_scatter_single"):
        return "reduce_scatter_single", "all_gather_single"
    return "reduce_scatter_tensor", "all_gather_into_tensor"


def fsdp_comm_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """FSDP2's communication buffers alive now for the FSDP units under ``module``, for memory diagnostics (the B4
    benchmark's account of a peak): ``("reduce-scatter input", t)`` for each reduce-scatter input FSDP2 keeps in
    flight (a unit's flat gradients, until the next unit's reduce-scatter or the end of a last backward),
    ``("all-gather output kept", t)`` for the flat all-gather result a forward keeps to overlap the next unit's
    all-gather, ``("all-gather output", t)`` for an all-gather issued and not yet copied out."""
    purpose = "memory diagnostics (FSDP2's communication buffers)"
    found: list[tuple[str, torch.Tensor]] = []
    contexts: set[int] = set()
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = _private(_private(sub, "_get_fsdp_state", purpose)(), "_fsdp_param_group", purpose)
        if group is None:
            continue
        ctx = _private(group, "comm_ctx", purpose)
        # the context's buffers exist from FSDP2's lazy init (the first forward) on, with its streams
        if id(ctx) not in contexts and hasattr(ctx, "all_gather_copy_in_stream"):
            contexts.add(id(ctx))
            if hasattr(ctx, "reduce_scatter_state"):  # before torch 2.13: the one in flight, or None
                states = [s for s in (ctx.reduce_scatter_state,) if s is not None]
            else:
                states = _private(ctx, "reduce_scatter_states", purpose)
            for state in states:
                found.append(("reduce-scatter input", _private(state, "reduce_scatter_input", purpose)))
            kept = _private(ctx, "all_gather_state", purpose)
            if kept is not None:
                found.append(("all-gather output kept", kept.all_gather_result.all_gather_output))
        pending = _private(group, "_all_gather_result", purpose)
        if pending is not None:
            found.append(("all-gather output", pending.all_gather_output))
    return found


def _keep_grad() -> None:
    """Instead of ``FSDPParam.to_accumulated_grad_if_needed``: the gradient stays where autograd put it."""


def is_replicated(module: nn.Module) -> bool:
    """Whether ``module`` was wrapped by :func:`replicate` (not by ``fully_shard``: both are ``FSDPModule``)."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
    except ImportError as err:
        raise _missing("torch.distributed._composable.replicate_with_fsdp.ReplicateModule", "data parallelism") from err
    return isinstance(module, ReplicateModule)


def foreach_default_devices() -> list[str]:
    """The device types on which torch's optimizers default to their multi-tensor (``foreach``) implementation
    (``torch.utils._foreach_utils._get_foreach_kernels_supported_devices``: GPUs, not the CPU)."""
    from torch.utils import _foreach_utils

    return list(_private(_foreach_utils, "_get_foreach_kernels_supported_devices", "the optimizer's foreach choice")())


def global_optimizer_hooks() -> bool:
    """Whether any optimizer step hook is registered for every optimizer (``register_optimizer_step_pre_hook`` /
    ``_post_hook``; torch keeps them in ``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_post_hooks``)."""
    from torch.optim import optimizer

    purpose = "the optimizer step over local tensors"
    return bool(
        _private(optimizer, "_global_optimizer_pre_hooks", purpose)
        or _private(optimizer, "_global_optimizer_post_hooks", purpose)
    )


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor, in one fused call (``torch._foreach_norm``)."""
    return list(_private(torch, "_foreach_norm", "the gradient norm")(tensors, ord))


def unscale_grads_(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply plain (local) gradients of one device and dtype by ``inv_scale`` in place, as
    ``GradScaler.unscale_`` does (``torch._amp_foreach_non_finite_check_and_unscale_``); returns the local
    found-inf flag that op fills (1.0 if any gradient holds a NaN or inf)."""
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    op = _private(torch, "_amp_foreach_non_finite_check_and_unscale_", "unscaling fp16 loss-scaled gradients")
    op(grads, found_inf, inv_scale)
    # The fused op changes the gradients in place without bumping their version counters: bump them, so that
    # anything keyed on a tensor's version (the non-finite scan's norms that clipping reuses, grad_norm.ScanNorms)
    # sees the unscaled gradients as changed.
    increment_version(grads)
    return found_inf


def record_scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: Any, found_inf: torch.Tensor) -> None:
    """Record ``found_inf`` (a 0-dim float32 tensor on the scale's device: 1.0 overflow, 0.0 none) as
    ``optimizer``'s unscale result in ``scaler``, as ``GradScaler.unscale_`` records its own check
    (``_per_optimizer_states[id(optimizer)]``), so that the public ``scaler.update()`` backs off or grows the
    scale from this (agreed) value."""
    from torch.amp.grad_scaler import OptState

    states = _private(scaler, "_per_optimizer_states", "feeding an agreed overflow to GradScaler.update")
    state = states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.UNSCALED


def foreach_non_finite(tensors: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """Write ``1.0`` into ``found`` (one float32 element on the tensors' device, zero before the call) if any element
    of ``tensors`` (one device and dtype) is NaN or inf, reading each element once and writing none.

    The largest magnitude of each tensor (``torch._foreach_norm`` with ``ord=inf``, one fused pass) is NaN or inf
    exactly when the tensor holds a NaN or an inf, and cannot overflow as a sum of squares can. Where this torch's
    fused kernel on this kind of device would not carry a NaN through (checked once per device type, see
    :func:`max_abs_carries_nan`), GradScaler's fused check (``torch._amp_foreach_non_finite_check_and_unscale_``,
    with ``one`` (float32 ``[1.0]``) as the unscale factor, which rewrites every element with its own value: twice
    the memory traffic) is used instead."""
    if max_abs_carries_nan(found.device):
        largest = torch.stack(foreach_norm(tensors, math.inf))
        found.copy_(largest.isfinite().all().logical_not().reshape(found.shape))
        return
    _private(torch, "_amp_foreach_non_finite_check_and_unscale_", "the non-finite gradient check")(tensors, found, one)


_MAX_ABS_CARRIES_NAN: dict[str, bool] = {}


def max_abs_carries_nan(device: torch.device) -> bool:
    """Whether ``torch._foreach_norm(ord=inf)`` gives NaN for a tensor holding a NaN and inf for one holding an inf
    on this kind of device, also when the NaN lies past the first of the fused kernel's chunks (probed once per
    device type and process, at setup: one host read)."""
    key = device.type
    if key not in _MAX_ABS_CARRIES_NAN:
        # past a fused kernel's chunks (65536 elements on CUDA); the CPU's norm does not chunk: a few bytes suffice
        chunk = 1 if device.type == "cpu" else 65536
        late_nan = torch.ones(3 * chunk + 7, device=device)
        late_nan[2 * chunk + 3] = math.nan
        late_nan[-1] = -5.0
        with_inf = torch.tensor([0.5, -math.inf, 1.0], device=device)
        probes = [late_nan, with_inf, torch.tensor([-3.0, 2.0], device=device)]
        got = torch.stack(foreach_norm(probes, math.inf)).tolist()
        _MAX_ABS_CARRIES_NAN[key] = math.isnan(got[0]) and got[1] == math.inf and got[2] == 3.0
    return _MAX_ABS_CARRIES_NAN[key]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (``DTensor._local_tensor``: the storage itself, without the autograd
    function ``to_local()`` runs), or the tensor itself. For reading or updating values in place, never for a
    computation that must be differentiated through."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (changes whenever the tensor is written in place)."""
    return int(tensor._version)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether the tensor is a view of another tensor's storage (``tensor._base is not None``)."""
    return tensor._base is not None


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose storage ``tensor`` views (``tensor._base``), or ``None`` when it is not a view."""
    return tensor._base


def child_modules(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's own registry of direct children (``module._modules``), live: changing it changes the module.

    Unlike ``named_children`` it keeps every name (a module registered under two names appears twice) and
    preserves insertion order, so pruning and re-assembling a Sequential keep its layer names.
    """
    return module._modules


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own registry of parameters (``module._parameters``), live: an entry set here is what the
    module's forward reads as ``self.<name>`` (a parameter swapped in for one forward is swapped in here).
    Entries may be ``None`` (a ``bias=False`` linear keeps its ``bias`` name)."""
    return module._parameters  # type: ignore[return-value]


def own_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor | None, bool]]:
    """The module's own buffers as ``(name, tensor or None, persistent)``, in registration order (from
    ``module._buffers`` and ``module._non_persistent_buffers_set``): ``named_buffers`` would skip ``None``
    entries and not say which buffers ``state_dict`` leaves out."""
    return [(name, buf, name not in module._non_persistent_buffers_set) for name, buf in module._buffers.items()]


def leaf_probe(module: nn.Module, parameters: dict[str, nn.Parameter | None]) -> nn.Module:
    """A shallow copy of ``module`` (same class, same attributes) holding ``parameters`` instead of its own and no
    children: calling its class's ``forward`` on it runs the module's own code on other weights, the module and its
    parameters untouched."""
    probe = nn.Module.__new__(type(module))
    probe.__dict__ = dict(vars(module))
    probe._parameters = dict(parameters)
    probe._modules = {}
    return probe


def forward_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks registered on ``module`` itself (``module._forward_hooks``), in registration order."""
    return list(module._forward_hooks.values())


def every_hook(module: nn.Module) -> list[Any]:
    """Every hook registered on ``module`` itself, of any kind (forward, pre-forward, backward, state-dict...): the
    values of its ``_*hooks*`` registries, which torch adds to between releases (hence read by that pattern)."""
    return [
        hook
        for name, registry in vars(module).items()
        if name.startswith("_") and "hooks" in name and isinstance(registry, dict)
        for hook in registry.values()
    ]


def remove_forward_hooks(module: nn.Module, hooks: Sequence[Callable[..., Any]]) -> None:
    """Remove the forward hooks ``hooks`` (the functions, by identity) from ``module`` itself, as their handles'
    ``remove()`` would (``module._forward_hooks`` and its with-kwargs and always-call marks)."""
    wanted = set(map(id, hooks))
    for key in [key for key, hook in module._forward_hooks.items() if id(hook) in wanted]:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)


def forward_pre_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module`` itself (``module._forward_pre_hooks``), in registration
    order (``torch.nn.utils.prune`` keeps its pruning method there)."""
    return list(module._forward_pre_hooks.values())


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (``torch._subclasses``): tensors made or computed inside it carry shapes, dtypes and
    autograd graphs but no data, so a model's forward runs without compute; real tensors it meets become fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def quiet_sequential_gathers() -> Any:
    """Silence DTensor's warning that a redistribution runs as several collectives, for the duration.

    Gathering a parameter sharded over two mesh dimensions (FSDP's ``_StridedShard`` over dp and ``Shard`` over
    tp) takes two all-gathers one after the other; torch logs, once per rank, that this "may give inconsistent
    results between ranks due to different reduction orders", which an all-gather (no reduction) cannot. The
    warning goes through the logger of the private module ``torch.distributed.tensor._redistribute``.
    """
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def strided_shard_type() -> type:
    """DTensor's ``_StridedShard`` placement: FSDP2 shards a parameter that tensor parallelism already split on
    dim 0 with it (a shard of the later mesh dimensions' shards, i.e. split after them)."""
    from torch.distributed.tensor import placement_types

    return _private(placement_types, "_StridedShard", "copying FSDP2's 2-D shards out of a full tensor")


# ---------------------------------------------------------------------------------------------- dispatch
def in_backward() -> bool:
    """Whether the calling code runs inside an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


def has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether hooks wait for ``tensor``'s gradient (``register_hook``, ``register_post_accumulate_grad_hook``):
    a weight whose gradient autograd does not compute (``weight_grad_store.py``) would never call them."""
    return bool(tensor._backward_hooks) or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def op_name(func: Any) -> str:
    """The bare name of an operator overload (``"all_reduce_"`` for ``torch.ops.c10d.all_reduce_.default``)."""
    return str(func._schema.name).split("::")[-1]


# ---------------------------------------------------------------------------------------------- tensor parallel
class ColwiseParallelWithInputHook(ColwiseParallel):
    """``ColwiseParallel`` whose input conversion is the static method :meth:`convert_input`.

    torch applies the conversion as ``self._prepare_input_fn``; subclasses override ``convert_input`` and call
    ``ColwiseParallelWithInputHook.convert_input`` for torch's own conversion.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _private(ColwiseParallel, "_prepare_input_fn", "sharing the input conversion of column-parallel Linears")
        super().__init__(*args, **kwargs)

    @staticmethod
    def convert_input(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any, mesh: Any) -> Any:
        """torch's conversion of a column-parallel module's input to a DTensor of the desired layout."""
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, mesh)

    @property
    def _prepare_input_fn(self) -> Callable[..., Any]:  # type: ignore[override]
        # torch's _apply reads self._prepare_input_fn (a static method there): hand it the subclass's hook.
        return self.convert_input


# ---------------------------------------------------------------------------------------------- DTensor operators
def shard_nan_check() -> bool:
    """Let autograd's anomaly detection check DTensor gradients for NaN (``Trainer(detect_anomaly=True)`` under
    tensor parallelism); returns whether a rule was added.

    The engine checks each backward output with ``aten._is_any_true``, for which DTensor has no sharding rule
    (torch 2.13: "Operator aten._is_any_true.default does not have a sharding strategy registered"), so the first
    backward through a tensor-parallel layer died. The rule added (with torch's public
    ``experimental.register_sharding``) replicates the input first: a collective per checked gradient, only while
    anomaly detection runs. Nothing is added where torch already has a rule.
    """
    from torch.distributed.tensor.experimental import register_sharding

    op = torch.ops.aten._is_any_true.default
    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    known = [getattr(propagator, name, {}) for name in ("op_strategy_funcs", "op_to_rules")]
    if any(op in table for table in known):
        return False

    def replicated(tensor: Any) -> list[tuple[list[Any], list[Any]]]:
        return [([Replicate()], [Replicate()])]

    register_sharding(op)(replicated)
    return True


# ---------------------------------------------------------------------------------------------- pipeline stages
def _without_anomaly_detection() -> contextlib.AbstractContextManager[Any]:
    """Autograd's anomaly detection off (``Trainer(detect_anomaly=True)`` turns it on around the whole loop)."""
    return torch.autograd.set_detect_anomaly(False)


class PipelineStageWithShapeInferenceHook(PipelineStage):
    """A ``PipelineStage`` whose shape inference runs inside :meth:`shape_inference_context`.

    torch infers the shapes a stage sends by running a real forward on the first micro-batch
    (``_prepare_forward_infra``); a subclass returns a context manager here to control what that forward may
    change (the default does nothing).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _private(PipelineStage, "_prepare_forward_infra", "running code around the stage's shape inference")
        super().__init__(*args, **kwargs)

    def shape_inference_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context torch's shape inference of this stage runs in."""
        return contextlib.nullcontext()

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.shape_inference_context(), _without_anomaly_detection():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # torch 2.13 infers the gradients' shapes by a backward of the inference forward, whose inputs on a later
        # stage are uninitialised memory: NaN there means nothing, but Trainer(detect_anomaly=True) raised on it
        with _without_anomaly_detection():
            return super()._prepare_backward_infra(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        """torch's warm-up sends and receives to the neighbour stages, less those to a stage on this same rank.

        Before torch 2.13, ``PipelineScheduleMulti`` warms every stage's neighbours up with a dummy send and
        receive on its first step, also where the neighbour stage is on this rank (V schedules, or several stages
        on one rank at pp = 1). gloo has no connection to the rank itself ("Pair is not connected") and the first
        step fails; NCCL accepts it. Stages on one rank hand each other tensors without any send, so the warm-up
        to this rank warms nothing up and is left out. torch 2.13 runs its own warm-up instead of this one.
        """
        ops = _private(PipelineStage, "_get_init_p2p_neighbors_ops", "warming up the neighbour stages")(self)
        me = dist.get_rank()
        return [op for op in ops if op.peer != me]


# ---------------------------------------------------------------------------------------------- pipeline schedules
def looped_bfs_placed(placement: Sequence[int], backward: bool = True) -> type:
    """``ScheduleLoopedBFS`` (all forwards of a rank's earlier stage first, then its later stage; backwards in
    reverse) over stages placed by ``placement`` (``placement[s]`` is stage ``s``'s pp rank) instead of torch's
    looping placement: forward-only evaluation (and a GPipe-order fallback) under a V schedule's placement.

    torch derives the stage-to-rank map from the action list, so only the per-rank action list changes.
    ``backward=False`` leaves the backward actions out (for ``eval``: torch hands a backward's gradient to the
    previous stage on the same rank even when nothing ran backward, and fails).
    """
    schedules = _schedules_module()
    base = _private(schedules, "ScheduleLoopedBFS", "running breadth-first order over a V placement")
    action = _private(schedules, "_Action", "writing a schedule's action list")
    kinds = _private(schedules, "_ComputationType", "writing a schedule's action list")
    ranks = tuple(int(r) for r in placement)

    class PlacedLoopedBFS(base):  # type: ignore[misc,valid-type]
        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            stage_indices = [s for s, r in enumerate(ranks) if r == rank]
            ops: list[Any] = [None] * rank
            for stage_index in stage_indices:
                ops.extend(action(stage_index, kinds.FORWARD, mb) for mb in range(self._n_microbatches))
            ops.extend([None] * (2 * (self.pp_group_size - 1 - rank)))
            for stage_index in reversed(stage_indices):
                ops.extend(action(stage_index, kinds.FULL_BACKWARD, mb) for mb in reversed(range(self._n_microbatches)))
            return ops

        def _prepare_schedule_with_comms(self, actions: Any, format: str = "compute_only") -> None:
            # torch checks that every stage has its backwards, so they are in the action list; forward-only drops
            # them from what runs
            super()._prepare_schedule_with_comms(actions, format)
            if not backward:
                skipped = {kinds.FULL_BACKWARD, kinds.BACKWARD_INPUT, kinds.BACKWARD_WEIGHT, kinds.SEND_B, kinds.RECV_B}
                self.pipeline_order_with_comms = {
                    rank: [a for a in ops if a.computation_type not in skipped]
                    for rank, ops in self.pipeline_order_with_comms.items()
                }

    _private(base, "_calculate_single_rank_operations", "running breadth-first order over a V placement")
    _private(base, "_prepare_schedule_with_comms", "running breadth-first order over a V placement")
    return PlacedLoopedBFS


def parse_schedule_actions(rows: Sequence[Sequence[str]]) -> dict[int, list[Any]]:
    """A CSV action list's rows (one per pp rank, one cell per time slot: ``"0F1"``, ``"1I0"``, ``""``) as torch's
    schedule IR ``{pp rank: [action or None, ...]}`` (torch's ``_Action.from_str``, what ``_load_csv`` uses).

    Raises:
        ValueError: a cell is not an action (torch's message, with the rank and the slot).
    """
    action = _private(_schedules_module(), "_Action", "reading a CSV pipeline schedule")
    order: dict[int, list[Any]] = {}
    for rank, row in enumerate(rows):
        parsed = []
        for slot, cell in enumerate(row):
            try:
                parsed.append(action.from_str(cell))
            except (RuntimeError, ValueError) as bad:
                raise ValueError(f"pp rank {rank} (row {rank + 1}), slot {slot} (column {slot + 1}): {bad}") from None
        order[rank] = parsed
    return order


def action_kind(action: Any) -> str:
    """A schedule IR action's kind as torch writes it in CSV lists: ``"F"``, ``"B"``, ``"I"``, ``"W"``,
    ``"OVERLAP_F_B"``, ``"REDUCE_GRAD"``..."""
    return str(action.computation_type.value)


def action_parts(action: Any) -> tuple[Any, ...]:
    """A schedule IR action's computations: its own, or an overlapped forward-backward's (DualPipeV) parts."""
    return tuple(getattr(action, "sub_actions", None) or (action,))


def is_compute_action(action: Any) -> bool:
    """Whether a schedule IR action computes (forward, backward, input- or weight-gradient) rather than
    communicating or resharding."""
    return bool(_private(action, "is_compute_op", "reading a CSV pipeline schedule"))


def validate_schedule_actions(order: dict[int, list[Any]], pp: int, num_stages: int, n_micro: int) -> dict[int, int]:
    """torch's check of an action list (every stage runs each micro-batch's forward once, then its backward, or
    input- then weight-gradient; one rank per stage); returns ``{stage: pp rank}``.

    Raises:
        ValueError: torch's message (it raises ``AssertionError``).
    """
    check = _private(_schedules_module(), "_validate_schedule", "checking a CSV pipeline schedule")
    try:
        return dict(check(order, pp, num_stages, n_micro))
    except AssertionError as bad:
        raise ValueError(str(bad)) from None


def csv_schedule(stages: Sequence[PipelineStage], n_micro: int, path: str, **kwargs: Any) -> Any:
    """torch's ``_PipelineScheduleRuntime`` over ``stages`` running the compute-only action list in the CSV file
    ``path`` (its ``_load_csv``: validated, stage-to-rank map taken from the list, communication lowered)."""
    runtime = _private(_schedules_module(), "_PipelineScheduleRuntime", "running a schedule read from a CSV file")
    _private(runtime, "_load_csv", "running a schedule read from a CSV file")
    schedule = runtime(list(stages), n_micro, **kwargs)
    schedule._load_csv(str(path))
    return schedule


def schedule_stages(schedule: Any) -> list[PipelineStage]:
    """The stages a torch pipeline schedule runs on this rank (one for single-stage schedules).

    Raises:
        TorchCompatError: the schedule keeps its stages under a name this module does not know.
    """
    if hasattr(schedule, "_stage"):
        return [schedule._stage]
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    raise _missing(f"{type(schedule).__name__}._stage or ._stages", "finding a schedule's stages")


_STEP_RETURNS_OUTPUTS: dict[type, bool] = {}


def schedule_step(schedule: Any, *args: Any, **kwargs: Any) -> None:
    """``schedule.step(*args, **kwargs)``, the last stage keeping no micro-batch's output for a merged return.

    torch >= 2.10 takes ``return_outputs=False``; before, the last stage appends every micro-batch's output to
    ``output_chunks`` and concatenates them when the step ends. The strategy reads each output in the loss function
    (``step.StepAdapter``), so the kept outputs (an LLM's logits, one per micro-batch) would only stay allocated
    for the whole step and then be copied once more."""
    cls = type(schedule)
    if cls not in _STEP_RETURNS_OUTPUTS:
        _STEP_RETURNS_OUTPUTS[cls] = "return_outputs" in inspect.signature(cls.step).parameters
    if _STEP_RETURNS_OUTPUTS[cls]:
        kwargs["return_outputs"] = False
    schedule.step(*args, **kwargs)


def schedule_micro_batches(schedule: Any) -> int:
    """The number of micro-batches a schedule splits each batch into."""
    return int(_private(schedule, "_n_microbatches", "reading a schedule's micro-batch count"))


def schedule_has_loss(schedule: Any) -> bool:
    """Whether the schedule was given a loss function (its last stage then computes one per micro-batch)."""
    return _private(schedule, "_loss_fn", "reading a schedule's loss function") is not None


def split_backward_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's ``(stage_backward_input, stage_backward_weight)``: the ``I`` and ``W`` halves of a stage's backward
    that ``PipelineStage`` runs under the zero-bubble schedules (timed against a whole backward by benchmark S1)."""
    from torch.distributed.pipelining import _backward

    purpose = "timing the zero-bubble schedules' split backward (benchmark S1)"
    return (
        _private(_backward, "stage_backward_input", purpose),
        _private(_backward, "stage_backward_weight", purpose),
    )


def torch_release() -> tuple[int, int]:
    """The running torch's (major, minor) release."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def compiled_split_backward_problem() -> str | None:
    """Why this torch's split backward cannot run a compiled block's backward, or ``None`` where it can.

    On torch 2.11 ``stage_backward_weight``'s ``autograd.grad`` over the edges of a compiled block's backward node
    fails ("Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase"), and a compiled ZB-V run
    there gave step-1 gradients 4e-3 away from one eager process; torch 2.12 fails the same way; torch 2.13 runs both
    correctly. tests/unit/test_compile.py pins both sides: torch fails where this says so and runs where not.
    """
    if torch_release() >= (2, 13):
        return None
    return (
        f"torch {torch.__version__}'s weight-gradient pass (pipelining's stage_backward_weight) cannot run the "
        "backward of a compiled block (it fails, or gives wrong gradients); torch 2.13 runs it"
    )


def shape_inference_done(schedule: Any) -> bool:
    """Whether a training schedule has finished torch's shape inference (its dummy forward and loss).

    Fails closed: when torch keeps the flag under a name this module does not know, it raises rather than
    guess, since a wrong "done" would run the user's ``training_step`` during shape inference.

    Raises:
        TorchCompatError: the schedule has neither known flag.
    """
    for name in ("_stage_backward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, name):
            return bool(getattr(schedule, name))
    raise _missing(
        f"{type(schedule).__name__}._stage_backward_initialized or ._stages_backward_initialized",
        "telling torch's shape inference apart from real training steps",
    )


# ---------------------------------------------------------------------------------------------- wrapping
def wrap_method(obj: Any, name: str, wrapper: Wrapper) -> Callable[[], None]:
    """Replace ``obj.name`` on this instance only by ``wrapper(current obj.name)``.

    Args:
        obj: the instance (a stage, a schedule).
        name: the method's name.
        wrapper: builds the replacement from the current bound method.

    Returns:
        The function that puts the previous state back (call it once; later calls do nothing).
    """
    had = name in obj.__dict__
    old = obj.__dict__.get(name)
    obj.__dict__[name] = wrapper(getattr(obj, name))
    done = [False]

    def restore() -> None:
        if done[0]:
            return
        done[0] = True
        if had:
            obj.__dict__[name] = old
        else:
            obj.__dict__.pop(name, None)

    return restore


def wrap_schedule_loss(schedule: Any, wrapper: Wrapper) -> Callable[[], None]:
    """Wrap the schedule's per-micro-batch loss call, ``(stage, output, target_mbs, mb_index, ...)``.

    The schedule calls it for every micro-batch on every stage; it computes the loss on the last stage only.

    Returns:
        The function that removes the wrapper.
    """
    _private(schedule, "_maybe_compute_loss", "observing a schedule's loss calls")
    return wrap_method(schedule, "_maybe_compute_loss", wrapper)


class _ModuleFunction:
    """A function of a torch module that several wrappers may wrap at once (installed as one composition)."""

    def __init__(self, attr: str, purpose: str) -> None:
        self.attr = attr
        self.purpose = purpose
        self.original: Callable[..., Any] | None = None
        self.wrappers: list[tuple[object, Wrapper]] = []

    def current(self) -> Callable[..., Any]:
        return _private(_schedules_module(), self.attr, self.purpose)

    def is_torchs(self) -> bool:
        return not self.wrappers and getattr(self.current(), "__module__", None) == _schedules_module().__name__

    def add(self, wrapper: Wrapper) -> Callable[[], None]:
        if not self.wrappers:
            self.original = self.current()
        token = object()
        self.wrappers.append((token, wrapper))
        self._install()

        def remove() -> None:
            self.wrappers = [(t, w) for t, w in self.wrappers if t is not token]
            self._install()

        return remove

    def _install(self) -> None:
        if self.original is None:
            return
        fn = self.original
        for _, wrapper in self.wrappers:
            fn = wrapper(fn)
        setattr(_schedules_module(), self.attr, fn)
        if not self.wrappers:
            self.original = None


_BATCH_P2P = _ModuleFunction("_batch_p2p", "posting the pipeline's sends and receives")
_WAIT_BATCH_P2P = _ModuleFunction("_wait_batch_p2p", "waiting for the pipeline's sends and receives")


def wrap_batch_p2p(wrapper: Wrapper) -> Callable[[], None]:
    """Wrap the schedules' ``batch_p2p(p2p_ops, desc=None) -> list[Work]`` (posts a batch of sends/receives).

    Returns:
        The function that removes this wrapper (others stay).
    """
    return _BATCH_P2P.add(wrapper)


def wrap_wait_batch_p2p(wrapper: Wrapper) -> Callable[[], None]:
    """Wrap the schedules' ``wait_batch_p2p(work)`` (waits for a posted batch; ``work`` a list of ``Work``).

    Returns:
        The function that removes this wrapper (others stay).
    """
    return _WAIT_BATCH_P2P.add(wrapper)


def current_batch_p2p() -> Callable[..., Any]:
    """The function the schedules call now to post sends and receives (wrapped or not)."""
    return _BATCH_P2P.current()


def current_wait_batch_p2p() -> Callable[..., Any]:
    """The function the schedules call now to wait for sends and receives (wrapped or not)."""
    return _WAIT_BATCH_P2P.current()


def p2p_functions_are_torchs() -> bool:
    """Whether both point-to-point helpers are torch's own again (no wrapper installed by anyone)."""
    return _BATCH_P2P.is_torchs() and _WAIT_BATCH_P2P.is_torchs()


# ---------------------------------------------------------------------------------------------- torch.compile
# dynamo's timers (seconds per phase, summed over the process): the whole forward compile (tracing, AOT autograd,
# the backend) and the backward graphs, which AOT autograd compiles lazily at the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def compile_seconds() -> float:
    """Seconds this process has spent in ``torch.compile`` so far (forward and lazily compiled backward graphs).

    0.0 when dynamo has not been imported yet (nothing compiled).
    """
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    metrics = getattr(utils, "compilation_time_metrics", None)
    if metrics is None:
        raise TorchCompatError("torch._dynamo.utils.compilation_time_metrics is gone")
    return float(sum(sum(metrics.get(name, ())) for name in _COMPILE_TIMERS))


def set_donated_buffers(enabled: bool) -> bool:
    """Turn AOT autograd's donated buffers on or off, process-wide; returns the previous setting.

    With them on (torch's default), a compiled backward may reuse the memory of the activations its forward saved,
    and torch refuses to run such a backward while the graph is kept (``retain_graph=True``), as a zero-bubble
    schedule's input-gradient pass keeps it for the weight-gradient pass. The setting is read both when a graph
    is compiled and when its backward runs (``torch._functorch.config.donated_buffer``).
    """
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):
        raise TorchCompatError("torch._functorch.config.donated_buffer is gone")
    previous = bool(functorch_config.donated_buffer)
    functorch_config.donated_buffer = enabled
    return previous


class _Settled(torch.autograd.Function):
    """The tensor an ``AsyncCollectiveTensor`` wraps, once its collective is done; the gradient passes as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.wait()  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def settle_async_collective(value: Any) -> Any:
    """``value`` as a plain tensor if it is still waiting on an asynchronous collective, else ``value`` itself.

    torch's row-parallel styles (``RowwiseParallel``, so a vocabulary-parallel Embedding too) all-reduce their
    output with ``async_op=True``: the module returns an ``AsyncCollectiveTensor`` (a private tensor subclass of
    ``torch.distributed._functional_collectives``) that waits at its first use. Handed straight to a compiled
    function (a Llama's embedding output is the first decoder layer's input), AOT autograd gives its backward a
    plain gradient where DTensor's redistribution expects a DTensor (torch 2.13: ``'Tensor' object has no
    attribute '_local_tensor'`` in the first backward). Waiting first, outside the compiled code, keeps the
    gradient's path eager; the wait is what the first eager use would do anyway, and nothing is copied.
    """
    from torch.distributed import _functional_collectives as functional

    cls = getattr(functional, "AsyncCollectiveTensor", None)
    if cls is None:
        raise TorchCompatError("torch.distributed._functional_collectives.AsyncCollectiveTensor is gone")
    if isinstance(value, cls):
        return _Settled.apply(value)
    return value


# ------------------------------------------------------------------------------------ activation checkpointing
_SAVED_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
_SAVED_COLLECTIVE_OPS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")


def saved_attention_and_collective_ops() -> list[Any]:
    """The aten attention kernels and functional collectives (``torch.ops._c10d_functional``) whose outputs
    selective activation checkpointing keeps, as torchtitan's policy does: attention is costly to recompute, and a
    collective recomputed in the backward would communicate again. Ops this torch lacks are left out."""
    ops = []
    for name in _SAVED_ATTENTION_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.append(packet.default)
    funcol = torch.ops._c10d_functional
    for name in _SAVED_COLLECTIVE_OPS:
        packet = getattr(funcol, name, None)
        if packet is not None:
            ops.append(packet.default)
    return ops
