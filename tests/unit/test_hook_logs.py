"""The gradient hooks' ``self.log`` under a pipeline: merging the stages' logs, recording, which hooks count."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule

from lightning_3d.core.hook_logs import EpochEnd, HookLogs, Logged, Recorder, merge, merge_epoch_end, relay_epoch_end

FX = "on_before_optimizer_step"


def logged(name: str, value: float, fx: str = FX, dtype: torch.dtype | None = None, **kwargs: object) -> Logged:
    return Logged(fx, name, value, dtype, dict(kwargs))


def test_a_key_of_one_stage_comes_from_it_in_stage_order() -> None:
    stage0 = [logged("grad_2.0_norm/embed.weight", 1.0)]
    stage1 = [logged("grad_2.0_norm/head.weight", 2.0, prog_bar=True)]
    merged, ambiguous = merge([stage0, stage1])
    assert [(c.name, c.value, c.kwargs) for c in merged] == [
        ("grad_2.0_norm/embed.weight", 1.0, {}),
        ("grad_2.0_norm/head.weight", 2.0, {"prog_bar": True}),
    ]
    assert ambiguous == []


def test_equal_values_are_kept_and_totals_are_combined_as_norms() -> None:
    stages = [
        [logged("lr", 0.1), logged("grad_2.0_norm_total", 3.0), logged("grad_inf_norm_total", 7.0)],
        [logged("lr", 0.1), logged("grad_2.0_norm_total", 4.0), logged("grad_inf_norm_total", 2.0)],
        [logged("grad_1.5_norm_total", 1.0)],
        [logged("grad_1.5_norm_total", 2.0)],
    ]
    merged, ambiguous = merge(stages)
    values = {c.name: c.value for c in merged}
    assert values["lr"] == 0.1
    assert values["grad_2.0_norm_total"] == pytest.approx(5.0)  # sqrt(3^2 + 4^2): the norm over both stages
    assert values["grad_inf_norm_total"] == 7.0
    assert values["grad_1.5_norm_total"] == pytest.approx((1 + 2**1.5) ** (1 / 1.5))
    assert ambiguous == []


def test_nan_everywhere_is_one_value_and_other_differences_keep_the_first_stage() -> None:
    merged, ambiguous = merge([[logged("a", math.nan), logged("b", 1.0)], [logged("a", math.nan), logged("b", 2.0)]])
    assert math.isnan(merged[0].value) and merged[1].value == 1.0
    assert ambiguous == ["b"]


def test_the_same_name_in_two_hooks_stays_two_calls() -> None:
    merged, ambiguous = merge([[logged("x", 1.0, fx="on_after_backward")], [logged("x", 2.0)]])
    assert [(c.fx, c.value) for c in merged] == [("on_after_backward", 1.0), (FX, 2.0)]
    assert ambiguous == []


class _Module(LightningModule):
    pass


def test_recorder_takes_log_and_log_dict_and_restores_what_was_there() -> None:
    module = _Module()
    module._current_fx_name = FX
    earlier = []
    module.__dict__["log"] = lambda *a, **k: earlier.append(a)
    recorder = Recorder(module)
    with recorder.recording() as calls:
        module.log("a", torch.tensor(2.5, dtype=torch.float64), prog_bar=True)
        module.log_dict({"b": 3, "c": torch.tensor([4.0])})
    assert [(c.fx, c.name, c.value, c.dtype) for c in calls] == [
        (FX, "a", 2.5, torch.float64),
        (FX, "b", 3.0, None),
        (FX, "c", 4.0, torch.float32),
    ]
    assert calls[0].kwargs == {"prog_bar": True}
    module.log("after", 1.0)
    assert earlier == [("after", 1.0)] and module.__dict__["log"] is not recorder._log
    with pytest.raises(ValueError, match="shape"):
        with recorder.recording():
            module.log("vector", torch.ones(2))


class _LogsBeforeStep(LightningModule):
    def on_before_optimizer_step(self, optimizer: object) -> None:
        pass


class _WatchesBackward(Callback):
    def on_after_backward(self, trainer: object, pl_module: object) -> None:
        pass


def test_windows_follow_the_overridden_hooks_of_module_and_callbacks() -> None:
    logs = HookLogs(pp_group=None)
    assert logs.active(_Module(), []) == frozenset()
    assert logs.active(_LogsBeforeStep(), []) == {"optimizer_step"}
    assert logs.active(_Module(), [_WatchesBackward()]) == {"backward"}
    assert logs.active(_LogsBeforeStep(), [Callback(), _WatchesBackward()]) == {"backward", "optimizer_step"}


# ------------------------------------------------------------------------------------------ epoch-end hooks
END = "on_validation_epoch_end"


def test_epoch_end_logs_are_the_last_stages_then_keys_only_others_logged() -> None:
    first = EpochEnd(False, [logged("avg", float("nan"), END), logged("lr", 0.1, END)], "RuntimeError: empty")
    last = EpochEnd(True, [logged("avg", 2.5, END)], None)
    merged = merge_epoch_end([first, last])
    assert [(c.name, c.value) for c in merged] == [("avg", 2.5), ("lr", 0.1)]


class _EpochEndRecipe(LightningModule):
    """Lightning's documented recipe: a list filled by the step (the last stage's only), stacked at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def on_validation_epoch_end(self) -> None:
        self.log("val_epoch_average", torch.stack(self.outputs).mean())
        self.outputs.clear()


def test_the_epoch_end_recipe_off_the_last_stage_logs_and_warns_and_on_it_raises(gloo_world, monkeypatch) -> None:
    """One rank, one pipeline group: holding no last stage its empty list's error is reported and dropped (what
    it logged, nothing here, is replayed); holding the last stage the error is its own and raised."""
    import lightning_3d.core.hook_logs as hook_logs

    module = _EpochEndRecipe()
    replayed: list[list[Logged]] = []
    monkeypatch.setattr(hook_logs, "replay", lambda module, calls: replayed.append(list(calls)))
    undo = relay_epoch_end(module, holds_last=False, pp_group=gloo_world)
    assert "on_validation_epoch_end" in vars(module) and "on_train_epoch_end" not in vars(module)  # overridden only
    with pytest.warns(UserWarning, match="raised RuntimeError: stack expects a non-empty TensorList on a rank"):
        module.on_validation_epoch_end()
    assert replayed == [[]]
    module._current_fx_name = END
    module.outputs = [torch.tensor(1.0), torch.tensor(2.0)]
    module.on_validation_epoch_end()  # no error: its own value
    assert [(c.name, c.value) for c in replayed[-1]] == [("val_epoch_average", 1.5)]
    undo()
    assert "on_validation_epoch_end" not in vars(module)

    relay_epoch_end(module, holds_last=True, pp_group=gloo_world)
    with pytest.raises(RuntimeError, match="stack expects a non-empty TensorList"):
        module.on_validation_epoch_end()


class _ReadsTheList(Callback):
    """A callback of the user's reading the module's list (the last stage's only) at epoch end."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("from_callback", torch.stack(pl_module.outputs).sum())


def test_a_users_callback_is_relayed_and_lightnings_own_are_not(gloo_world, monkeypatch) -> None:
    """Off the last stage the callback's error is reported once and dropped; Lightning's ModelCheckpoint (which
    overrides on_train_epoch_end) keeps its own method."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_3d.core.hook_logs as hook_logs

    module, callback, checkpoint = _EpochEndRecipe(), _ReadsTheList(), ModelCheckpoint()
    replayed: list[list[Logged]] = []
    monkeypatch.setattr(hook_logs, "replay", lambda module, calls: replayed.append(list(calls)))
    undo = relay_epoch_end(module, holds_last=False, pp_group=gloo_world, callbacks=[callback, checkpoint])
    assert "on_validation_epoch_end" in vars(callback) and "on_train_epoch_end" not in vars(checkpoint)
    with pytest.warns(UserWarning, match=r"_ReadsTheList.on_validation_epoch_end raised RuntimeError: stack"):
        callback.on_validation_epoch_end(None, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once per hook
        callback.on_validation_epoch_end(None, module)
    module._current_fx_name = END
    module.outputs = [torch.tensor(1.0), torch.tensor(2.0)]
    callback.on_validation_epoch_end(None, module)
    assert [(c.name, c.value) for c in replayed[-1]] == [("from_callback", 3.0)]
    undo()
    assert "on_validation_epoch_end" not in vars(callback)
