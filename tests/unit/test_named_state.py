"""Layout-independent state: the key report, saved shapes from DCP metadata, and the optimizer state keyed by
parameter name (flattened and back into torch's format)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_3d.checkpoint.named_state import (
    KeyReport,
    compare_keys,
    model_copy_paths,
    optimizer_state_dict,
    optimizer_template,
    param_names,
    pop_path,
    put_path,
    saved_keys,
    saved_model_shapes,
    torch_optimizer_state,
    unsaved_parameters,
)


# ------------------------------------------------------------------------------------ compare_keys
def test_compare_keys_sorts_out_missing_unexpected_and_mismatched() -> None:
    expected = {"body.0.weight": (4, 3), "body.0.bias": (4,), "body.1.weight": (2, 4)}
    saved = {"body.0.weight": (3, 4), "body.1.weight": (2, 4), "body.9.weight": (1,), "extra": None}
    report = compare_keys(expected, saved)
    assert report.missing == ["body.0.bias"]
    assert report.unexpected == ["body.9.weight", "extra"]
    assert report.mismatched == ["body.0.weight: checkpoint (3, 4), model (4, 3)"]
    assert bool(report)


def test_compare_keys_matching_and_non_tensor_entries() -> None:
    assert not compare_keys({"w": (2,), "b": ()}, {"w": (2,), "b": ()})
    assert not compare_keys({"w": (2,)}, {"w": None})  # a non-tensor entry has no shape to compare
    assert not KeyReport()


def test_key_report_message() -> None:
    report = KeyReport(missing=["a"], unexpected=[f"k{i:02d}" for i in range(14)])
    message = report.message("ckpt/last")
    assert message.startswith("lightning_3d: checkpoint 'ckpt/last' does not match the model.")
    assert "Missing keys (in the model, not in the checkpoint): a." in message
    shown = ", ".join(f"k{i:02d}" for i in range(12))
    assert f"Unexpected keys (in the checkpoint, not in the model): {shown} ... (14 in all)." in message
    assert "Shape mismatches: none. Nothing was loaded." in message


# ------------------------------------------------------------------------------------ DCP metadata
def tensor_meta(*size: int, dtype: torch.dtype = torch.float32) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])


def test_saved_model_shapes_reads_only_the_model_prefix() -> None:
    metadata = Metadata(
        {
            "state_dict.body.0.weight": tensor_meta(4, 3),
            "state_dict.body.0.bias": tensor_meta(4),
            "state_dict.note": BytesStorageMetadata(),
            "optimizer_0.state.body.0.weight.exp_avg": tensor_meta(4, 3),
            "state_dict_extra.x": tensor_meta(1),
        }
    )
    assert saved_model_shapes(metadata) == {"body.0.weight": (4, 3), "body.0.bias": (4,), "note": None}


def test_saved_keys_of_a_prefix() -> None:
    metadata = Metadata(
        {
            "state_dict.a.weight": tensor_meta(2),
            "model_copy_0.a.weight": tensor_meta(2),
            "model_copy_0.b.bias": tensor_meta(1),
            "model_copy_10.c": tensor_meta(1),
        }
    )
    assert saved_keys(metadata, "model_copy_0") == {"a.weight", "b.bias"}
    assert saved_keys(metadata, "model_copy_1") == set()


# ------------------------------------------------------------------------------------ other copies of the model
def test_model_copies_are_found_where_lightnings_callbacks_put_them() -> None:
    """EMA's ``current_model_state`` (top level) and SWA's ``average_model_state`` (inside its callback state) are
    state dicts of the model's keys; the model itself, the optimizer, EMA's ``averaging_state`` (not model keys),
    an empty dict, a dict with a non-tensor value and one of other shapes (a statistic per parameter) are not."""
    w = torch.zeros(2)
    checkpoint = {
        "state_dict": {"a.weight": w},
        "optimizer_states": [{"state": {"a.weight": w}}],
        "current_model_state": {"a.weight": w, "b.bias": w},
        "averaging_state": {"n_averaged": torch.tensor(3)},
        "callbacks": {
            "StochasticWeightAveraging{'swa_lrs': 0.1}": {"n_averaged": 2, "average_model_state": {"b.bias": w}},
            "ModelCheckpoint{}": {"best_model_path": "", "kth": {}},
            "Other": {"mixed": {"a.weight": w, "note": 1}, "norms": {"a.weight": torch.tensor(0.5)}},
        },
    }
    shapes = {"a.weight": (2,), "b.bias": (2,)}
    found = model_copy_paths(checkpoint, shapes)
    assert found == [
        ("current_model_state",),
        ("callbacks", "StochasticWeightAveraging{'swa_lrs': 0.1}", "average_model_state"),
    ]
    moved = [pop_path(checkpoint, where) for where in found]
    assert moved[1] == {"b.bias": w} and "current_model_state" not in checkpoint
    assert model_copy_paths(checkpoint, shapes) == []
    for where, value in zip(found, moved, strict=True):
        put_path(checkpoint, where, value)
    assert checkpoint["current_model_state"]["b.bias"] is w
    put_path(checkpoint, ("new", "deeper", "leaf"), 1)
    assert checkpoint["new"] == {"deeper": {"leaf": 1}}


# ------------------------------------------------------------------------------------ optimizer state by name
def model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


def adam(module: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(
        [{"params": list(module[0].parameters()), "lr": 0.1}, {"params": list(module[1].parameters()), "lr": 0.01}]
    )


def stepped() -> tuple[nn.Module, torch.optim.Adam]:
    torch.manual_seed(0)
    module = model()
    opt = adam(module)
    for _ in range(2):
        module(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
    return module, opt


def test_optimizer_state_is_keyed_by_parameter_name() -> None:
    module, opt = stepped()
    flat = optimizer_state_dict(module, opt)
    assert flat["param_groups.0.weight.lr"] == 0.1 and flat["param_groups.1.bias.lr"] == 0.01
    assert torch.equal(flat["state.1.weight.exp_avg"], opt.state[module[1].weight]["exp_avg"])
    assert float(flat["state.0.bias.step"]) == 2.0
    names = {k.split(".")[1] + "." + k.split(".")[2] for k in flat}
    assert names == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_optimizer_that_never_stepped_saves_hyperparameters_only() -> None:
    module = model()
    flat = optimizer_state_dict(module, adam(module))
    assert flat and all(k.startswith("param_groups.") for k in flat)


def test_flattened_state_loads_into_a_fresh_optimizer() -> None:
    module, opt = stepped()
    flat = optimizer_state_dict(module, opt)
    fresh_module = model()
    fresh_module.load_state_dict(module.state_dict())
    fresh = torch.optim.Adam(
        [{"params": list(fresh_module[0].parameters()), "lr": 1.0}, {"params": list(fresh_module[1].parameters())}]
    )
    fresh.load_state_dict(torch_optimizer_state(param_names(fresh_module), fresh, flat))
    assert [g["lr"] for g in fresh.param_groups] == [0.1, 0.01]
    for p, q in zip(module.parameters(), fresh_module.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh.state[q][key]), key


def test_a_parameter_outside_the_module_is_refused() -> None:
    module = model()
    opt = torch.optim.SGD([*module.parameters(), nn.Parameter(torch.zeros(7, 2))], lr=0.1)
    with pytest.raises(RuntimeError, match=r"parameter of shape \(7, 2\) that is not a parameter"):
        optimizer_state_dict(module, opt)


def test_optimizer_template_shapes_tensors_like_the_saved_entries() -> None:
    module = model()
    opt = adam(module)
    metadata = Metadata(
        {
            "optimizer_0.state.0.weight.exp_avg": tensor_meta(2, 3),
            "optimizer_0.state.0.weight.step": tensor_meta(),
            "optimizer_0.param_groups.0.weight.lr": BytesStorageMetadata(),
            "optimizer_0.state.0.bias.exp_avg": tensor_meta(2, dtype=torch.float64),
            "optimizer_1.state.1.weight.exp_avg": tensor_meta(1, 2),  # another optimizer
        }
    )
    template = optimizer_template(param_names(module), opt, "optimizer_0", metadata)
    assert set(template) == {
        "state.0.weight.exp_avg",
        "state.0.weight.step",
        "param_groups.0.weight.lr",
        "state.0.bias.exp_avg",
    }
    assert template["state.0.weight.exp_avg"].shape == (2, 3)
    assert template["state.0.weight.step"].shape == ()
    assert template["param_groups.0.weight.lr"] is None
    assert template["state.0.bias.exp_avg"].dtype == torch.float64


def test_parameters_the_saved_optimizer_did_not_hold_are_named() -> None:
    module = model()
    metadata = Metadata(
        {
            "optimizer_0.param_groups.0.weight.lr": BytesStorageMetadata(),
            "optimizer_0.param_groups.0.bias.lr": BytesStorageMetadata(),
            "optimizer_0.state.1.weight.exp_avg": tensor_meta(1, 2),  # a state alone does not count
            "optimizer_1.param_groups.1.bias.lr": BytesStorageMetadata(),  # another optimizer's
        }
    )
    unsaved = unsaved_parameters(param_names(module), adam(module), "optimizer_0", metadata)
    assert unsaved == ["1.weight", "1.bias"]
    frozen = torch.optim.Adam(module[0].parameters())  # an optimizer of the saved parameters only
    assert unsaved_parameters(param_names(module), frozen, "optimizer_0", metadata) == []


def test_a_pruned_weight_is_keyed_by_its_permanent_name() -> None:
    """torch.nn.utils.prune keeps a pruned ``weight`` as ``weight_orig``; ModelPruning's checkpoints hold
    ``weight``, and a resumed model (not pruned yet) has ``weight``: the optimizer is keyed alike."""
    module = model()
    before = param_names(module)
    torch.nn.utils.prune.l1_unstructured(module[1], "weight", amount=0.5)
    assert module[1].weight_orig is not None
    assert param_names(module) == before
    module[0].register_parameter("scale_orig", nn.Parameter(torch.ones(1)))  # not pruned: its own name
    assert param_names(module)[id(module[0].scale_orig)] == "0.scale_orig"


def test_two_copies_of_a_tied_weight_load_states_of_their_own() -> None:
    """Both ends of a V on one rank with data parallelism: the embedding and the head each hold a copy of the tied
    weight, saved once under the canonical name; loading gives each copy its own state tensors (torch keeps the
    tensors it is given, and a shared ``exp_avg`` or ``step`` would be updated twice per step)."""
    from lightning_3d.core.tied import install_alias_hooks, untie

    def tied_pair() -> nn.Module:
        root = nn.Module()
        root.embed = nn.Embedding(6, 3)
        root.head = nn.Linear(3, 6, bias=False)
        root.head.weight = root.embed.weight
        install_alias_hooks(root, [("embed.weight", "head.weight")])
        untie(root, [("embed.weight", "head.weight")])
        return root

    saved = tied_pair()
    opt = torch.optim.Adam(saved.parameters())
    for _ in range(2):
        saved.head(saved.embed(torch.tensor([1, 4]))).pow(2).sum().backward()
        for p in saved.parameters():  # both copies take the summed gradient, as TiedWeights.sum_grads gives them
            p.grad = saved.embed.weight.grad + saved.head.weight.grad
        opt.step()
        opt.zero_grad()
    flat = optimizer_state_dict(saved, opt)
    assert {k.split(".")[1] for k in flat} == {"embed"}  # one name for both copies
    fresh = tied_pair()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh_opt.load_state_dict(torch_optimizer_state(param_names(fresh), fresh_opt, flat))
    states = [fresh_opt.state[p] for p in (fresh.embed.weight, fresh.head.weight)]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(states[0][key], states[1][key]) and states[0][key] is not states[1][key], key


# ------------------------------------------------------------------------------------ LR schedulers
def _embedding_and_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"emb": nn.Embedding(8, 4), "head": nn.Linear(4, 8)})


def _groups(params: dict[str, nn.Parameter]) -> list[dict]:
    """The example GPT's groups: decay for matrices, none for vectors, empty groups left out."""
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def test_scheduler_state_of_rank_0_is_fitted_to_a_stage_with_other_groups() -> None:
    """Rank 0 (embedding and head: two groups) saves its scheduler; a stage holding the embedding alone has one
    group. Fitted, its learning rate follows the single-device run; rank 0's state as it is breaks the scheduler."""
    from lightning_3d.checkpoint.named_state import fit_scheduler_state

    model = _embedding_and_head()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(_groups(params), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    for _ in range(2):
        opt.step()
        sched.step()
    flat = optimizer_state_dict(model, opt)
    saved = sched.state_dict()
    assert len(saved["base_lrs"]) == 2

    stage = {"emb.weight": params["emb.weight"]}  # the embedding's stage: one group
    stage_opt = torch.optim.AdamW(_groups(stage), lr=0.5)  # another lr in the code: the checkpoint's must win
    stage_sched = torch.optim.lr_scheduler.LambdaLR(stage_opt, _warmup)
    stage_opt.load_state_dict(torch_optimizer_state(param_names(model), stage_opt, flat))

    broken = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(_groups(stage), lr=0.01), _warmup)
    broken.load_state_dict(dict(saved))
    with pytest.raises(ValueError, match="zip"):
        broken.step()

    stage_sched.load_state_dict(fit_scheduler_state(saved, stage_sched))
    assert stage_sched.base_lrs == [0.01] and stage_sched.get_last_lr() == [sched.get_last_lr()[0]]
    for _ in range(3):
        opt.step()
        sched.step()
        stage_opt.step()
        stage_sched.step()
        assert stage_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=0, abs=0)


def test_scheduler_lists_that_cannot_be_matched_to_the_groups_are_refused() -> None:
    from lightning_3d.checkpoint.named_state import fit_scheduler_state

    params = dict(_embedding_and_head().named_parameters())
    opt = torch.optim.SGD(_groups(params), lr=0.1)
    saved = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=[1e-3, 1e-4]).state_dict()
    one = torch.optim.SGD(_groups({"emb.weight": params["emb.weight"]}), lr=0.1)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau\.min_lrs.*2 parameter groups.*1 groups"):
        fit_scheduler_state(saved, torch.optim.lr_scheduler.ReduceLROnPlateau(one))
    # equal values are taken over, one per group
    saved = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, min_lr=1e-3).state_dict()
    fitted = fit_scheduler_state(saved, torch.optim.lr_scheduler.ReduceLROnPlateau(one))
    assert fitted["min_lrs"] == [1e-3] and fitted["_last_lr"] == [0.1]


def test_sequential_schedulers_have_each_scheduler_fitted() -> None:
    """SequentialLR keeps its schedulers' states in a list (not one entry per group): each one is fitted."""
    from lightning_3d.checkpoint.named_state import fit_scheduler_state

    def sequential(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.SequentialLR:
        warm = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[3])

    model = _embedding_and_head()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(_groups(params), lr=0.1)
    sched = sequential(opt)
    for _ in range(4):
        opt.step()
        sched.step()
    flat, saved = optimizer_state_dict(model, opt), sched.state_dict()
    one = torch.optim.SGD(_groups({"emb.weight": params["emb.weight"]}), lr=0.7)
    one_sched = sequential(one)
    one.load_state_dict(torch_optimizer_state(param_names(model), one, flat))
    one_sched.load_state_dict(fit_scheduler_state(saved, one_sched))
    assert [s.base_lrs for s in one_sched._schedulers] == [[0.1], [0.1]]
    for _ in range(4):
        opt.step()
        sched.step()
        one.step()
        one_sched.step()
        assert one.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
