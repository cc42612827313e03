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
