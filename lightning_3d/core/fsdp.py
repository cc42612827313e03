"""Sharded data parallelism (FSDP2, ZeRO-3) over the dp dimension of the mesh: ``data_parallel="fsdp"``.

Each pipeline stage module is wrapped the way torchtitan combines FSDP2 with pipelining and tensor parallelism:
``fully_shard`` every block the stage holds (its own all-gather / reduce-scatter unit; a block that shares a weight
with a module outside it stays with the root, the rule of ``replicate``'s gradient buckets), then the stage's root
module (the rest: embeddings, final norm, head); ``fsdp_unit="submodule"`` splits the blocks further (below).
Parameters, gradients and optimizer states are then sharded over dp: each rank keeps 1 / dp of its stage's
(tensor-parallel) parameters as ``DTensor`` shards on the dp sub-mesh, or on the (dp, tp) sub-mesh for
tensor-parallel ``DTensor`` parameters (2-D sharding; FSDP2 concatenates the two sub-meshes of the one (dp, pp, tp)
root mesh).

HSDP (``data_parallel="hsdp"``): the same wrapping over a 2-D mesh, ``("dp_replicate", "dp_shard")``, HSDP's
view of the dp ranks (``Topology.build_hsdp_mesh``: replicate outer, so a shard group is consecutive ranks,
one node with the default ``dp_shard``). FSDP2 then shards each parameter over ``dp_shard`` and replicates the
shards over ``dp_replicate``: its all-gathers and reduce-scatters run within a shard group, followed by one
all-reduce of the reduced gradient shards across the replicas (per unit, per optimizer step). Tensor-parallel
parameters get a 3-D (dp_replicate, dp_shard, tp) placement (the HSDP mesh shares the root mesh of ``mesh["tp"]``).

Gradient sync: torch's ``PipelineStage`` recognises the ``FSDPModule`` and runs every micro-batch's backward
without gradient sync and without resharding, then one post-backward (reduce-scatter and reshard) after the last
micro-batch; across gradient-accumulation batches ``pipeline._Stage`` keeps even that sync off
(``set_requires_gradient_sync(False)``) until the window's last batch, so there is one reduce-scatter per
optimizer step, exactly as ``replicate`` has one all-reduce. The price: every unit a micro-batch's backward has
reached stays gathered, with its unsharded gradients, until the step's (or the window's) reduce-scatter; at pp = 1
too, since the one stage runs through the same ``PipelineStage``.

``reshard_after_forward``: under a pipeline (pp > 1) ``False`` for every unit, as torchtitan chooses: each stage
runs several micro-batch forwards before their backwards, and resharding after each forward would all-gather the
stage's parameters again for every micro-batch (forward and backward); not resharding gathers once per step,
at the price of holding the stage's gathered parameters (1 / pp of the tp-local model) from the first forward
to the step's post-backward. At pp = 1 torch's default (reshard each block after its forward, the root not)
keeps the forward's peak at one gathered block. The ``fsdp_reshard_after_forward`` setting forces either choice;
measured (README, B4/FSDP): under a pipeline ``True`` alone triples the all-gathers per step and leaves the step's
peak unchanged, because of the backward described above. Evaluation batches reshard at their end
(``reshard_after_eval``) so that the optimizer and checkpoints always see the sharded parameters.

``reshard_after_backward`` (the ``fsdp_reshard_after_backward`` setting): ZeRO-3 as DeepSpeed runs it under
gradient accumulation. ``apply_fsdp`` marks the stage module (``RESHARD_AFTER_BACKWARD_ATTR``; the settings make
``reshard_after_forward`` ``True``) and ``pipeline._Stage`` runs every micro-batch's backward with resharding after
backward and gradient sync forced on: each unit is all-gathered for each micro-batch's forward and again for its
backward, resharded after each, and reduce-scatters its gradients after each micro-batch's backward into the
sharded gradients, which accumulate over micro-batches and ``accumulate_grad_batches`` batches (m reduce-scatters
and 2m all-gathers per unit and batch instead of 1 and 1; the numbers stay those of one device, the sum taken in
another order). So a unit is gathered, with its unsharded gradients, only while its own forward or backward runs.
Every such backward is FSDP2's "last" one (``set_is_last_backward(True)``), whose final callback also frees the
reduce-scatter input FSDP2 keeps in flight after each unit (otherwise the last unit's would live on through the
next micro-batch's forward). HSDP: the reduce-scatter runs every micro-batch, the all-reduce across replicas only
on the optimizer step's last backward (``set_requires_all_reduce(False)`` before: FSDP2 sums the reduced shards
meanwhile), once per unit and optimizer step as without the setting. FSDP2's implicit backward prefetch (a unit's
pre-backward all-gathers the unit that ran before it in the forward) is turned off in this mode
(:func:`no_backward_prefetch`): it keeps a second unit gathered while one computes its backward, 1 / tp of a block
more at the peak, and on this project's CPU machines it cannot overlap anyway (measured in B4/FSDP, step time
both ways). Split backwards (zero-bubble schedules) are refused by the settings: FSDP2's post-backward would run
after the input gradients, before the weight gradients exist. What remains at the peak beyond the share, per
unit of 1 / tp block: the gathered parameters and their gradients, plus the previous unit's reduce-scatter input
that FSDP2 keeps until the next reduce-scatter (``set_reduce_scatter_max_input_buffers`` >= 1), and activations
(measured in the README's B4/FSDP part).

``fsdp_unit="submodule"``: smaller units, as DeepSpeed's ZeRO-3 gathers per submodule. :func:`fsdp_units` picks,
inside each block, every submodule that directly owns parameters (``Linear``, ``Embedding``, ``LayerNorm``, ...),
children before parents, each wrapped before the module holding it; then the block, only where a parameter is left
to it (registered on the block itself, or shared by two of its submodules); then the stage root as under ``"block"``
(the blocks are what the builder hands over: every layer of an ``nn.Sequential`` body, its embedding and head layers
included; a split model's blocks, its embeddings, final norm and head in the root; no block container at pp = 1: one
unit). Which submodules may be units is ``data_parallel.bucket_units``' rule applied over the whole stage: one whose
parameter is also registered on a module outside it (a tied weight) would split that weight's uses between two
units, and one registered twice runs twice per forward; both stay with the unit above. Wrapping keeps every name
(FSDP2 changes a module's class, not its place), so parameters, state dicts and checkpoints are unchanged. Each unit
runs the collectives a block unit runs (the counts above, per unit), but a transformer block is then about 8 units
(its two norms, q, k, v and output projections, two MLP matrices) instead of 1: more and smaller all-gathers and
reduce-scatters, each with its fixed cost and FSDP2's hooks. What it buys is the size of what is gathered at once.
With ``reshard_after_backward`` the peak beyond the share is three of the largest unit (the one computing its
backward, its gradients, the reduce-scatter input of the unit before) plus activations: for a transformer block's
largest unit, an MLP matrix (4h^2 / tp of the block's 12h^2 / tp), that is the block's own tensor-parallel share,
1/tp of one layer's full weights, against 3/tp with block units (B4/FSDP at tp2 x pp2 x dp2, width 1024: share +
0.56 blocks, the issue's share + one layer met; block units share + 1.52); without it, torch's pipelined FSDP keeps
every unit gathered through the step anyway, so the peak is that of block units (measured in the README's B4/FSDP
part). With activation checkpointing the recomputation runs inside the backward, where FSDP2 does not reshard after
a forward (``post_forward`` skips it there): every unit of the block being recomputed is gathered at once and freed
by its own post-backward, so that peak holds one block's tensor-parallel share gathered (still no extra all-gather:
the backward finds each unit gathered). With ``compile``, FSDP2 runs its hooks outside the compiled code
(``torch._dynamo.disable``), so a compiled block breaks into a piece per unit (numbers unchanged; tested). Under
tensor parallelism (and compile) a unit's output is a view (FSDP2 warns, the strategy silences it), and FSDP2 says
an in-place operation on such a view would drop the unit's pre-backward hook; on a tensor-parallel ``Linear``'s
output autograd refuses in-place operations anyway (under block units too), and on a plain ``Linear``'s (not a view)
``nn.ReLU(inplace=True)`` keeps the hook (checked: the same gradients). Which to pick: the default (block units, no
resharding under a pipeline) for throughput; ``fsdp_reshard_after_backward`` when the step's peak does not fit;
``fsdp_unit="submodule"`` with it when even that does not fit (the README's B4/FSDP part).

Mixed precision from Lightning's precision: ``"bf16-mixed"`` computes with bf16 copies of the parameters and
reduces gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); every other
precision (``"32-true"``, ``"64-true"``, ``"bf16-true"``) uses the parameters' own dtype (no policy).
``grad_reduce_dtype`` (``"bf16"`` / ``"fp16"``) overrides the reduction's dtype in either case (the policy's
``reduce_dtype``; under ``bf16-mixed`` "bf16" reduces the bf16 gradients as they are): the reduce-scatter moves half
the bytes of fp32, and the sharded gradients land back in the parameters' dtype. fp16's range: see
``data_parallel.py`` (torch divides by about sqrt(dp) before and after the sum). The micro-batches' gradients are
summed locally in the dtype autograd computes them in (fp32 under ``32-true``; bf16 under ``bf16-mixed``, where the
default fp32 reduction sums them in fp32) until the step's reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from . import torch_compat
from .data_parallel import bucket_units, torch_reduce_dtype

SHARDED_MODES = ("fsdp", "hsdp")  # the ``data_parallel`` modes wrapped here
#: The ``fsdp_unit`` setting's values: one FSDP unit per block, or one per parameter-owning submodule of a block.
FSDP_UNITS = ("block", "submodule")
FSDP_ATTR = "_lightning_3d_fsdp"  # marks stage modules wrapped here (``replicate``'s modules are FSDPModules too)
# marks stage modules whose units reshard and reduce-scatter after every micro-batch's backward (``pipeline._Stage``)
RESHARD_AFTER_BACKWARD_ATTR = "_lightning_3d_reshard_after_backward"


def mixed_precision_policy(precision: Precision, reduce_dtype: str | None = None) -> MixedPrecisionPolicy:
    """FSDP's policy for Lightning's precision: bf16 compute / fp32 reduction under ``bf16-mixed``, else none;
    ``reduce_dtype`` (``grad_reduce_dtype``: ``"bf16"`` / ``"fp16"``) replaces the reduction's dtype."""
    dtype = torch_reduce_dtype(reduce_dtype)
    if getattr(precision, "precision", None) == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=dtype or torch.float32)
    return MixedPrecisionPolicy(reduce_dtype=dtype)


def apply_fsdp(
    module: nn.Module,
    blocks: Iterable[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    pp: int,
    precision: Precision,
    reduce_dtype: str | None = None,
    reshard_after_forward: bool | None = None,
    reshard_after_backward: bool = False,
    unit: str = "block",
) -> nn.Module:
    """Shard a stage module over ``dp_mesh`` with FSDP2: its units below the root first (:func:`fsdp_units`: each
    block, or under ``unit="submodule"`` each parameter-owning submodule of a block, then what the block has left),
    then the stage module itself.

    Args:
        module: the stage's module, already tensor-parallel (and compiled, when asked).
        blocks: the blocks this stage holds (submodules of ``module``), in forward order: each its own FSDP unit
            where it can be (``data_parallel.bucket_units``' rule), or split further under ``unit="submodule"``.
        dp_mesh: the 1-D data-parallel sub-mesh (of the (dp, pp, tp) root mesh), or under HSDP the 2-D
            ``("dp_replicate", "dp_shard")`` one (shard over the second, replicate over the first).
        pp: the pipeline degree (``reshard_after_forward`` is ``False`` under a pipeline, see the module text).
        precision: Lightning's precision plugin (decides the mixed-precision policy).
        reduce_dtype: ``grad_reduce_dtype``: the gradient reduce-scatter's dtype (``None``: the policy's).
        reshard_after_forward: the ``fsdp_reshard_after_forward`` setting: ``None`` chooses by ``pp`` (above).
        reshard_after_backward: the ``fsdp_reshard_after_backward`` setting (ZeRO-3 under micro-batches): mark the
            stage so that every micro-batch's backward reshards each unit and reduce-scatters its gradients
            (``pipeline._Stage``), and turn FSDP2's implicit backward prefetch off (see the module text).
        unit: the ``fsdp_unit`` setting: ``"block"`` or ``"submodule"`` (see :func:`fsdp_units`).

    Returns:
        The stage module (``fully_shard`` works in place and returns it).

    Raises:
        ValueError: dp is 1 (nothing to shard over; ``ThreeDSettings`` refuses it earlier).
    """
    if dp_mesh.size() == 1:
        raise ValueError("lightning_3d: data_parallel='fsdp' needs dp > 1 (nothing to shard over at dp=1).")
    policy = mixed_precision_policy(precision, reduce_dtype)
    reshard = reshard_after_forward
    if reshard is None:
        reshard = False if pp > 1 else None  # None: torch's default (blocks reshard after forward, the root not)
    for sub in fsdp_units(module, blocks, unit):
        fully_shard(sub, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    if reduce_dtype is not None:  # sum micro-batches in the gradients' dtype, reduce in the narrower one
        torch_compat.accumulate_unreduced_grads_as_computed(module)
    setattr(module, FSDP_ATTR, True)
    if reshard_after_backward:
        setattr(module, RESHARD_AFTER_BACKWARD_ATTR, True)
        no_backward_prefetch(module)
    return module


def fsdp_units(module: nn.Module, blocks: Sequence[nn.Module], unit: str = "block") -> list[nn.Module]:
    """The modules to ``fully_shard`` below the stage root, in wrapping order (inner units before the module that
    holds them); the root takes every parameter left.

    ``unit="block"``: each block that can be its own unit by the rule of ``replicate``'s gradient buckets
    (``data_parallel.bucket_units``: it has parameters, is listed once, and shares none with a module outside it).
    ``unit="submodule"``: inside each block (listed once), every submodule that directly owns parameters (a
    ``Linear``, an ``Embedding``, a ``LayerNorm``, ...) children before parents, under the same rule applied over
    the whole stage module: a submodule whose parameter is also registered on a module outside it (a tied weight)
    or that is registered twice (so runs twice per forward) is no unit of its own, and its parameters fall to the
    next unit up (the block, or the root). Then the block itself, only if it still holds parameters that none of its
    submodule units took (a parameter it registers directly, or a weight its submodules share).

    Args:
        module: the stage module (the root unit).
        blocks: its blocks, in forward order.
        unit: ``"block"`` or ``"submodule"`` (the ``fsdp_unit`` setting).

    Returns:
        The units, each to be wrapped before the ones after it.

    Raises:
        ValueError: ``unit`` is neither (``ThreeDSettings`` refuses it earlier).
    """
    if unit not in FSDP_UNITS:
        raise ValueError(f"lightning_3d: fsdp_unit must be one of {FSDP_UNITS}, got {unit!r}.")
    if unit == "block":
        return bucket_units(module, blocks)
    units: list[nn.Module] = []
    for block in blocks:
        if sum(b is block for b in blocks) > 1:
            continue  # run twice per forward: its parameters stay with the root (bucket_units' rule)
        owners = [m for m in _children_first(block) if m is not block and _owns_parameters(m)]
        inner = bucket_units(module, owners)
        taken = {id(p) for sub in inner for p in sub.parameters()}
        units += inner
        if any(id(p) not in taken for p in block.parameters()) and bucket_units(module, [block]):
            units.append(block)
    return units


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and every module under it, each after its children (post-order); a module registered under two
    names comes twice (``bucket_units`` then leaves it to the unit above)."""
    for child in torch_compat.child_modules(module).values():
        if child is not None:
            yield from _children_first(child)
    yield module


def no_backward_prefetch(module: nn.Module) -> None:
    """Turn off FSDP2's implicit backward prefetch for every unit under ``module``.

    By default a unit's pre-backward all-gathers the unit that ran before it in the forward, so two units are
    gathered while one computes its backward. FSDP2's public ``set_modules_to_backward_prefetch`` replaces that
    default with an explicit list, and an empty list means "the default": each unit is given itself instead,
    which is gathered already when its pre-backward runs (the prefetch finds nothing to do).
    """
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_modules_to_backward_prefetch([sub])


def reshard_after_eval(modules: Iterable[nn.Module]) -> None:
    """Put the parameters of FSDP-sharded stage modules back in their sharded form after a forward-only batch.

    Without resharding, parameters gathered by an evaluation forward (``reshard_after_forward=False``) would stay
    whole; the optimizer and checkpoints must see the sharded ones.
    """
    for module in modules:
        if getattr(module, FSDP_ATTR, False) and isinstance(module, FSDPModule):
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()
