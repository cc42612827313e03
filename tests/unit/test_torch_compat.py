"""Every private torch symbol lightning_3d uses (``lightning_3d/core/torch_compat.py``) against the installed torch.

A torch upgrade that renames or reshapes one of them fails here, by name, instead of somewhere inside a
training step. Functions lightning_3d replaces or overrides must keep their exact parameter names; functions
it only calls must still accept the parameters it passes. Builtins (no Python signature) are checked by what
they do. The pipeline checks run real one-rank schedules on an in-process gloo group of one.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS, schedules
from torch.distributed.pipelining import _backward as split_backward
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from lightning_3d.core import torch_compat
from lightning_3d.core.torch_compat import TorchCompatError


def _names(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- signatures
# (owner, private name, exact parameter names): lightning_3d replaces or overrides these, so every parameter
# matters (a replacement with the old parameters would break torch's callers).
# One list, or a tuple of the lists torch releases have had (the newest first; torch 2.11's last), for a function
# whose replacement passes the rest through.
LOSS_PARAMS = (
    ["self", "stage", "output", "target_mbs", "mb_index", "loss_kwargs"],
    ["self", "stage", "output", "target_mbs", "mb_index"],
)
REPLACED = [
    (schedules, "_batch_p2p", ["p2p_ops", "desc"]),
    (schedules, "_wait_batch_p2p", ["work"]),
    (schedules.PipelineScheduleSingle, "_maybe_compute_loss", LOSS_PARAMS),
    (schedules.PipelineScheduleMulti, "_maybe_compute_loss", LOSS_PARAMS),
    (
        PipelineStage,
        "_prepare_forward_infra",
        (
            ["self", "num_microbatches", "args", "kwargs", "has_backward"],
            ["self", "num_microbatches", "args", "kwargs"],
        ),
    ),
    (
        PipelineStage,
        "_prepare_backward_infra",
        (
            ["self", "num_microbatches", "loss_fn", "target", "received_grad_meta", "loss_kwargs"],
            ["self", "num_microbatches"],
        ),
    ),
    (PipelineStage, "_get_init_p2p_neighbors_ops", ["self"]),
    (ColwiseParallel, "_prepare_input_fn", ["input_layouts", "desired_input_layouts", "mod", "inputs", "device_mesh"]),
]

# (owner, private name, leading parameter names lightning_3d passes): called only.
CALLED = [
    (dist.distributed_c10d, "_set_pg_timeout", ["timeout", "group"]),
    (dist.distributed_c10d, "_get_default_group", []),
    (dist.distributed_c10d, "_get_default_store", []),
    (schedules, "_validate_schedule", ["actions", "pp_group_size", "num_stages", "num_microbatches"]),
    (schedules._Action, "from_str", ["action_string"]),
    (schedules._PipelineScheduleRuntime, "_load_csv", ["self", "filename"]),
    # benchmark S1 (split_backward_functions)
    (split_backward, "stage_backward_input", ["stage_outputs_or_loss", "output_grads", "input_values", "weights"]),
    (split_backward, "stage_backward_weight", ["weights", "param_groups"]),
]


@pytest.mark.parametrize(("owner", "name", "params"), REPLACED, ids=[f"{o.__name__}.{n}" for o, n, _ in REPLACED])
def test_replaced_private_functions_keep_their_signature(owner, name, params):
    assert hasattr(owner, name), f"torch {torch.__version__} has no {owner.__name__}.{name}: adapt torch_compat.py"
    assert _names(getattr(owner, name)) in (params if isinstance(params, tuple) else (params,))


@pytest.mark.parametrize(("owner", "name", "params"), CALLED, ids=[f"{o.__name__}.{n}" for o, n, _ in CALLED])
def test_called_private_functions_accept_our_arguments(owner, name, params):
    assert hasattr(owner, name), f"torch {torch.__version__} has no {owner.__name__}.{name}: adapt torch_compat.py"
    assert _names(getattr(owner, name))[: len(params)] == params


def test_replicate_lives_in_its_private_module_and_takes_a_mesh():
    from torch.distributed._composable.replicate_with_fsdp import replicate

    params = inspect.signature(replicate).parameters
    assert next(iter(params)) == "module"
    assert params["mesh"].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def test_public_stage_methods_the_timeline_wraps_keep_their_first_argument():
    # ScheduleRecorder reads the micro-batch index from the first argument, by position or by these names.
    expected = {
        "forward_one_chunk": "fwd_chunk_id",
        "backward_one_chunk": "bwd_chunk_id",
        "backward_weight_one_chunk": "bwd_chunk_id",
        "get_fwd_recv_ops": "fwd_chunk_id",
        "get_fwd_send_ops": "fwd_chunk_id",
        "get_bwd_recv_ops": "bwd_chunk_id",
        "get_bwd_send_ops": "bwd_chunk_id",
        "perform_reduce_grad": "grad_scale_factor",
    }
    for method, first in expected.items():
        assert _names(getattr(PipelineStage, method))[:2] == ["self", first], method


# ---------------------------------------------------------------------------------------------- tensors, modules
def test_foreach_norm_matches_vector_norm():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, -2.0], [2.0, 0.0]])]
    for order in (2.0, 1.0, float("inf")):
        got = torch_compat.foreach_norm(tensors, order)
        assert [float(g) for g in got] == [float(torch.linalg.vector_norm(t, order)) for t in tensors]


@pytest.mark.parametrize("max_abs", [True, False], ids=["largest-magnitude", "grad-scaler-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_foreach_non_finite_finds_exactly_nan_and_inf(monkeypatch, max_abs, dtype):
    """Both paths (the read-only largest magnitude, and GradScaler's kernel where the former would not carry a NaN)
    flag exactly the lists holding a NaN or an inf, past the fused kernel's first chunk too; huge finite values (whose
    sum of squares overflows) are not flagged; the tensors keep their values."""
    monkeypatch.setitem(torch_compat._MAX_ABS_CARRIES_NAN, "cpu", max_abs)
    big = torch.finfo(dtype).max

    def check(values: list[torch.Tensor]) -> float:
        found = torch.zeros(1)
        before = [v.clone() for v in values]
        torch_compat.foreach_non_finite(values, found, torch.ones(1))
        assert all(torch.equal(a, b) for a, b in zip(values, before) if a.isfinite().all())
        return float(found)

    late = torch.zeros(3 * 65536 + 7, dtype=dtype)
    assert check([late.clone(), torch.full((4,), big, dtype=dtype)]) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        hit = late.clone()
        hit[2 * 65536 + 3] = bad
        assert check([torch.ones(3, dtype=dtype), hit]) == 1.0, bad
    if max_abs:  # the read-only path writes nothing, so nothing that keys on version counters sees a change
        grads = [torch.ones(5, dtype=dtype)]
        torch_compat.foreach_non_finite(grads, torch.zeros(1), torch.ones(1))
        assert grads[0]._version == 0


def test_max_abs_carries_nan_on_this_torch():
    torch_compat._MAX_ABS_CARRIES_NAN.clear()
    assert torch_compat.max_abs_carries_nan(torch.device("cpu")) is True  # the CPU kernel propagates NaN


def test_foreach_default_devices_is_what_the_optimizers_default_by():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    devices = torch_compat.foreach_default_devices()
    assert "cpu" not in devices and "cuda" in devices
    assert _default_to_fused_or_foreach([torch.zeros(2)], differentiable=False) == (False, False)  # CPU: the loop


def test_unscale_grads_and_found_inf_feed_grad_scaler_like_its_own_unscale():
    grads = [torch.tensor([2.0, -4.0]), torch.tensor([[8.0]])]
    found = torch_compat.unscale_grads_(grads, torch.tensor(0.5))
    assert float(found) == 0.0 and grads[0].tolist() == [1.0, -2.0] and grads[1].tolist() == [[4.0]]
    # changed in place, so their version counters move (the clipping's reuse of the scan's norms keys on them)
    assert [g._version for g in grads] == [1, 1]
    assert float(torch_compat.unscale_grads_([torch.tensor([float("inf")])], torch.tensor(0.5))) == 1.0
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    scaler.scale(torch.ones(()))  # the scale exists
    for flag, expected in ((1.0, 2.0), (0.0, 2.0), (0.0, 4.0)):  # back off x0.5, then grow x2 after 2 good steps
        torch_compat.record_scaler_found_inf(scaler, opt, torch.tensor(flag))
        scaler.update()
        assert scaler.get_scale() == expected


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(3)
    before = torch_compat.tensor_version(t)
    t.add_(1)
    assert torch_compat.tensor_version(t) == before + 1
    assert torch_compat.tensor_version(t + 1) == 0


def test_settle_async_collective_waits_and_keeps_the_gradient_path():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class Pending(torch.autograd.Function):  # what a row-parallel style's asynchronous all-reduce hands on
        @staticmethod
        def forward(ctx, x):
            return AsyncCollectiveTensor(x * 1)

        @staticmethod
        def backward(ctx, grad):
            assert type(grad) is torch.Tensor
            return grad

    x = torch.randn(2, 3, requires_grad=True)
    pending = Pending.apply(x)
    assert isinstance(pending, AsyncCollectiveTensor) and pending.requires_grad
    settled = torch_compat.settle_async_collective(pending)
    assert type(settled) is torch.Tensor and settled.requires_grad
    assert torch.equal(settled, x.detach())
    (settled * torch.arange(6.0).view(2, 3)).sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0).view(2, 3))
    plain = torch.ones(2)
    assert torch_compat.settle_async_collective(plain) is plain
    assert torch_compat.settle_async_collective("text") == "text"


def test_is_view():
    t = torch.arange(6.0)
    assert torch_compat.is_view(t.view(2, 3)) and torch_compat.is_view(t[1:])
    assert not torch_compat.is_view(t) and not torch_compat.is_view(t.clone())


def test_child_modules_is_the_live_registry():
    a, b = nn.Linear(1, 1), nn.ReLU()
    seq = nn.Sequential(a, b)
    children = torch_compat.child_modules(seq)
    assert list(children.items()) == [("0", a), ("1", b)]
    del children["0"]
    assert list(seq) == [b] and not hasattr(seq, "0")
    children["7"] = a  # keeps the name, as partition.stage_container needs
    assert [n for n, _ in seq.named_children()] == ["1", "7"] and seq.get_submodule("7") is a


def test_own_parameters_and_buffers_keep_none_entries_and_persistence():
    lin = nn.Linear(2, 3, bias=False)
    lin.register_buffer("kept", torch.ones(1))
    lin.register_buffer("scratch", torch.zeros(1), persistent=False)
    lin.register_buffer("empty", None)
    own = torch_compat.own_parameters(lin)
    assert list(own) == ["weight", "bias"] and own["bias"] is None  # named_parameters() drops the None
    own["weight"] = nn.Parameter(torch.zeros(3, 2))  # live: the forward reads the swapped-in weight
    assert torch.equal(lin(torch.ones(1, 2)), torch.zeros(1, 3))
    assert [(n, p) for n, _, p in torch_compat.own_buffers(lin)] == [
        ("kept", True),
        ("scratch", False),
        ("empty", True),
    ]
    assert torch_compat.own_buffers(lin)[2][1] is None and "scratch" not in lin.state_dict()


def test_leaf_probe_runs_the_class_forward_on_other_weights():
    class Scaled(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.scale = 3.0
            self.extra = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * super().forward(x)

    mod = Scaled()
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    weight, bias = torch.eye(2), torch.ones(2)
    probe = torch_compat.leaf_probe(mod, {"weight": nn.Parameter(weight), "bias": nn.Parameter(bias)})
    x = torch.tensor([[1.0, 2.0]])
    assert type(probe) is Scaled and torch.equal(probe(x), 3.0 * (x + 1))
    assert list(probe.children()) == [] and [n for n, _ in mod.named_children()] == ["extra"]
    assert all(torch.equal(before[k], v) for k, v in mod.state_dict().items())


def test_every_hook_lists_each_kind_registered_on_the_module_itself():
    def pre(*_):
        return None

    def post(*_):
        return None

    def state(*_):
        return None

    lin, parent = nn.Linear(1, 1), nn.Sequential()
    parent.add_module("lin", lin)
    lin.register_forward_pre_hook(pre)
    lin.register_forward_hook(post, with_kwargs=True)
    lin.register_state_dict_post_hook(state)
    parent.register_forward_hook(post)
    found = torch_compat.every_hook(lin)
    assert {id(h) for h in found} >= {id(pre), id(post), id(state)} and torch_compat.every_hook(parent) == [post]


def test_tree_leaves_flattens_containers():
    a, b = torch.ones(1), torch.zeros(1)
    assert torch_compat.tree_leaves({"x": [a, (b, 3)]}) == [a, b, 3]


def test_in_backward_and_dispatch_mode_op_names():
    seen: list[tuple[str, bool]] = []

    class Names(torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((torch_compat.op_name(func), torch_compat.in_backward()))
            return func(*args, **(kwargs or {}))

    assert torch_compat.op_name(torch.ops.aten.add.Tensor) == "add"
    assert torch_compat.op_name(torch.ops.c10d.allreduce_.default) == "allreduce_"
    assert not torch_compat.in_backward()
    x = torch.ones(2, requires_grad=True)
    with Names():
        (x * 3).sum().backward()
    assert ("mul", False) in seen and any(in_bwd for _, in_bwd in seen)


# ---------------------------------------------------------------------------------------------- process groups
def test_process_groups_timeouts_and_store(world_of_one):
    group = torch_compat.default_group()
    assert group is world_of_one
    assert group in torch_compat.process_groups()
    before = torch_compat.group_timeout(group)
    assert isinstance(before, timedelta)
    try:
        torch_compat.set_group_timeout(timedelta(seconds=17), group)
        assert torch_compat.group_timeout(group) == timedelta(seconds=17)
        assert torch_compat.group_timeout() == timedelta(seconds=17)  # default: the default group
    finally:
        torch_compat.set_group_timeout(before, group)
    store = torch_compat.default_store()
    assert isinstance(store, dist.Store)
    store.set("torch_compat/probe", "1")
    assert store.get("torch_compat/probe") == b"1"


def test_replicate_makes_an_fsdp_module(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    module = torch_compat.replicate(nn.Linear(2, 2), mesh=mesh)
    assert isinstance(module, FSDPModule)


def test_colwise_input_hook_is_what_torch_calls(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    calls: list[int] = []

    class Counting(torch_compat.ColwiseParallelWithInputHook):
        @staticmethod
        def convert_input(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            calls.append(1)
            return torch_compat.ColwiseParallelWithInputHook.convert_input(
                input_layouts, desired_input_layouts, mod, inputs, device_mesh
            )

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    linear = nn.Linear(3, 4)
    reference = linear(torch.ones(2, 3)).detach()
    parallelize_module(linear, mesh, Counting())
    out = linear(torch.ones(2, 3))
    assert calls == [1]
    assert torch.equal(out, reference)


# ---------------------------------------------------------------------------------------------- pipeline schedules
class _CountingStage(torch_compat.PipelineStageWithShapeInferenceHook):
    entered = 0

    @contextlib.contextmanager
    def _count(self):
        type(self).entered += 1
        yield

    def shape_inference_context(self):
        return self._count()


def _schedule(multi: bool, world: object) -> tuple[object, list[nn.Module]]:
    torch.manual_seed(0)
    if multi:
        mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
        stages = [_CountingStage(m, i, 2, torch.device("cpu"), group=world) for i, m in enumerate(mods)]
        return ScheduleLoopedBFS(stages, 2, loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean()), mods
    mod = nn.Linear(4, 4)
    stage = _CountingStage(mod, 0, 1, torch.device("cpu"), group=world)
    return ScheduleGPipe(stage, 2, loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean()), [mod]


@pytest.mark.parametrize("multi", [False, True], ids=["single_stage", "multi_stage"])
def test_schedule_internals_on_a_real_schedule(world_of_one, multi):
    sched, mods = _schedule(multi, world_of_one)
    stages = torch_compat.schedule_stages(sched)
    assert [s.stage_index for s in stages] == list(range(len(mods)))
    assert [s.submod for s in stages] == mods
    assert torch_compat.schedule_micro_batches(sched) == 2
    assert torch_compat.schedule_has_loss(sched)
    assert torch_compat.shape_inference_done(sched) is False

    losses: list[int] = []

    def count_losses(fn):
        def wrapper(stage, output, target_mbs, mb_index, *args, **kwargs):
            if stage.is_last:
                losses.append(int(mb_index))
            return fn(stage, output, target_mbs, mb_index, *args, **kwargs)

        return wrapper

    _CountingStage.entered = 0
    remove = torch_compat.wrap_schedule_loss(sched, count_losses)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    sched.step(x, target=y)
    # torch's shape inference ran inside the hook, once per stage; the real loss once per micro-batch
    assert _CountingStage.entered == len(mods)
    assert torch_compat.shape_inference_done(sched) is True
    assert losses == [0, 1]
    remove()
    remove()  # idempotent
    losses.clear()
    sched.step(x, target=y)
    assert losses == [] and _CountingStage.entered == len(mods)  # no second shape inference
    assert all(p.grad is not None for m in mods for p in m.parameters())


def test_first_step_warm_up_leaves_out_sends_to_this_rank(world_of_one, monkeypatch):
    # three stages on the one rank (as a V schedule's middle stages are): before torch 2.13 a multi-stage schedule's
    # first step sent a dummy to each neighbour stage and received one back, here all to this rank, which gloo
    # cannot do; the stage the strategy builds leaves those out
    stages = [
        torch_compat.PipelineStageWithShapeInferenceHook(nn.Linear(4, 4), i, 3, torch.device("cpu"), group=world_of_one)
        for i in range(3)
    ]
    theirs = [PipelineStage._get_init_p2p_neighbors_ops(s) for s in stages]
    assert [len(ops) for ops in theirs] == [2, 4, 2] and all(op.peer == 0 for ops in theirs for op in ops)
    assert [s._get_init_p2p_neighbors_ops() for s in stages] == [[], [], []]
    # a neighbour on another rank keeps its warm-up (seen from a rank that is not the peer)
    monkeypatch.setattr(torch_compat.dist, "get_rank", lambda group=None: 1)
    assert [len(s._get_init_p2p_neighbors_ops()) for s in stages] == [2, 4, 2]


def test_schedule_internals_fail_closed():
    class NotASchedule:
        pass

    with pytest.raises(TorchCompatError, match="torch_compat"):
        torch_compat.shape_inference_done(NotASchedule())
    with pytest.raises(TorchCompatError, match="torch_compat"):
        torch_compat.schedule_stages(NotASchedule())
    with pytest.raises(TorchCompatError, match="torch_compat"):
        torch_compat.schedule_micro_batches(NotASchedule())


# ---------------------------------------------------------------------------------------------- wrappers
def test_wrap_method_on_one_instance_only():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    remove = torch_compat.wrap_method(a, "extra_repr", lambda fn: lambda: "wrapped " + fn())
    assert a.extra_repr().startswith("wrapped ") and not b.extra_repr().startswith("wrapped ")
    remove()
    assert "extra_repr" not in vars(a) and not a.extra_repr().startswith("wrapped ")


def test_p2p_wrappers_stack_and_come_off_in_any_order():
    assert torch_compat.p2p_functions_are_torchs()
    original = torch_compat.current_wait_batch_p2p()
    calls: list[str] = []

    def tracing(label):
        def wrapper(fn):
            def wait(work):
                calls.append(label)
                return fn(work)

            return wait

        return wrapper

    remove_inner = torch_compat.wrap_wait_batch_p2p(tracing("inner"))
    remove_outer = torch_compat.wrap_wait_batch_p2p(tracing("outer"))
    remove_post = torch_compat.wrap_batch_p2p(tracing("post"))
    try:
        assert not torch_compat.p2p_functions_are_torchs()
        assert schedules._wait_batch_p2p is torch_compat.current_wait_batch_p2p()  # what the schedules call
        torch_compat.current_wait_batch_p2p()([])
        assert calls == ["outer", "inner"]
        remove_inner()
        calls.clear()
        torch_compat.current_wait_batch_p2p()([])
        assert calls == ["outer"]
        assert torch_compat.current_batch_p2p()([]) == [] and calls == ["outer", "post"]
    finally:
        remove_outer()
        remove_post()
        remove_inner()
    assert torch_compat.current_wait_batch_p2p() is original
    assert torch_compat.p2p_functions_are_torchs()


def test_strided_shard_is_a_placement_with_a_dim_and_split_factor():
    strided = torch_compat.strided_shard_type()
    placement = strided(0, split_factor=2)
    assert placement.dim == 0 and placement.split_factor == 2


# ---------------------------------------------------------------------------------------------- FSDP2 buffers
def test_fsdp_comm_buffers_show_the_reduce_scatter_input_in_flight(world_of_one):
    """After a backward FSDP2 keeps the last unit's reduce-scatter input (its flat gradients) until the next
    unit's reduce-scatter; a last backward's final callback frees it. Before the first forward: nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    assert torch_compat.fsdp_comm_buffers(net) == []
    net.set_is_last_backward(False)
    net(torch.ones(3, 4)).sum().backward()
    found = torch_compat.fsdp_comm_buffers(net)
    assert [label for label, _ in found] == ["reduce-scatter input"]
    assert found[0][1].numel() in (4 * 8 + 8, 8 * 2 + 2)  # one unit's flat gradients
    net.set_is_last_backward(True)
    net(torch.ones(3, 4)).sum().backward()
    assert torch_compat.fsdp_comm_buffers(net) == []


def test_anomaly_detection_checks_dtensor_gradients(world_of_one):
    """``Trainer(detect_anomaly=True)`` under tensor parallelism: autograd's NaN check of a DTensor gradient
    (``aten._is_any_true``) had no sharding rule; with the rule a NaN is reported and a finite backward passes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch_compat.shard_nan_check()
    assert torch_compat.shard_nan_check() is False  # once
    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]).requires_grad_()
    with torch.autograd.set_detect_anomaly(True):
        (weight * 2).sum().full_tensor().backward()
        assert weight.grad is not None
        with pytest.raises(RuntimeError, match="returned nan values"):
            (weight * torch.tensor(-1.0).sqrt()).sum().full_tensor().backward()


# ------------------------------------------------------------------------------------- one place for them
SCANNED = ("lightning_3d", "benchmarks", "examples")


def _private_torch_uses(source: str) -> list[str]:
    """Where ``source`` touches a private torch name: an import from a torch module with a private part (or of a
    private name), an attribute chain from ``torch`` / ``dist`` / ``nn`` / ``F`` through a private part (ATen
    operators, ``torch.ops.aten._to_copy``, are torch's operator names, not private API), or a private attribute
    every ``nn.Module`` or tensor has (``_parameters``, ``_modules``, ``_base``...) read from anything."""
    import ast

    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    owned = {k for k in vars(nn.Module()) if private(k)} | {k for k in dir(torch.Tensor) if private(k)}
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]  # type: ignore[union-attr]
            if any(private(p) for p in parts):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if any(map(private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute):
            parts, base = [], node
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            root = base.id if isinstance(base, ast.Name) else ""
            chain = [root, *reversed(parts)]
            via_torch = root in {"torch", "dist", "nn", "F"} and chain[1:3] != ["ops", "aten"]
            if node.attr in owned or (via_torch and any(private(p) for p in chain[1:])):
                found.append(f"{node.lineno}: {'.'.join(chain)}")
    return sorted(set(found))


def test_the_scan_finds_each_kind_of_private_use():
    source = (
        "from torch.utils._pytree import tree_leaves\nimport torch._dynamo\nfrom torch.nn import _reduction\n"
        "torch._C._foo()\nm._modules['a']\nt._base\ntorch.ops.aten._to_copy.default\nself._own = 1\n"
    )
    assert sorted({int(hit.split(":")[0]) for hit in _private_torch_uses(source)}) == [1, 2, 3, 4, 5, 6]


def test_private_torch_names_live_in_torch_compat_only():
    """The module's promise: outside ``torch_compat.py`` the package, its benchmarks and its examples use no
    private torch name, so a torch release that renames one breaks here and in ``torch_compat`` only."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = [
        f"{path.relative_to(root)}:{hit}"
        for folder in SCANNED
        for path in sorted((root / folder).rglob("*.py"))
        if path.name != "torch_compat.py"
        for hit in _private_torch_uses(path.read_text())
    ]
    assert offenders == []
