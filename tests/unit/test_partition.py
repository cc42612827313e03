"""Finding the body, assigning its layers to stages, pruning and the full model's spec."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from lightning_3d.core.partition import (
    PARTITIONERS,
    OnAnotherStage,
    ParameterPartitioner,
    StagePlan,
    TensorSpec,
    UniformPartitioner,
    check_no_outside_parameters,
    find_body,
    full_model_spec,
    get_partitioner,
    plan_stages,
    prune_body,
    stage_container,
)


def lin(n_in: int = 4, n_out: int = 4) -> nn.Linear:
    return nn.Linear(n_in, n_out)  # n_in * n_out + n_out parameters


def layers_of(seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    return list(seq.named_children())


class Holder(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


# ------------------------------------------------------------------------------------ UniformPartitioner
MIXED = nn.Sequential(lin(), nn.ReLU(), lin(), nn.Dropout(), lin(), lin())  # units: [0, 1], [2, 3], [4], [5]


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (1, [range(0, 6)]),
        (2, [range(0, 4), range(4, 6)]),
        (3, [range(0, 4), range(4, 5), range(5, 6)]),  # 4 units: the first stage takes the extra one
        (4, [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]),
    ],
)
def test_uniform_keeps_parameter_free_layers_with_the_layer_before(stages: int, expected: list[range]) -> None:
    assert UniformPartitioner()(layers_of(MIXED), stages) == expected


def test_uniform_spreads_the_remainder_over_the_first_stages() -> None:
    body = nn.Sequential(*[lin() for _ in range(7)])
    assert UniformPartitioner()(layers_of(body), 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_uniform_leading_parameter_free_layers_join_the_next_layer() -> None:
    body = nn.Sequential(nn.Identity(), nn.ReLU(), lin(), lin())
    assert UniformPartitioner()(layers_of(body), 2) == [range(0, 3), range(3, 4)]


def test_uniform_fewer_layers_with_parameters_than_stages_raises() -> None:
    with pytest.raises(ValueError) as info:
        UniformPartitioner()(layers_of(MIXED), 5)
    assert "The body has 4 layers with parameters (6 entries) but 5 pipeline stages" in str(info.value)
    assert "Use pp <= 4." in str(info.value)


def test_uniform_on_a_body_without_parameters() -> None:
    body = nn.Sequential(nn.ReLU(), nn.Tanh())
    assert UniformPartitioner()(layers_of(body), 1) == [range(0, 2)]
    with pytest.raises(ValueError, match="but 2 pipeline stages were asked for"):
        UniformPartitioner()(layers_of(body), 2)


# ------------------------------------------------------------------------------------ ParameterPartitioner
def test_parameter_partitioner_balances_by_parameter_count() -> None:
    body = nn.Sequential(lin(299, 1), lin(99, 1), lin(99, 1), lin(99, 1))  # 300, 100, 100, 100 parameters
    assert ParameterPartitioner()(layers_of(body), 2) == [range(0, 1), range(1, 4)]
    assert UniformPartitioner()(layers_of(body), 2) == [range(0, 2), range(2, 4)]  # the contrast


def test_parameter_partitioner_equal_layers_split_evenly() -> None:
    body = nn.Sequential(*[lin() for _ in range(6)])
    assert ParameterPartitioner()(layers_of(body), 3) == [range(0, 2), range(2, 4), range(4, 6)]


def test_parameter_partitioner_leaves_a_layer_for_every_later_stage() -> None:
    # 1 + 1 + 1 + 1000 parameters: the first stage would like all small layers but must leave one each
    body = nn.Sequential(nn.Linear(1, 1, bias=False), nn.ReLU(), nn.Linear(1, 1, bias=False), lin(999, 1))
    ranges = ParameterPartitioner()(layers_of(body), 3)
    assert ranges == [range(0, 2), range(2, 3), range(3, 4)]


def test_parameter_partitioner_counts_what_the_end_stages_hold_besides_their_layers() -> None:
    """A model split at its blocks: the first stage also holds the embeddings (an encoder-decoder's whole encoder)
    and the last the head; they count towards those stages' shares, still at least one layer each."""
    body = nn.Sequential(*[lin() for _ in range(4)])  # 4 x 16 parameters
    assert ParameterPartitioner(first=32)(layers_of(body), 2) == [range(0, 1), range(1, 4)]
    assert ParameterPartitioner(last=32)(layers_of(body), 2) == [range(0, 3), range(3, 4)]
    assert ParameterPartitioner(first=10_000)(layers_of(body), 3) == [range(0, 1), range(1, 3), range(3, 4)]
    assert ParameterPartitioner(first=16, last=16)(layers_of(body), 2) == ParameterPartitioner()(layers_of(body), 2)


def test_the_parameter_partitioner_counts_an_encoder_decoders_encoder_on_the_first_stage() -> None:
    """T5 split at its decoder's 4 blocks: the encoder (and the shared embedding) sit on the first stage, which
    took two of the decoder's blocks like the second stage; now one."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lightning_3d.core.parallelize import plan_model

    from models import HFEncoder

    module = HFEncoder("t5")
    module.configure_model()
    assert plan_model(module, tp=1, pp=2, partitioner="uniform").split.stage_blocks == [["0", "1"], ["2", "3"]]
    split = plan_model(module, tp=1, pp=2, partitioner="parameters").split
    assert split.stage_blocks == [["0"], ["1", "2", "3"]] and "model.encoder" in split.first


def test_every_partitioner_covers_all_layers_contiguously() -> None:
    body = nn.Sequential(lin(8, 8), nn.GELU(), lin(8, 2), lin(2, 2), nn.ReLU(), lin(2, 30), lin(30, 3))
    for name, cls in PARTITIONERS.items():
        for stages in (1, 2, 3, 4):
            # the profiling partitioners run the body on an example input (on the meta device)
            part = cls(torch.zeros(2, 8)) if name in ("compute", "memory") else cls()
            ranges = part(layers_of(body), stages)
            assert len(ranges) == stages, name
            assert [i for r in ranges for i in r] == list(range(len(body))), (name, ranges)
            assert all(len(r) > 0 for r in ranges), (name, ranges)


# ------------------------------------------------------------------------------------ get_partitioner
def test_get_partitioner_by_name_and_callable() -> None:
    assert isinstance(get_partitioner("uniform"), UniformPartitioner)
    assert isinstance(get_partitioner("parameters"), ParameterPartitioner)

    def custom(layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        return [range(len(layers))]

    assert get_partitioner(custom) is custom


def test_get_partitioner_unknown_name() -> None:
    with pytest.raises(ValueError) as info:
        get_partitioner("balanced")
    assert str(info.value) == (
        "Unknown partitioner 'balanced'; choose one of ['compute', 'memory', 'parameters', 'uniform'] "
        "or pass a callable."
    )


# ------------------------------------------------------------------------------------ find_body
def test_find_body_the_single_outermost_sequential() -> None:
    inner = nn.Sequential(lin(), nn.ReLU())
    root = Holder(body=nn.Sequential(lin(), inner, lin()))
    ref = find_body(root)
    assert (ref.fqn, ref.attr) == ("body", "body")
    assert ref.parent is root and ref.module is root.body


def test_find_body_nested_attribute() -> None:
    model = Holder(layers=nn.Sequential(lin(), lin()))
    root = Holder(model=model)
    ref = find_body(root)
    assert (ref.fqn, ref.attr) == ("model.layers", "layers")
    assert ref.parent is model and ref.module is model.layers
    assert find_body(root, "model.layers").module is model.layers


def test_find_body_without_a_sequential() -> None:
    with pytest.raises(ValueError, match=r"Holder has no nn\.Sequential submodule\. lightning_3d needs"):
        find_body(Holder(a=lin()))


def test_find_body_with_several_sequentials_names_them() -> None:
    root = Holder(enc=nn.Sequential(lin()), dec=nn.Sequential(lin()))
    with pytest.raises(ValueError, match=r"several nn.Sequential submodules \(enc, dec\); say which one"):
        find_body(root)
    assert find_body(root, "dec").module is root.dec


def test_find_body_by_name_errors() -> None:
    root = Holder(body=nn.Sequential(lin()), head=lin())
    with pytest.raises(ValueError, match=r"ThreeDStrategy\(body='nope'\): the module has no submodule 'nope'"):
        find_body(root, "nope")
    with pytest.raises(ValueError, match=r"'head' is a Linear, not an nn.Sequential"):
        find_body(root, "head")


def test_find_body_empty_sequential() -> None:
    with pytest.raises(ValueError, match=r"The body \'body\' is an empty nn\.Sequential"):
        find_body(Holder(body=nn.Sequential()))


# ------------------------------------------------------------------------------------ outside parameters
def test_no_outside_parameters_passes_and_buffers_outside_are_fine() -> None:
    root = Holder(body=nn.Sequential(lin()))
    root.register_buffer("scale", torch.ones(1))
    check_no_outside_parameters(root, find_body(root))


def test_outside_parameters_are_named() -> None:
    root = Holder(body=nn.Sequential(lin()), head=lin())
    with pytest.raises(ValueError, match=r"Parameters outside the body 'body': head.weight, head.bias. Under"):
        check_no_outside_parameters(root, find_body(root))


def test_outside_parameters_list_is_cut_after_eight() -> None:
    root = Holder(body=nn.Sequential(lin()), extra=nn.ModuleList(lin() for _ in range(5)))  # 10 parameters
    with pytest.raises(ValueError) as info:
        check_no_outside_parameters(root, find_body(root))
    shown = str(info.value).split("'body': ")[1].split(". Under")[0]
    assert shown.endswith(" ...")
    assert shown.removesuffix(" ...").split(", ") == [f"extra.{i}.{p}" for i in range(4) for p in ("weight", "bias")]


def test_prefix_match_is_on_the_dotted_name() -> None:
    # "body2.weight" starts with "body" but is not inside "body"
    root = Holder(body=nn.Sequential(lin()), body2=lin())
    with pytest.raises(ValueError, match=r"body2\.weight"):
        check_no_outside_parameters(root, find_body(root, "body"))


# ------------------------------------------------------------------------------------ plan_stages
def test_plan_stages_names_and_ranks() -> None:
    root = Holder(body=nn.Sequential(lin(), nn.ReLU(), lin(), lin()))
    plan = plan_stages(find_body(root), pp=2, partitioner=UniformPartitioner())
    assert plan.layer_names == [["0", "1", "2"], ["3"]]
    assert plan.stage_to_rank == [0, 1]
    assert plan.num_stages == 2 and plan.body_fqn == "body"


def test_plan_stages_loops_stages_over_pp_ranks() -> None:
    root = Holder(body=nn.Sequential(*[lin() for _ in range(8)]))
    plan = plan_stages(find_body(root), pp=2, partitioner=UniformPartitioner(), stages_per_rank=2)
    assert plan.layer_names == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert plan.stage_to_rank == [0, 1, 0, 1]


def test_plan_stages_more_stages_than_layers() -> None:
    root = Holder(body=nn.Sequential(lin(), lin(), lin()))
    with pytest.raises(ValueError, match=r"has 3 layers but 4 pipeline stages were asked for \(pp=4\).*pp <= 3"):
        plan_stages(find_body(root), pp=4, partitioner=UniformPartitioner())
    with pytest.raises(ValueError, match=r"\(pp=2 x 2 stages per rank\).*Use pp <= 1,"):
        plan_stages(find_body(root), pp=2, partitioner=UniformPartitioner(), stages_per_rank=2)


@pytest.mark.parametrize(
    "bad",
    [
        [range(0, 4)],  # too few ranges
        [range(0, 2), range(3, 4)],  # a gap
        [range(0, 3), range(2, 4)],  # overlap
        [range(2, 4), range(0, 2)],  # out of order
        [range(0, 4), range(4, 4)],  # an empty stage
    ],
)
def test_plan_stages_refuses_a_bad_custom_partitioner(bad: list[range]) -> None:
    root = Holder(body=nn.Sequential(*[lin() for _ in range(4)]))

    def partitioner(layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        return bad

    with pytest.raises(ValueError, match=r"expected 2 contiguous non-empty ranges covering layers 0..3 in order"):
        plan_stages(find_body(root), pp=2, partitioner=partitioner)


def test_stage_plan_describe() -> None:
    plan = StagePlan([["0", "1"], ["2"]], "model.body", [0, 1])
    assert plan.describe().splitlines() == [
        "  stage 0 on pp rank 0: model.body[0, 1]",
        "  stage 1 on pp rank 1: model.body[2]",
    ]
    assert StagePlan([["0"]]).describe() == "  stage 0: body[0]"


# ------------------------------------------------------------------------------------ pruning
def test_prune_body_keeps_names_and_positions() -> None:
    torch.manual_seed(0)
    root = Holder(body=nn.Sequential(lin(), nn.ReLU(), lin(), lin()))
    kept = [root.body[2], root.body[3]]
    x = torch.randn(3, 4)
    want = root.body[3](root.body[2](x))
    prune_body(find_body(root), ["3", "2"])
    assert list(root.body._modules) == ["0", "1", "2", "3"] and len(root.body) == 4
    # single-device indexing reads the same layers: body[2] / body[-1] are the kept ones, not shifted
    assert [root.body[2], root.body[-1]] == kept
    assert sorted(root.state_dict()) == ["body.2.bias", "body.2.weight", "body.3.bias", "body.3.weight"]
    assert list(root.body[0].parameters()) == [] and isinstance(root.body[1], OnAnotherStage)
    assert "body.0" in repr(root.body[0])
    torch.testing.assert_close(root.body[3](root.body[2](x)), want)
    with pytest.raises(RuntimeError, match=r"body\.0 is held by another pipeline stage"):
        root.body(x)


def test_stage_container_shares_the_layers_under_their_names() -> None:
    root = Holder(body=nn.Sequential(lin(), nn.ReLU(), lin()))
    ref = find_body(root)
    container = stage_container(ref, ["1", "2"])
    assert list(container._modules) == ["1", "2"]
    assert container._modules["2"] is root.body[2]
    assert sorted(container.state_dict()) == ["2.bias", "2.weight"]
    assert len(root.body) == 3  # the body is untouched


# ------------------------------------------------------------------------------------ full_model_spec
class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        self.register_buffer("kept", torch.zeros(2, 5, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(7), persistent=False)


def test_full_model_spec_has_parameters_and_persistent_buffers_only() -> None:
    with torch.device("meta"):
        model = WithBuffers()
    spec = full_model_spec(model)
    assert spec["body.0.weight"] == TensorSpec((3, 4), torch.float32, True)
    assert spec["body.0.bias"] == TensorSpec((3,), torch.float32, True)
    assert spec["kept"] == TensorSpec((2, 5), torch.int64, False)
    assert spec["body.1.num_batches_tracked"] == TensorSpec((), torch.int64, False)
    assert "scratch" not in spec
    assert set(spec) == set(model.state_dict())
