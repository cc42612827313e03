"""``core/grad_groups.py``: the planned grouping gives what grouping every gradient afresh gives."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from lightning_3d.core import torch_compat
from lightning_3d.core.grad_groups import GradGrouper


def _reference(params, grads, stage_of, default_stage):
    """The per-gradient grouping the plan replaces: key each gradient by (stage, its local device, its dtype)."""
    groups = {}
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            local = torch_compat.local_tensor(g)
            held, locals_ = groups.setdefault((stage_of.get(id(p), default_stage), local.device, local.dtype), ([], []))
            held.append(g)
            locals_.append(local)
    return groups


def _same(groups, expected) -> None:
    assert list(groups) == list(expected)  # same groups, same order
    for key, (held, locals_) in expected.items():
        got_held, got_locals = groups[key]
        assert [id(g) for g in got_held] == [id(g) for g in held], key
        assert [id(t) for t in got_locals] == [id(t) for t in locals_], key


def _params(dtypes):
    return [torch.nn.Parameter(torch.zeros(3, dtype=d)) for d in dtypes]


def test_groups_by_stage_and_dtype_as_the_per_gradient_grouping() -> None:
    params = _params([torch.float32, torch.float64, torch.float32, torch.float32, torch.bfloat16])
    stage_of = {id(params[0]): 0, id(params[1]): 0, id(params[2]): 1, id(params[3]): 0}  # params[4]: the default
    grouper = GradGrouper(stage_of, default_stage=1)
    grads = [torch.ones_like(p) for p in params]
    groups = grouper.group(params, grads)
    _same(groups, _reference(params, grads, stage_of, 1))
    expected_keys = [(0, torch.float32), (0, torch.float64), (1, torch.float32), (1, torch.bfloat16)]
    assert [(k[0], k[2]) for k in groups] == expected_keys
    assert [id(g) for g in groups[(0, torch.device("cpu"), torch.float32)][0]] == [id(grads[0]), id(grads[3])]


def test_missing_gradients_are_left_out_step_by_step() -> None:
    params = _params([torch.float32] * 4 + [torch.float64])
    stage_of = {id(p): 0 for p in params}
    grouper = GradGrouper(stage_of, default_stage=0)
    for pattern in ([1, 1, 1, 1, 1], [0, 1, 0, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]):
        grads = [torch.full_like(p, 2.0) if keep else None for p, keep in zip(params, pattern, strict=True)]
        groups = grouper.group(params, grads)
        _same(groups, _reference(params, grads, stage_of, 0))
        assert all(held for held, _ in groups.values())  # a group with no gradient is not there at all


def test_a_new_parameter_list_is_planned_again() -> None:
    first = _params([torch.float32, torch.float32])
    second = _params([torch.float64])
    stage_of = {id(first[0]): 0, id(first[1]): 1, id(second[0]): 1}
    grouper = GradGrouper(stage_of, default_stage=1)
    grouper.group(first, [torch.ones(3), torch.ones(3)])
    grads = [torch.ones(3, dtype=torch.float64)]
    groups = grouper.group(second, grads)
    _same(groups, _reference(second, grads, stage_of, 1))
    longer = [*first, *second]  # the same parameters in a new list: planned for that list
    grads = [torch.ones(3), None, torch.ones(3, dtype=torch.float64)]
    _same(grouper.group(longer, grads), _reference(longer, grads, stage_of, 1))


def test_dtensor_gradients_are_grouped_with_their_local_tensors(gloo_world: dist.ProcessGroup) -> None:
    mesh = init_device_mesh("cpu", (1,))
    params = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()])),
        torch.nn.Parameter(torch.zeros(4)),  # a plain parameter beside them (e.g. a norm tensor parallelism left)
        torch.nn.Parameter(distribute_tensor(torch.zeros(2, dtype=torch.float64), mesh, [Replicate()])),
    ]
    grads = [distribute_tensor(torch.ones(4), mesh, [Replicate()]), torch.ones(4), None]
    stage_of = {id(p): 0 for p in params}
    groups = GradGrouper(stage_of, default_stage=0).group(params, grads)
    _same(groups, _reference(params, grads, stage_of, 0))
    held, locals_ = groups[(0, torch.device("cpu"), torch.float32)]
    assert held[0] is grads[0] and locals_[0] is grads[0]._local_tensor and locals_[1] is grads[1]
