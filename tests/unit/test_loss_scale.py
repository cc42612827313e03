"""LossScaler (core/loss_scale.py): torch's GradScaler driven from an agreed overflow, checked against GradScaler
used the standard way (scale, backward, unscale_, step, update) on the same model."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_3d.core.loss_scale import LossScaler, scaler_of

CPU = torch.device("cpu")
OPTIONS = {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _loss(model: nn.Module, poison: bool) -> torch.Tensor:
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    loss = model(x).pow(2).mean()
    return loss * float("inf") if poison else loss


def test_scaler_of_finds_the_plugins_enabled_grad_scaler():
    scaler = torch.amp.GradScaler("cpu")
    assert scaler_of(MixedPrecision("16-mixed", "cpu", scaler=scaler)) is scaler
    assert scaler_of(MixedPrecision("bf16-mixed", "cpu")) is None
    assert scaler_of(Precision()) is None
    assert scaler_of(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))) is None
    plugin = Precision()
    plugin.scaler = object()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"torch\.amp\.GradScaler"):
        scaler_of(plugin)


def test_observe_marks_the_window_and_leaves_only_the_loss_flag():
    ls = LossScaler(torch.amp.GradScaler("cpu"), CPU)
    assert ls.observe([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0] and not ls.overflow
    assert ls.observe([0.0, 3.0, 0.0]) == [0.0, 0.0, 0.0] and ls.overflow  # a gradient overflow: the scaler's
    assert ls.observe([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0] and ls.overflow  # stays for the accumulation window
    assert ls.observe([2.0, 0.0, 1.0]) == [0.0, 0.0, 1.0]  # a non-finite loss stays for on_nonfinite


def test_steps_follow_grad_scaler_skips_backoff_and_growth():
    pattern = [True, False, False, False, True, False, False, False, False, True]
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ref_scaler, scaler = torch.amp.GradScaler("cpu", **OPTIONS), torch.amp.GradScaler("cpu", **OPTIONS)
    ls = LossScaler(scaler, CPU)
    seen_by_hooks: list[list[torch.Tensor]] = []
    for step, poison in enumerate(pattern):
        ref_opt.zero_grad()
        ref_scaler.scale(_loss(ref_model, poison)).backward()
        ref_scaler.unscale_(ref_opt)
        ref_grads = [p.grad.clone() for p in ref_model.parameters()]
        ref_scaler.step(ref_opt)
        ref_scaler.update()

        def closure(poison: bool = poison) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(model, poison)
            (loss * ls.loss_weight(1.0)).backward()
            bad = any(not bool(p.grad.isfinite().all()) for p in model.parameters())
            ls.observe([float(bad), 0.0])  # what the agreed flags say (one stage, the loss)
            return loss

        before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        hooks = lambda: seen_by_hooks.append([p.grad.clone() for p in model.parameters()])  # noqa: E731
        ls.optimizer_step(opt, closure, hooks, step)
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        assert scaler.state_dict() == ref_scaler.state_dict(), step
        if poison:
            assert ls.step_skipped
            after = (model.state_dict(), opt.state_dict())
            assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values(), strict=True))
            assert before[1]["state"].keys() == after[1]["state"].keys()
            for k, state in before[1]["state"].items():
                assert all(torch.equal(v, after[1]["state"][k][n]) for n, v in state.items())
        else:
            assert not ls.step_skipped
        # the hooks (clipping) see the unscaled gradients, as after GradScaler.unscale_ (with the overflow's NaNs)
        for ours, theirs in zip(seen_by_hooks[-1], ref_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9, equal_nan=True)
        for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert ls.skipped_steps == [i for i, p in enumerate(pattern) if p]
    assert len(seen_by_hooks) == len(pattern)  # on_before_optimizer_step / clipping run on skipped steps too


def test_unscale_refuses_fp16_gradients_as_grad_scaler_does():
    model = nn.Linear(2, 2).half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ls = LossScaler(torch.amp.GradScaler("cpu"), CPU)
    with pytest.raises(ValueError, match="FP16"):
        ls.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


def test_lbfgs_is_refused():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    model = nn.Linear(2, 2)
    ls = LossScaler(torch.amp.GradScaler("cpu"), CPU)
    with pytest.raises(MisconfigurationException, match="LBFGS"):
        ls.optimizer_step(torch.optim.LBFGS(model.parameters()), lambda: None, lambda: None, 0)
