"""Data parallelism over the dp dimension of the mesh.

Each pipeline stage module is wrapped with ``replicate`` (DDP semantics built on FSDP2's machinery), which,
unlike ``DistributedDataParallel``, takes tensor-parallel DTensor parameters as they are and keeps them
visible as parameters (so optimizers, clipping and state dicts see them). ``PipelineStage`` recognises the
wrapped module: every micro-batch's backward runs without gradient sync and the gradients are all-reduced
once, after the last micro-batch. Across gradient-accumulation batches the pipeline defers even that sync
(see ``pipeline.py``), so there is one all-reduce per optimizer step.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import torch_compat


def apply_data_parallel(module: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Wrap a stage module for data parallelism over ``dp_mesh`` with ``replicate`` (no-op when the dp size is 1).

    Args:
        module: the stage's module, already tensor-parallel.
        dp_mesh: the 1-D data-parallel sub-mesh.

    Returns:
        The wrapped module (the same object: ``replicate`` works in place), or ``module`` when dp is 1.
    """
    if dp_mesh.size() == 1:
        return module
    return torch_compat.replicate(module, mesh=dp_mesh)
