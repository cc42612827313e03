"""How much each micro-batch's loss counts: its share of the batch's samples, or of the batch's label tokens.

The user's step returns a mean loss per micro-batch. Weighted by the micro-batch's share of the batch's samples
(and data-parallel replicas averaged), the summed gradients are those of the batch's mean loss when every sample
counts the same. A Hugging Face language model's loss is a mean over the *label tokens* that are not ignored
(``labels == -100``: padding, prompt tokens): a micro-batch of short answers counts as much as one of long ones
under sample weighting, so the gradients, and the logged loss, differ from one device's on the same batch (by a few
percent at the padding fine-tuning batches have). Weighting micro-batch ``k`` of replica ``r`` by ``c_rk / C``,
its label tokens over the global batch's, gives exactly one device's token mean, as Hugging Face's Trainer does
with ``num_items_in_batch``:

* gradients: the loss times ``c_rk * dp / C`` (the data-parallel reduction then averages over the ``dp``
  replicas), times the step's scale (``1 / accumulate_grad_batches``, the fp16 loss scale);
* logs: the loss the step returns, and every mean it logs without a ``batch_size`` (``self.log("val_loss", ...)``,
  a token accuracy), enter the batch's mean with ``c_rk * W / C`` in place of the micro-batch's samples, ``W`` the
  global batch's samples, so that the combination over micro-batches and replicas (``log_relay``) is the token
  mean; Lightning still averages batches by their samples. A value logged with ``batch_size=`` is weighted by it.
* a micro-batch without label tokens (its mean is 0 / 0 = NaN) counts for nothing, as in one device's mean.

``C`` sums the replicas' counts: one all-reduce of a device scalar over the last stage's data-parallel group per
batch (no host synchronisation). Which tokens count follows Hugging Face's Trainer: a ``shift_labels`` entry as
given; else ``labels``, shifted by one (``labels[..., 1:]``) when the model's loss is a causal LM's (its
``loss_type`` maps to ``ForCausalLMLoss``, and it is not an encoder-decoder), as that loss shifts them. Under
``"auto"`` only models whose own loss is a token mean are weighted so (a sequence classifier's loss is a mean
over samples, whatever the batch's ``labels`` hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel.hf_plan import find_hf_models

IGNORE_INDEX = -100
LOSS_WEIGHTINGS = ("auto", "samples", "labels", "shifted_labels")


@dataclass(frozen=True)
class LabelCount:
    """How a batch's label tokens are counted: ``labels[..., 1:]`` when ``shifted``, else ``labels``; a
    ``shift_labels`` entry wins as it is."""

    shifted: bool

    def per_micro_batch(self, batch: Any, n_micro: int) -> torch.Tensor | None:
        """The label tokens (not ``-100``) of each of the ``n_micro`` equal micro-batches of ``batch``, as an int64
        device tensor of shape ``(n_micro,)``; ``None`` when the batch is no mapping with a label tensor."""
        if not isinstance(batch, Mapping):
            return None
        labels = batch.get("shift_labels")
        shifted = False
        if not isinstance(labels, torch.Tensor):
            labels, shifted = batch.get("labels"), self.shifted
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0 or labels.shape[0] % n_micro:
            return None
        if shifted and labels.dim() >= 2:
            labels = labels[..., 1:]
        per_sample = labels.ne(IGNORE_INDEX).reshape(labels.shape[0], -1).sum(1)
        return per_sample.view(n_micro, -1).sum(1)


def label_count_for(module: nn.Module, weighting: str) -> LabelCount | None:
    """How ``module``'s batches' label tokens are counted under ``weighting`` (``None``: by samples).

    ``"auto"`` counts them for a module holding a Hugging Face model whose loss is a mean over label tokens (causal
    and masked LMs, token classifiers; its loss type says whether they shift) and weights by samples otherwise;
    ``"labels"`` / ``"shifted_labels"`` count them for any module whose batches hold ``labels``."""
    if weighting == "samples":
        return None
    if weighting in ("labels", "shifted_labels"):
        return LabelCount(shifted=weighting == "shifted_labels")
    kinds = {_token_loss(model) for _, model in find_hf_models(module)}
    if len(kinds) != 1 or None in kinds:  # no Hugging Face model, a per-sample loss, or models that disagree
        return None
    return LabelCount(shifted=kinds.pop() == "shifted")


def _token_loss(model: nn.Module) -> str | None:
    """``"shifted"`` / ``"aligned"`` when the model's own loss is a mean over its label tokens (a causal LM's,
    which compares position i with label i + 1 unless the model is an encoder-decoder, Hugging Face's Trainer's
    rule; a masked LM's; a token classifier's), ``None`` for any other loss (a sequence classifier's is a mean
    over samples: the batch's ``labels`` may be anything else the step turns into its labels)."""
    try:
        from transformers.loss import loss_utils
    except ImportError:  # transformers without the loss registry (before 4.46): a causal LM by the class name
        return "shifted" if type(model).__name__.endswith("ForCausalLM") else None
    loss = loss_utils.LOSS_MAPPING.get(getattr(model, "loss_type", None))
    if loss is loss_utils.ForCausalLMLoss:
        return "aligned" if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else "shifted"
    if loss in (loss_utils.ForMaskedLMLoss, getattr(loss_utils, "ForTokenClassification", None)):
        return "aligned"
    return None


@dataclass(frozen=True)
class MicroBatchWeights:
    """One batch's weights per micro-batch (device tensors of shape ``(n_micro,)``, float64).

    Attributes:
        grad: what micro-batch ``k``'s loss is multiplied by before its backward (before the step's scale).
        log: what its loss counts for in the batch's logged mean (in place of its samples).
    """

    grad: torch.Tensor
    log: torch.Tensor


def micro_batch_weights(
    counts: torch.Tensor, samples: int, dp: int, dp_group: dist.ProcessGroup | None
) -> MicroBatchWeights:
    """The weights for label counts ``counts`` of this replica's micro-batches (``samples``: the replica's batch).

    Collective over ``dp_group`` (the last stage's data-parallel group; ``None`` when dp == 1). A global batch
    without any label token gets weight 0 everywhere (one device's loss would be 0 / 0)."""
    total = counts.sum().to(torch.float64)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    share = counts.to(torch.float64) / total.clamp(min=1.0)
    return MicroBatchWeights(grad=share * dp, log=share * (samples * dp))
