"""``core/manual.py``: what manual optimization refuses, and which modules become data-parallel roots."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_3d.core.manual import MANUAL_FP16, MANUAL_PIPELINE, data_parallel_roots, manual_problem


def test_manual_problem_names_the_pipeline_and_fp16() -> None:
    assert manual_problem(1, False) is None
    assert manual_problem(2, False) == MANUAL_PIPELINE
    assert manual_problem(1, True) == MANUAL_FP16


class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
        self.dropout = nn.Dropout(0.1)  # no parameters: not a root


def test_the_owners_children_with_parameters_are_the_roots() -> None:
    gan = Gan()
    assert data_parallel_roots([gan], owner=gan) == [gan.generator, gan.discriminator]
    held = [gan.generator, gan.dropout, gan.discriminator]
    assert data_parallel_roots(held) == [gan.generator, gan.discriminator]


def test_a_parameter_no_single_root_can_own_is_refused() -> None:
    gan = Gan()
    gan.scale = nn.Parameter(gan.generator.weight.new_ones(()))
    with pytest.raises(ValueError, match=r"holds parameters \(scale\)"):
        data_parallel_roots([gan], owner=gan)
    tied = Gan()
    tied.discriminator.weight = nn.Parameter(tied.generator.weight[:1].detach().clone())
    tied.discriminator.bias = tied.generator.bias
    with pytest.raises(ValueError, match="shared by Linear and Linear"):
        data_parallel_roots([tied], owner=tied)
