"""Which blocks of a stage become gradient buckets of their own (``data_parallel.bucket_units``)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_3d.core.data_parallel import _SameBufferReduce, bucket_units


def test_every_block_with_parameters_is_a_bucket():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    assert bucket_units(model, list(model)) == [model[0], model[2], model[3]]  # the ReLU has no parameters


def test_blocks_sharing_a_parameter_with_the_rest_stay_with_the_root():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
    model[2].weight = model[0].weight  # a head tied to the embedding
    assert bucket_units(model, list(model)) == [model[1]]
    # sharing inside one block is fine: the block holds both owners
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    inner[1].weight = inner[0].weight
    outer = nn.Sequential(inner, nn.Linear(4, 4))
    assert bucket_units(outer, list(outer)) == [inner, outer[1]]


def test_a_block_listed_twice_runs_twice_and_stays_with_the_root():
    shared = nn.Linear(4, 4)
    other = nn.Linear(4, 4)
    model = nn.Sequential(shared, other, shared)
    assert bucket_units(model, [shared, other, shared]) == [other]


def test_same_buffer_reduce_hands_the_input_back_as_the_output():
    comm = _SameBufferReduce()
    first = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    out = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert out is first  # the one-rank "reduce-scatter" copy becomes a copy onto itself
    again = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert again is not first  # the next reduction gets a fresh input
    assert comm.allocate((3,), dtype=torch.float32, device=torch.device("cpu")) is not again  # other size: fresh


def test_buckets_per_block_on_nccl_one_per_stage_on_gloo(monkeypatch):
    from types import SimpleNamespace

    from lightning_3d.core import data_parallel, torch_compat

    assert data_parallel.per_block_buckets("nccl") and not data_parallel.per_block_buckets("gloo")
    wrapped: list[nn.Module] = []
    monkeypatch.setattr(
        torch_compat, "replicate", lambda module, mesh, mp_policy=None: wrapped.append(module) or module
    )
    mesh = SimpleNamespace(size=lambda: 2, get_group=lambda: None)
    for backend, expected in (("nccl", 3), ("gloo", 1)):
        monkeypatch.setattr(data_parallel.dist, "get_backend", lambda group, b=backend: b)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        wrapped.clear()
        data_parallel.apply_data_parallel(model, mesh, blocks=list(model))
        assert len(wrapped) == expected and wrapped[-1] is model  # the two Linears (NCCL), then the root
    wrapped.clear()
    data_parallel.apply_data_parallel(model, mesh, blocks=list(model), per_block=True)  # forced, as on a GPU
    assert wrapped == [model[0], model[2], model]
