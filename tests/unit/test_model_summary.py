"""``core/model_summary.py``: Lightning's model summary of a split model shows the unsplit model's, as one device."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from torch import nn

from lightning_3d.core.boundary_check import make_skeleton
from lightning_3d.core.model_summary import summary_view, whole_model_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import NanoGPT


class Kept(ModelSummary):
    """The summary Lightning would print, kept (every module's row)."""

    def __init__(self) -> None:
        super().__init__(max_depth=-1, sink={})

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, sink, **kwargs) -> None:  # fmt: skip
        sink.update(
            rows=dict(summary_data), total=total_parameters, trainable=trainable_parameters,
            modes=dict(total_training_modes), flops=total_flops,
        )  # fmt: skip

    @property
    def kept(self) -> dict[str, Any]:
        return self._summarize_kwargs["sink"]


RANK0 = SimpleNamespace(is_global_zero=True, strategy=None)


def lightning_summary(module: nn.Module) -> dict[str, Any]:
    """What Lightning prints for ``module`` on one device."""
    callback = Kept()
    callback.on_fit_start(RANK0, module)
    return callback.kept


class StandIn(nn.Module):
    """In place of a module another pipeline rank holds (no parameters, like the strategy's stand-ins)."""


def first_stage_of(model: NanoGPT) -> NanoGPT:
    """``model`` as rank 0 holds it at pp = 2: the last two blocks, the final norm and the head stood in for."""
    split = copy.deepcopy(model)
    for name in ("transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"):
        parent, _, leaf = name.rpartition(".")
        setattr(split.get_submodule(parent), leaf, StandIn())
    return split


def nano(example: bool = True) -> NanoGPT:
    torch.manual_seed(0)
    model = NanoGPT(build="init", example=example)
    model.transformer.wpe.weight.requires_grad_(False)  # counted as non-trainable
    model.transformer.drop.eval()  # counted in eval mode
    return model


def test_the_view_of_a_split_model_is_summarised_as_the_whole_model() -> None:
    model = nano()
    want = lightning_summary(model)  # one device, with the example: sizes and FLOPs
    assert want["flops"] > 0 and "In sizes" in want["rows"]
    skeleton = make_skeleton(model)
    split = first_stage_of(model)
    split.example_input_array = None  # (the strategy holds it while it fits)
    assert lightning_summary(split)["total"] < want["total"]  # what rank 0 printed before
    callback = Kept()
    undo = whole_model_summary([callback], split, skeleton, model.example_input_array)
    assert undo is not None
    callback.on_fit_start(RANK0, split)
    assert callback.kept == want
    undo()
    assert "on_fit_start" not in callback.__dict__
    callback.on_fit_start(RANK0, split)
    assert callback.kept["total"] < want["total"]


def test_the_flags_are_the_running_modules_where_the_rank_holds_them() -> None:
    model = nano(example=False)
    skeleton = make_skeleton(model)  # taken at setup
    split = first_stage_of(model)
    split.transformer.wte.weight.requires_grad_(False)  # frozen since (a finetuning callback), held here
    split.transformer.h[0].eval()
    view = summary_view(skeleton, split)
    assert view is not None
    assert not view.transformer.wte.weight.requires_grad and not view.transformer.h[0].training
    assert not view.transformer.h[0].q_proj.training  # (each module's own flag: eval() set the children's)
    assert view.lm_head.weight.requires_grad and view.transformer.ln_f.training  # held elsewhere: as at setup
    assert type(view.lm_head) is nn.Linear  # the skeleton's module, not the stand-in
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.h[0].eval()
    assert lightning_summary(view) == lightning_summary(model)


def test_a_forward_that_cannot_run_on_fake_tensors_leaves_out_the_sizes() -> None:
    class ReadsValues(NanoGPT):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            if idx.max().item() >= self.vocab:  # a data-dependent check: no value on fake tensors
                raise ValueError("token out of range")
            return super().forward(idx)

    torch.manual_seed(0)
    model = ReadsValues(build="init", example=True)
    callback = Kept()
    whole_model_summary([callback], first_stage_of(model), make_skeleton(model), model.example_input_array)
    callback.on_fit_start(RANK0, model)
    model.example_input_array = None
    want = lightning_summary(model)  # the table without sizes and FLOPs
    assert callback.kept == want and "In sizes" not in want["rows"]


def test_nothing_changes_without_a_skeleton_or_a_summary_callback() -> None:
    rich = RichModelSummary()
    assert whole_model_summary([rich], nano(), "the model could not be copied", None) is None
    assert "on_fit_start" not in rich.__dict__
    assert whole_model_summary([object()], nano(), make_skeleton(nano()), None) is None
