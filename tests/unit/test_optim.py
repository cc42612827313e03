"""``core/optim.py``: the multi-tensor optimizer for DTensor parameters, only where it changes no number."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_3d.core import torch_compat
from lightning_3d.core.optim import BITWISE_FOREACH, optimizer_for_dtensors

HYPER = {
    torch.optim.Adam: {"lr": 1e-3, "weight_decay": 0.01, "amsgrad": True},
    torch.optim.AdamW: {"lr": 1e-3, "weight_decay": 0.1},
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    torch.optim.RMSprop: {"lr": 1e-3, "momentum": 0.5, "centered": True},
    torch.optim.Adagrad: {"lr": 0.1},
    torch.optim.Adamax: {"lr": 1e-3},
    torch.optim.Adadelta: {},
}


def _params(mesh, dtype: torch.dtype, dtensor: bool = True) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (17, 5), (3,)]
    values = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    return [torch.nn.Parameter(distribute_tensor(v, mesh, [Replicate()]) if dtensor else v) for v in values]


def _train(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], mesh, steps: int = 6, seen: list[int] | None = None
) -> list[torch.Tensor]:
    seen = [] if seen is None else seen
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad = distribute_tensor(grad, mesh, [Replicate()]) if isinstance(p, DTensor) else grad
        with optimizer_for_dtensors(opt) as switched:
            seen.append(switched)
            opt.step()
    return [p.detach().to_local().clone() if isinstance(p, DTensor) else p.detach().clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("cls", BITWISE_FOREACH, ids=lambda c: c.__name__)
def test_switched_optimizers_give_bitwise_the_per_tensor_loops_parameters(gloo_world, cls, dtype) -> None:
    assert set(HYPER) == set(BITWISE_FOREACH)
    mesh = init_device_mesh("cpu", (1,))
    loop_params, chosen_params = _params(mesh, dtype), _params(mesh, dtype)
    loop = cls(loop_params, foreach=False, **HYPER[cls])
    chosen = cls(chosen_params, **HYPER[cls])
    assert chosen.param_groups[0]["foreach"] is None
    expected, seen = _train(loop, loop_params, mesh), []
    got = _train(chosen, chosen_params, mesh, seen=seen)
    assert seen == [1] * 6  # switched at every step, so the comparison is of the two implementations
    assert chosen.param_groups[0]["foreach"] is None  # and the user's setting is back afterwards
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_user_choices_plain_tensors_and_other_optimizers_are_left_alone(gloo_world) -> None:
    mesh = init_device_mesh("cpu", (1,))
    explicit = torch.optim.AdamW(_params(mesh, torch.float32), foreach=False)
    fused = torch.optim.AdamW(_params(mesh, torch.float32), fused=True)
    plain = torch.optim.AdamW(_params(mesh, torch.float32, dtensor=False))
    nadam = torch.optim.NAdam(_params(mesh, torch.float32))  # its foreach form rounds differently

    class MyAdamW(torch.optim.AdamW):  # a subclass may override step
        pass

    sub = MyAdamW(_params(mesh, torch.float32))
    for opt in (explicit, fused, plain, nadam, sub):
        before = opt.param_groups[0].get("foreach")
        with optimizer_for_dtensors(opt) as switched:
            assert switched == 0 and opt.param_groups[0].get("foreach") == before
    # a group mixing DTensors and plain tensors (tensor parallelism leaves norms plain): DTensor's foreach ops refuse
    # mixed lists, so such a group keeps the loop
    groups = [
        {"params": _params(mesh, torch.float32)},
        {"params": _params(mesh, torch.float32, False)},
        {"params": _params(mesh, torch.float32) + _params(mesh, torch.float32, False)},
    ]
    sgd = torch.optim.SGD(groups, lr=0.1)
    with optimizer_for_dtensors(sgd) as switched:
        assert switched == 1 and [g["foreach"] for g in sgd.param_groups] == [True, None, None]
    assert [g["foreach"] for g in sgd.param_groups] == [None, None, None]
    _train(sgd, [p for g in sgd.param_groups for p in g["params"]], mesh, steps=1)  # and it steps
    with pytest.raises(RuntimeError, match="boom"), optimizer_for_dtensors(sgd):  # put back when the step raises
        raise RuntimeError("boom")
    assert sgd.param_groups[0]["foreach"] is None


def _spy_groups(monkeypatch: pytest.MonkeyPatch, cls: type[torch.optim.Optimizer]) -> list[bool]:
    """Records, at each step's ``_init_group``, whether the group's parameters were the DTensors' local tensors."""
    seen: list[bool] = []
    owner = next(c for c in cls.__mro__ if "_init_group" in vars(c))
    original = vars(owner)["_init_group"]

    def spy(self, group, *args, **kwargs):
        seen.append(not isinstance(group["params"][0], DTensor))
        return original(self, group, *args, **kwargs)

    monkeypatch.setattr(owner, "_init_group", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("cls", BITWISE_FOREACH, ids=lambda c: c.__name__)
def test_dtensor_steps_over_local_tensors_give_the_plain_tensor_steps_parameters_and_state(
    gloo_world, monkeypatch, cls, dtype
) -> None:
    """Every step runs over the local tensors, the first too (it creates the state there, which then becomes
    DTensors with the parameters' layout): the parameters and the state are bitwise those of the same optimizer over
    plain tensors (a single device), the state stays the same DTensor objects, and nothing of the swap is left
    behind."""
    mesh = init_device_mesh("cpu", (1,))
    plain_params, dt_params = _params(mesh, dtype, dtensor=False), _params(mesh, dtype)
    plain, dt = cls(plain_params, **HYPER[cls]), cls(dt_params, **HYPER[cls])
    expected = _train(plain, plain_params, mesh)
    seen = _spy_groups(monkeypatch, cls)
    got = _train(dt, dt_params, mesh)
    assert seen == [True] * 6
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert set(dt.state) == set(dt_params) and dt.param_groups[0]["params"] == dt_params
    assert "step" not in vars(dt)  # the instance's step attribute is removed again
    for p_plain, p_dt in zip(plain_params, dt_params):
        assert torch_compat.local_tensor(p_dt).grad is None
        for key, value in plain.state[p_plain].items():
            kept = dt.state[p_dt][key]
            if value.dim() > 0:
                assert isinstance(kept, DTensor) and kept.placements == p_dt.placements, key
            assert torch.equal(torch_compat.local_tensor(kept), value), key


def test_the_swap_happens_after_the_closure_and_is_undone_when_the_step_raises(gloo_world, monkeypatch) -> None:
    """Lightning runs its closure (training_step, backward, clipping) inside ``optimizer.step``: the closure sees the
    DTensors and the update the local tensors; a step hook or a step that raises leaves everything as it was."""
    mesh = init_device_mesh("cpu", (1,))
    params = _params(mesh, torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-3)
    _train(opt, params, mesh, steps=1)  # state exists
    seen = _spy_groups(monkeypatch, torch.optim.AdamW)
    in_closure: list[bool] = []

    def closure() -> torch.Tensor:
        in_closure.append(all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"]))
        for p in params:
            p.grad = distribute_tensor(torch.ones(p.shape), mesh, [Replicate()])
        return torch.zeros(())

    with optimizer_for_dtensors(opt):
        opt.step(closure)
    assert in_closure == [True] and seen == [True]
    before = [torch_compat.local_tensor(p).clone() for p in params]
    with pytest.raises(RuntimeError, match="boom"), optimizer_for_dtensors(opt):
        opt.step(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert opt.param_groups[0]["params"] == params and set(opt.state) == set(params) and "step" not in vars(opt)
    assert all(torch.equal(torch_compat.local_tensor(p), b) for p, b in zip(params, before))
    handle = opt.register_step_post_hook(lambda *args: None)  # a hook would see local tensors: no swap
    with optimizer_for_dtensors(opt):
        opt.step(closure)
    handle.remove()
    assert seen == [True, False]
