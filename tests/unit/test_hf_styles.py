"""The tie-aware Hugging Face styles (``core/tensor_parallel/hf_styles.py``) on a one-rank mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import parallelize_module

from lightning_3d.core.tensor_parallel.hf_styles import HFColwiseParallel, HFRowwiseParallel, TiedParams


def test_a_head_re_tied_to_an_already_sharded_embedding_keeps_that_parameter(gloo_world) -> None:
    """A meta-built model is materialised module by module: the embedding is sharded first, then the LM head is
    pointed back at the embedding's (now DTensor) parameter and sharded in turn. It must keep that very
    parameter (one weight, one gradient), and the model must still move (``module.to`` swaps DTensor parameters,
    which torch refuses for a tensor with a weak reference on it)."""
    mesh = init_device_mesh("cpu", (1,))
    ties = TiedParams()
    emb, head = nn.Embedding(16, 4), nn.Linear(4, 16, bias=False)
    parallelize_module(emb, mesh, HFRowwiseParallel(input_layouts=Replicate(), ties=ties))  # vocabulary: Shard(0)
    head.register_parameter("weight", emb.weight)  # tied.retie, as materialisation does
    parallelize_module(head, mesh, HFColwiseParallel(output_layouts=Replicate(), ties=ties))  # weight Shard(0) too
    assert head.weight is emb.weight
    model = nn.Sequential(emb, head).to(torch.device("cpu"), dtype=torch.float64)
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.float64
    out = model(torch.tensor([[1, 2, 3]]))
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_an_already_sharded_parameter_asked_for_another_layout_is_refused(gloo_world) -> None:
    mesh = init_device_mesh("cpu", (1,))
    ties = TiedParams()
    emb, head = nn.Embedding(16, 4), nn.Linear(16, 4, bias=False)  # head weight [4, 16]: row-parallel = Shard(1)
    parallelize_module(emb, mesh, HFRowwiseParallel(input_layouts=Replicate(), ties=ties))
    head.weight = emb.weight  # the shapes are not even compatible; the layouts differ first
    with pytest.raises(ValueError, match="tied parameter sharded twice with different layouts"):
        parallelize_module(head, mesh, HFRowwiseParallel(ties=ties))
