"""Lightning's manual optimization (``automatic_optimization = False``) under tensor and data parallelism.

A step that calls ``self.manual_backward(loss)`` and ``opt.step()`` itself (GANs, several optimizers, a custom
accumulation, a second forward after a step) runs the model outside any schedule: the strategy calls
``training_step`` as Lightning's own strategies do, and Lightning's ``manual_backward`` and ``LightningOptimizer``
reach the strategy's ``backward`` and ``optimizer_step`` (gradient clipping over the tensor-parallel shards and FSDP
shards through ``self.clip_gradients``, DTensor parameters stepped over their local tensors).

Two things differ from automatic optimization:

* **pp = 1 only.** A pipeline must own the backward of every micro-batch (the schedule interleaves the stages'
  forwards and backwards); a step that calls backward itself cannot be cut into stages. Refused at setup otherwise.
* **Fresh weights after a step.** FSDP2 may keep a unit's gathered parameters from one forward to the next;
  after each optimizer step every unit is resharded (:func:`reshard_roots`), so a forward after the step (a GAN's
  second) uses the stepped weights.
* **Data-parallel roots.** Automatically, each pipeline stage is one ``replicate`` / FSDP root, called by the
  schedule. Here the step calls the model's modules itself, and FSDP2's root hooks (lazy init, the gradient
  reduction at the end of backward, resharding) run only when the root's own ``forward`` runs, so each module a
  stage holds is a root of its own (:func:`data_parallel_roots`): a LightningModule's children (a generator and a
  discriminator), or a split model's embedding, blocks, norm and head. A weight shared by two of them, or a
  parameter of the LightningModule itself, is refused: no root could own it.

The non-finite agreement (``on_nonfinite``) and fp16 loss scaling belong to the schedule's one exchange per batch:
the first does not apply here, the second (``16-mixed``) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

MANUAL_PIPELINE = (
    "ThreeDStrategy: this LightningModule uses manual optimization (automatic_optimization = False), which runs "
    "backward inside training_step; under pipeline parallelism the schedule must run every micro-batch's backward, "
    "interleaved over the stages, so manual optimization works at pp=1 only (tensor and data parallelism: "
    "ThreeDStrategy(tp=..., pp=1)). Use pp=1, or automatic optimization (return the loss from training_step)."
)
MANUAL_FP16 = (
    "ThreeDStrategy: manual optimization with precision='16-mixed' is not supported: the loss scale is agreed in "
    "the pipeline schedule's exchange, which manual optimization does not run. Use bf16-mixed (no loss scaling) or "
    "automatic optimization."
)


def manual_problem(pp: int, loss_scaling: bool) -> str | None:
    """Why this layout cannot run manual optimization (``None``: it can)."""
    if pp > 1:
        return MANUAL_PIPELINE
    if loss_scaling:
        return MANUAL_FP16
    return None


def data_parallel_roots(held: Sequence[nn.Module], owner: nn.Module | None = None) -> list[nn.Module]:
    """The modules to wrap as data-parallel roots of their own under manual optimization: each of ``held`` (a
    stage's modules) that has parameters, or, when ``owner`` is given (one stage holding the whole LightningModule),
    ``owner``'s children that have parameters.

    Raises:
        ValueError: ``owner`` has parameters of its own, or a parameter belongs to two roots.
    """
    if owner is not None:
        direct = [name for name, _ in owner.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"ThreeDStrategy: under manual optimization with data parallelism each child module of the "
                f"LightningModule is wrapped on its own, and the LightningModule itself holds parameters "
                f"({', '.join(direct)}). Move them into a submodule."
            )
        held = list(owner.children())
    roots = [m for m in held if any(True for _ in m.parameters())]
    seen: dict[int, int] = {}
    for index, root in enumerate(roots):
        for param in root.parameters():
            other = seen.setdefault(id(param), index)
            if other != index:
                raise ValueError(
                    "ThreeDStrategy: under manual optimization with data parallelism each module the step calls is "
                    f"wrapped on its own, and a parameter is shared by {type(roots[other]).__name__} and "
                    f"{type(root).__name__} (a tied weight). Use automatic optimization, or untie it."
                )
    return roots


def reshard_roots(module: nn.Module) -> None:
    """After an optimizer step: let every ``replicate`` / FSDP unit drop the gathered copy of its parameters, so the
    step's next forward (the GAN's second, say) gathers the stepped ones. FSDP2 keeps a unit gathered between
    forwards when no backward resharded it (``replicate`` always: its gathered copy is a copy even over one rank),
    and a unit frozen by ``toggle_optimizer`` sees no backward at all."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
