"""Per-name seeds, materialising meta layers, and loading a full state dict into a plain module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.core.materialize import (
    LoadReport,
    check_materializable,
    gather_full_state_dict,
    has_meta_tensors,
    load_full_state_dict,
    materialize,
    module_seed,
)
from lightning_3d.core.tied import install_alias_hooks

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------ seeds
def test_module_seed_is_a_pinned_function_of_seed_and_name() -> None:
    # 7 * 1_000_003 + CRC-32("body.0") (= 757523813): the same in every process and Python version
    assert module_seed(7, "body.0") == 764523834
    assert module_seed(0, "") == 0


def test_module_seed_depends_on_name_and_base_seed() -> None:
    names = [f"body.{i}.{part}" for i in range(200) for part in ("attn", "mlp", "ln")]
    seeds = {module_seed(1, n) for n in names}
    assert len(seeds) == len(names)
    assert module_seed(1, "body.0") != module_seed(2, "body.0")
    assert all(0 <= module_seed(2**62, n) < 2**63 - 1 for n in names[:10])


# ------------------------------------------------------------------------------------ materialize
def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.LayerNorm(6), nn.Linear(6, 3))


def test_materialize_equals_building_each_layer_under_its_seed() -> None:
    with torch.device("meta"):
        body = build()
    assert has_meta_tensors(body)
    materialize(body, CPU, base_seed=7, prefix="body")
    assert not has_meta_tensors(body)
    for index, make in ((0, lambda: nn.Linear(4, 6)), (3, lambda: nn.Linear(6, 3))):
        torch.manual_seed(module_seed(7, f"body.{index}"))
        ref = make()  # the constructor draws exactly what reset_parameters draws
        torch.testing.assert_close(body[index].weight, ref.weight, rtol=0, atol=0)
        torch.testing.assert_close(body[index].bias, ref.bias, rtol=0, atol=0)
    assert torch.equal(body[2].weight, torch.ones(6)) and torch.equal(body[2].bias, torch.zeros(6))


def test_materialize_is_layout_independent() -> None:
    with torch.device("meta"):
        whole, alone = build(), nn.Linear(6, 3)
    materialize(whole, CPU, base_seed=3, prefix="body")
    materialize(alone, CPU, base_seed=3, prefix="body.3")  # the same layer, materialised on its own stage
    assert torch.equal(whole[3].weight, alone.weight) and torch.equal(whole[3].bias, alone.bias)
    with torch.device("meta"):
        other = build()
    materialize(other, CPU, base_seed=4, prefix="body")
    assert not torch.equal(whole[0].weight, other[0].weight)


def test_materialize_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with torch.device("meta"):
        body = build()
    materialize(body, CPU, base_seed=0, prefix="body")
    assert torch.equal(torch.get_rng_state(), state)


class ScaledResidual(nn.Module):
    """A parent whose reset_parameters overrides its child's default initialisation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.empty(3))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.gain)


def test_children_are_initialised_before_their_parents() -> None:
    with torch.device("meta"):
        block = ScaledResidual()
    materialize(block, CPU, base_seed=0, prefix="body.0")
    assert torch.equal(block.proj.weight, torch.zeros(3, 3))  # the parent's init wins
    assert torch.equal(block.gain, torch.ones(3))
    torch.manual_seed(module_seed(0, "body.0.proj"))
    assert torch.equal(block.proj.bias, nn.Linear(3, 3).bias)  # the child's own init of what the parent left


# ------------------------------------------------------------------------------------ ShardedInit (FSDP)
class TiedNet(nn.Module):
    """An embedding, two blocks and a head tied to the embedding: the strategy's FSDP units in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(ScaledResidualWide() for _ in range(2))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


class ScaledResidualWide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.5)  # overrides the child's default, as GPT-2's scaled projections


def test_sharded_init_gives_the_single_device_values_through_fsdp(gloo_world) -> None:
    """Wrapped with fully_shard while on meta, allocated with to_empty and filled module by module: the same
    values as materialising the whole model on one device (the tied head takes the embedding's), and a tensor
    that was real before allocation keeps its value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_3d.core.materialize import ShardedInit

    with torch.device("meta"):
        net, ref = TiedNet(), TiedNet()
    net.register_buffer("scale", torch.full((3,), 2.0))  # real already (like a rotary table materialised first)
    names = ["emb", "blocks.0", "blocks.1", "head"]
    deferred = ShardedInit([(n, net.get_submodule(n)) for n in names])
    mesh = init_device_mesh("cpu", (1,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    assert has_meta_tensors(net)
    deferred.allocate([net], CPU)
    deferred.fill(CPU, base_seed=5)
    assert not has_meta_tensors(net) and not deferred._pending
    materialize(ref, CPU, base_seed=5, prefix="")
    got = {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in net.state_dict().items()}
    want = ref.state_dict()
    assert set(got) == set(want) | {"scale"}
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert torch.equal(got["head.weight"], want["emb.weight"])
    assert torch.equal(got["scale"], torch.full((3,), 2.0))


class _HoldsModel:
    """A hook owner that holds the whole model, as the stage executor does."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def receive(self, module: nn.Module, args: tuple) -> None:
        return None


def test_sharded_init_copies_carry_no_hooks_and_die_with_their_fill() -> None:
    """A layer's meta copy drops the layer's hooks: a bound-method hook of an object holding the model would be
    deep-copied with that object, and the copy would refer back to itself and outlive its own fill (measured: two
    blocks whole at once). Without the hooks the copy is freed as soon as the last reference goes, no collector."""
    import copy
    import gc
    import weakref

    from lightning_3d.core.materialize import _hookless_copy

    with torch.device("meta"):
        model = build()
    holder = _HoldsModel(model)
    model[0].register_forward_pre_hook(holder.receive)
    gc.disable()
    try:
        plain = copy.deepcopy(model)
        plain_ref = weakref.ref(plain)
        del plain
        assert plain_ref() is not None  # the reference cycle through the copied hook owner
        twin = _hookless_copy(model)
        assert len(twin[0]._forward_pre_hooks) == 0 and len(model[0]._forward_pre_hooks) == 1
        assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
        twin_ref = weakref.ref(twin)
        del twin
        assert twin_ref() is None
    finally:
        gc.enable()
        gc.collect()


def test_materialize_can_leave_modules_on_meta() -> None:
    with torch.device("meta"):
        body = build()
    materialize(body, CPU, base_seed=7, prefix="body", exclude=[body[0]])
    assert body[0].weight.is_meta and not body[3].weight.is_meta


# ------------------------------------------------------------------------------------ check_materializable
class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("offset", torch.zeros(3))


def test_check_materializable_names_modules_without_reset_parameters() -> None:
    with torch.device("meta"):
        body = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError) as info:
        check_materializable(body, "body")
    message = str(info.value)
    assert "body.1 (Scale: weight, offset)" in message
    assert "body.0" not in message and "reset_parameters()" in message


def test_check_materializable_accepts_resettable_and_real_modules() -> None:
    with torch.device("meta"):
        check_materializable(build(), "body")
    check_materializable(nn.Sequential(Scale()), "body")  # on the CPU: nothing to initialise


# ------------------------------------------------------------------------------------ load_full_state_dict
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def full_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
        net.body[1].running_mean.normal_()
    return net.state_dict()


def test_load_copies_every_key_and_reports_it() -> None:
    net, state = Net(), full_state(0)
    report = load_full_state_dict(net, state)
    assert sorted(report.loaded) == sorted(state) and report.missing == [] and report.unexpected == []
    for key, value in net.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert state["body.0.weight"].data_ptr() != net.body[0].weight.data_ptr()  # copied, not aliased


def test_missing_and_unexpected_keys_raise_and_load_nothing() -> None:
    net, state = Net(), full_state(0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state.pop("body.0.bias")
    state["head.weight"] = torch.zeros(1)
    with pytest.raises(KeyError) as info:
        load_full_state_dict(net, state)
    assert "missing keys ['body.0.bias']" in str(info.value)
    assert "unexpected keys ['head.weight']" in str(info.value)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_non_strict_loads_what_matches() -> None:
    net, state = Net(), full_state(1)
    state.pop("body.0.bias")
    state["head.weight"] = torch.zeros(1)
    report = load_full_state_dict(net, state, strict=False)
    assert report.missing == ["body.0.bias"] and report.unexpected == ["head.weight"]
    assert "body.0.bias" not in report.loaded and torch.equal(net.body[0].weight, state["body.0.weight"])


def test_keys_of_other_stages_are_not_unexpected() -> None:
    net, state = Net(), full_state(0)
    state["body.2.weight"] = torch.zeros(5)  # another pipeline stage's layer
    report = load_full_state_dict(net, state, full_keys=[*state])
    assert report.unexpected == [] and "body.2.weight" not in report.loaded
    with pytest.raises(KeyError, match=r"body\.2\.weight"):
        load_full_state_dict(net, state)  # without full_keys it is unknown


def test_shape_mismatch_raises_and_loads_nothing() -> None:
    net, state = Net(), full_state(0)
    before = net.body[0].weight.clone()
    state["body.1.weight"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"Shape mismatch for 'body.1.weight': checkpoint \(5,\), model \(4,\)"):
        load_full_state_dict(net, state)
    assert torch.equal(net.body[0].weight, before)  # an earlier, valid key was not copied either


def test_load_casts_to_the_model_dtype() -> None:
    net = Net().double()
    state = full_state(2)
    load_full_state_dict(net, state)
    assert net.body[0].weight.dtype == torch.float64
    torch.testing.assert_close(net.body[0].weight, state["body.0.weight"].double())


def _tied(with_hooks: bool) -> nn.Module:
    root = nn.Module()
    root.embed, root.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    root.head.weight = root.embed.weight
    if with_hooks:  # as the strategy leaves a model whose embedding and head are tied
        install_alias_hooks(root, [("embed.weight", "head.weight")])
    return root


def test_a_plain_models_state_dict_with_both_names_of_a_tied_weight_loads() -> None:
    """One process's ``state_dict()`` (and ``strategy.full_state_dict()``) names a tied weight twice; the strategy's
    model names it once. Loading takes it under either name, and the round trip loads strictly."""
    plain = _tied(with_hooks=False)
    state = plain.state_dict()
    assert sorted(state) == ["embed.weight", "head.weight"]
    model = _tied(with_hooks=True)
    report = load_full_state_dict(model, state, full_keys=["embed.weight"])
    assert report.unexpected == [] and report.missing == [] and report.loaded == ["embed.weight"]
    assert torch.equal(model.head.weight, plain.embed.weight) and model.head.weight is model.embed.weight
    assert sorted(state) == ["embed.weight", "head.weight"]  # the caller's dict is left as it was
    only_alias = {"head.weight": torch.ones(8, 4)}  # a checkpoint that kept the head's name
    again = _tied(with_hooks=True)
    load_full_state_dict(again, only_alias, full_keys=["embed.weight"])
    assert torch.equal(again.embed.weight, torch.ones(8, 4))


def test_load_report_defaults() -> None:
    assert LoadReport() == LoadReport(loaded=[], missing=[], unexpected=[])


def test_gather_full_state_dict_without_a_process_group() -> None:
    net = Net()
    got = gather_full_state_dict(net, writer=True)
    assert got is not None and sorted(got) == sorted(net.state_dict())
    assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())
    assert gather_full_state_dict(net, writer=False) == {}


def test_gathers_silence_only_dtensors_sequential_collective_warning() -> None:
    """gather_full_state_dict's FSDP x tp gathers log torch's "several collectives" warning on every rank; the
    context silences that logger (the one torch's module really uses) for its duration only."""
    import logging

    from torch.distributed.tensor import _redistribute

    from lightning_3d.core import torch_compat

    logger = _redistribute.logger
    assert logger is logging.getLogger("torch.distributed.tensor._redistribute")
    other = logging.getLogger("lightning_3d.test_other")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, before = Keep(logging.WARNING), logger.level
    logger.addHandler(handler)
    other.addHandler(handler)
    try:
        with torch_compat.quiet_sequential_gathers():
            logger.warning("While redistributing from %s to %s", "a", "b")
            other.warning("kept")
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        other.removeHandler(handler)
    assert seen == ["kept", "after"]
    assert logger.level == before


def _meta_lora(**config: object) -> nn.Module:
    import sys
    from pathlib import Path

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import hf_config

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config("llama", layers=1))
        return get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], **config))


def test_lora_adapters_built_on_meta_start_as_peft_makes_them() -> None:
    """The model's ``_init_weights`` draws ``lora_B`` from a normal; PEFT's initialisation, run after it, zeroes it."""
    from lightning_3d.core.materialize import library_initializers

    model = _meta_lora(init_lora_weights="gaussian")
    materialize(model, torch.device("cpu"), 0, "", initializers=library_initializers(model))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(layer.lora_B["default"].weight, torch.zeros_like(layer.lora_B["default"].weight))
    assert layer.lora_A["default"].weight.std() > 0 and not layer.base_layer.weight.is_meta


def test_lora_initialised_from_the_base_weights_is_refused_on_meta() -> None:
    from lightning_3d.core.materialize import library_initializers

    model = _meta_lora(init_lora_weights="pissa")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa', which PEFT computes from the base layer"):
        materialize(model, torch.device("cpu"), 0, "", initializers=library_initializers(model))
