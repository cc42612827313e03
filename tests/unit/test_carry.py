"""core/carry.py: which module outputs each pipeline stage boundary carries, and how they are found and sent."""

from __future__ import annotations

from collections import OrderedDict

import torch

from lightning_3d.core.carry import Carried, CarryPlan, map_floating, passed_on, sendable, settled

# an encoder's output read up to stage 3, a bias made on stage 1 and read on stage 2 only
ENCODER = Carried(0, 0, "encoder", 0, 3)
BIAS = Carried(1, 5, "block.2", 1, 2)


def test_each_boundary_carries_what_was_made_on_or_before_it_and_is_read_after_it() -> None:
    plan = CarryPlan.merged(CarryPlan((BIAS, ENCODER)))
    assert plan.values == (ENCODER, BIAS)  # by stage, then model order: every rank sends them in this order
    assert plan.crossing(0) == [ENCODER] and plan.crossing(1) == [ENCODER, BIAS] and plan.crossing(2) == [ENCODER]
    assert plan.crossing(3) == []  # the last stage sends nothing on
    assert plan.received_by(0) == [] and plan.received_by(2) == [ENCODER, BIAS] and plan.received_by(3) == [ENCODER]
    assert plan.made_on(0) == {"encoder": [0]} and plan.made_on(1) == {"block.2": [1]} and plan.made_on(2) == {}
    assert plan.of_module("block.2") == [1]
    assert "encoder (output 0) from stage 0 to 3" in plan.describe()


def test_merged_plans_keep_each_value_once_read_up_to_its_latest_stage() -> None:
    read_earlier = Carried(0, 0, "encoder", 0, 1)  # what an evaluation step's check found, say
    merged = CarryPlan.merged(CarryPlan((read_earlier,)), None, CarryPlan((ENCODER, BIAS)))
    assert merged.values == (ENCODER, BIAS)
    assert CarryPlan.merged(merged, CarryPlan((read_earlier,))) == merged  # nothing new: equal (no rebuild)


def test_floating_tensors_are_numbered_in_one_order_and_structures_are_copied_not_changed() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    ids = torch.arange(3)
    kept = OrderedDict(hidden=a, extra=(ids, b), none=None)
    output = (kept, [c], "text")
    seen: dict[int, torch.Tensor] = {}
    map_floating(output, lambda i, t: seen.setdefault(i, t))
    assert seen == {0: a, 1: b, 2: c}  # integer tensors are not numbered
    doubled = map_floating(output, lambda i, t: t * 0 + i)
    assert isinstance(doubled[0], OrderedDict) and doubled[0] is not kept and kept["hidden"] is a
    assert doubled[0]["hidden"].tolist() == [0.0] and doubled[0]["extra"][0] is ids
    assert doubled[0]["extra"][1].tolist() == [1.0, 1.0] and doubled[1][0].tolist() == [2.0] * 3
    assert doubled[2] == "text" and doubled[0]["none"] is None


def test_a_sent_value_is_contiguous_and_not_a_view_and_a_passed_on_one_has_its_own_node() -> None:
    base = torch.randn(4, 4, requires_grad=True)
    plain = base * 2
    assert sendable(plain) is plain  # no copy when none is needed
    expanded = base[:1].expand(3, 4)  # a position bias broadcast over the batch
    sent = sendable(expanded)
    assert sent.is_contiguous() and sent._base is None and torch.equal(sent, expanded)
    received = torch.randn(2, 4, requires_grad=True)
    out = passed_on(received)
    assert out is not received and out._base is None and out.grad_fn is not None
    out.sum().backward()
    assert torch.equal(received.grad, torch.ones(2, 4))
    frozen = torch.randn(2)
    assert passed_on(frozen) is frozen  # no gradient to carry back: sent as it is


def test_a_carried_tensor_parallel_value_is_reduced_once_and_crosses_whole(gloo_world) -> None:
    """A vocabulary-parallel embedding's output (a DTensor pending a masked reduction, which torch keeps for one
    reduction only) read on a later stage: settled where the module returns it, so the next module and the send both
    read the one reduction; sent as a plain tensor, its gradient flowing back through the DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    weight = torch.randn(8, 4, requires_grad=True)
    ids = torch.tensor([[1, 5, 7]])
    sharded = DTensor.from_local(weight, mesh, [Shard(0)])
    out = torch.nn.functional.embedding(DTensor.from_local(ids, mesh, [Replicate()]), sharded)
    assert out.placements[0].is_partial()  # torch's masked partial
    kept = settled(out)
    assert kept.placements == (Replicate(),) and settled(kept) is kept
    next_module_reads = kept.redistribute(mesh, [Replicate()]).to_local()  # no second reduction of the mask
    sent = sendable(kept)
    assert not isinstance(sent, DTensor) and torch.equal(sent, weight[ids].detach())
    assert torch.equal(next_module_reads, sent)
    (sent * 2).sum().backward()
    want = torch.zeros(8, 4)
    want[[1, 5, 7]] = 2.0
    assert torch.equal(weight.grad, want)
    plain = torch.randn(2, requires_grad=True) * 1
    assert settled(plain) is plain
