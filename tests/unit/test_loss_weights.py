"""Label-token weighting: which tokens count, the weights' arithmetic, and a micro-batch without labels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_3d.core.log_relay import StepLogs
from lightning_3d.core.loss_weights import LabelCount, label_count_for, micro_batch_weights
from lightning_3d.core.step import micro_batch_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import hf_config

LABELS = torch.tensor([[-100, 1, 2, -100], [5, 6, 7, 8], [-100, -100, -100, 9], [-100, -100, -100, -100]])


def test_labels_count_per_micro_batch_shifted_or_not() -> None:
    batch = {"input_ids": torch.zeros(4, 4), "labels": LABELS}
    assert LabelCount(shifted=False).per_micro_batch(batch, 2).tolist() == [6, 1]
    assert LabelCount(shifted=True).per_micro_batch(batch, 2).tolist() == [5, 1]  # position 0 is never a target
    assert LabelCount(shifted=False).per_micro_batch(batch, 4).tolist() == [2, 4, 1, 0]
    # a collator's shift_labels are the targets as they are, shifted or not
    pre = {"labels": LABELS, "shift_labels": LABELS[:, :3]}
    assert LabelCount(shifted=True).per_micro_batch(pre, 2).tolist() == [5, 0]
    # one label per sample (classification): the samples
    assert LabelCount(shifted=True).per_micro_batch({"labels": torch.tensor([0, 3, -100, 1])}, 2).tolist() == [2, 1]


@pytest.mark.parametrize(
    "batch", [(torch.zeros(4, 4), LABELS), {"input_ids": torch.zeros(4, 4)}, {"labels": [1, 2]}, {"labels": LABELS[:3]}]
)
def test_batches_without_countable_labels_are_weighted_by_samples(batch: object) -> None:
    assert LabelCount(shifted=False).per_micro_batch(batch, 2) is None  # a tuple, no labels, a list, 3 rows / 2


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_auto_counts_for_a_hugging_face_model_shifted_as_its_loss() -> None:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        BertConfig,
    )

    causal = Holder(AutoModelForCausalLM.from_config(hf_config("llama", layers=1)))
    classifier = Holder(AutoModelForSequenceClassification.from_config(hf_config("llama", layers=1)))
    assert label_count_for(causal, "auto") == LabelCount(shifted=True)
    # a sequence classifier's loss is a mean over samples: its batch's labels may be anything (token ids, below)
    assert label_count_for(classifier, "auto") is None
    bert = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    assert label_count_for(Holder(AutoModelForMaskedLM.from_config(bert)), "auto") == LabelCount(shifted=False)
    assert label_count_for(Holder(AutoModelForTokenClassification.from_config(bert)), "auto") == LabelCount(False)
    assert label_count_for(nn.Linear(2, 2), "auto") is None  # no Hugging Face model: by samples
    assert label_count_for(causal, "samples") is None
    assert label_count_for(nn.Linear(2, 2), "labels") == LabelCount(shifted=False)
    assert label_count_for(nn.Linear(2, 2), "shifted_labels") == LabelCount(shifted=True)


def test_weights_give_the_token_mean_of_the_whole_batch() -> None:
    counts = torch.tensor([6, 1, 3])
    weights = micro_batch_weights(counts, samples=6, dp=1, dp_group=None)
    losses = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)  # each micro-batch's token mean
    token_mean = float((losses * counts).sum() / counts.sum())
    assert float((weights.grad * losses).sum()) == pytest.approx(token_mean)  # the gradients' weights
    assert float((weights.log * losses).sum() / 6) == pytest.approx(token_mean)  # the logs' weights over 6 samples
    none = micro_batch_weights(torch.tensor([0, 0]), samples=2, dp=1, dp_group=None)
    assert none.grad.tolist() == [0.0, 0.0] and none.log.tolist() == [0.0, 0.0]  # no labels at all: no NaN


def test_a_micro_batch_without_labels_counts_for_nothing() -> None:
    """Its mean loss is 0 / 0 = NaN; one device never sees it (the batch's mean has labels)."""
    logits = torch.randn(2, 5, requires_grad=True)
    nan_loss = nn.functional.cross_entropy(logits, torch.tensor([-100, -100]))
    logs = StepLogs()
    weighted = micro_batch_loss(nan_loss, "training_step", True, logs, [], 2, torch.tensor(0.0), torch.tensor(0.0))
    weighted.backward()
    assert float(weighted) == 0.0 and float(logs.loss_total) == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    logs.add("acc", torch.tensor(float("nan")), {}, 2, None, count_as=torch.tensor(0.0))
    logs.add("acc", torch.tensor(0.5), {}, 2, None, count_as=torch.tensor(4.0))
    assert float(logs.entries["acc"].total / logs.entries["acc"].weight) == pytest.approx(0.5)  # 4 * 0.5 / 4 samples
