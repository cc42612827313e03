"""``torch.compile`` per block (``lightning_3d/core/compile.py``): the setting, which layers are blocks, and
compiling a block's forward in place (names, hooks and the numbers of eager; dropout's random streams)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d import ThreeDSettings
from lightning_3d.core.compile import (
    compile_blocks,
    compile_kwargs,
    describe_kwargs,
    is_compiled,
    sequential_blocks,
)
from lightning_3d.core.rng import BodyRandomness, stage_stream


class Block(nn.Module):
    def __init__(self, dim: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.proj(torch.relu(self.fc(self.norm(x)))))


def test_setting_forms_and_refusals() -> None:
    assert compile_kwargs(False) is None and compile_kwargs(True) == {}
    assert compile_kwargs({"backend": "aot_eager", "options": {"a": 1}}) == {
        "backend": "aot_eager",
        "options": {"a": 1},
    }
    with pytest.raises(ValueError, match=r"torch.compile does not take here: bakend\. Use backend, mode"):
        compile_kwargs({"bakend": "eager"})
    with pytest.raises(ValueError, match="compile must be True, False or a mapping"):
        compile_kwargs("inductor")  # type: ignore[arg-type]
    assert ThreeDSettings().compile is False
    assert ThreeDSettings(compile={"mode": "max-autotune"}).compile == {"mode": "max-autotune"}
    with pytest.raises(ValueError, match="bakend"):
        ThreeDSettings(compile={"bakend": "eager"})
    assert describe_kwargs({}) == "torch.compile(backend='inductor')"


def test_sequential_blocks_are_the_repeated_user_classes_with_parameters() -> None:
    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(4, 8)

    class Empty(nn.Module):
        pass

    layers = [
        ("0", Embed()),
        ("1", Block()),
        ("2", Empty()),
        ("3", Block()),
        ("4", Empty()),
        ("5", nn.Linear(8, 8)),
        ("6", nn.Linear(8, 8)),
    ]
    # Embed once, Empty without parameters, Linear is torch's own: only the Blocks
    assert [n for n, _ in sequential_blocks(layers)] == ["1", "3"]


def test_compiled_forward_keeps_names_hooks_and_eager_numbers() -> None:
    torch.manual_seed(0)
    eager, compiled = Block(), Block()
    compiled.load_state_dict(eager.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    calls: list[str] = []
    compiled.register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    compiled.register_forward_hook(lambda mod, args, out: calls.append("post"))
    result = compile_blocks([("blocks.0", compiled)], {"backend": "aot_eager"})
    assert result.names == ["blocks.0"] and is_compiled(compiled) and not is_compiled(eager)
    assert [n for n, _ in compiled.named_parameters()] == names
    assert list(compiled.state_dict()) == list(eager.state_dict())
    x = torch.randn(3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    eager(x).square().sum().backward()
    compiled(x2).square().sum().backward()
    assert calls == ["pre", "post"], "the block's own hooks run (eagerly) around the compiled forward"
    torch.testing.assert_close(x2.grad, x.grad)
    for (_, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert "blocks.0" in result.describe() and "aot_eager" in result.describe()
    assert result.compile_seconds() > 0, "dynamo's timers saw the compile"
    report = result.first_step_report()
    assert report is not None and "compiling" in report and result.first_step_report() is None


def test_compiled_dropout_draws_the_eager_masks_from_the_swapped_in_stage_stream() -> None:
    """aot_eager's dropout is the eager op: under the strategy's stage stream it draws the very masks eager draws,
    and neither moves the default generator (inductor's own RNG differs from eager's: see compile.py)."""
    torch.manual_seed(0)
    eager, compiled = Block(p=0.5), Block(p=0.5)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks([("b", compiled)], {"backend": "aot_eager"})
    outs = []
    for block in (eager, compiled):
        rng = BodyRandomness(seed=5, stages=[0], tp_rank=0, device=torch.device("cpu"))
        stage = nn.Sequential(block)
        rng.install_stage(stage, 0)
        torch.manual_seed(123)
        before = torch.get_rng_state()
        x = torch.ones(64, 8)
        outs.append(torch.cat([stage(x), stage(x)]))  # two calls: the stream advances between them
        assert torch.equal(torch.get_rng_state(), before), "the default generator moved"
        assert not torch.equal(
            rng.states[stage_stream(0)], BodyRandomness(5, [0], 0, torch.device("cpu")).states[stage_stream(0)]
        ), "the stage stream did not advance"
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    assert not torch.equal(outs[0][:64], outs[0][64:]), "both calls drew the same mask"


def test_a_split_backward_schedule_turns_donated_buffers_off_until_the_undo() -> None:
    """Under a zero-bubble schedule torch refuses a compiled backward that donated its saved buffers while the
    graph is kept, which the input-gradient pass does (tests/test_compile.py runs ZB-V compiled; it fails in its
    first step without this). Here: the setting and its undo, and torch's two-pass backward of a compiled block
    with it off gives eager's gradients."""
    import torch._functorch.config as functorch_config

    from lightning_3d.core import torch_compat
    from lightning_3d.core.compile import for_split_backward

    before = functorch_config.donated_buffer
    assert before, "torch's default changed: the fix may no longer be needed"
    for_split_backward(False)()
    assert functorch_config.donated_buffer == before
    stage_backward_input, stage_backward_weight = torch_compat.split_backward_functions()
    broken = torch_compat.compiled_split_backward_problem() is not None  # refused at setup on this torch
    torch.manual_seed(0)
    eager, block = Block(), Block()
    block.load_state_dict(eager.state_dict())
    undo = for_split_backward(True)
    try:
        assert functorch_config.donated_buffer is False
        torch._dynamo.reset()
        compile_blocks([("0", block)], {"backend": "aot_eager"})
        for micro_batch in range(2):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(micro_batch))
            expected_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            eager(expected_x).square().sum().backward()
            out = block(got_x)
            (grad_x,), groups = stage_backward_input([out], [2 * out.detach()], [got_x], block.parameters())
            if broken:  # the refusal is still needed: torch's weight-gradient pass fails on the compiled block
                with pytest.raises(RuntimeError, match="_input_metadata"):
                    stage_backward_weight(block.parameters(), groups)
                return
            stage_backward_weight(block.parameters(), groups)
            torch.testing.assert_close(grad_x, expected_x.grad, rtol=1e-6, atol=1e-6)
        for (name, got), want in zip(block.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6, msg=name)
    finally:
        undo()
        torch._dynamo.reset()
    assert functorch_config.donated_buffer == before


@pytest.mark.parametrize(("release", "refused"), [((2, 11), True), ((2, 13), False)])
def test_compile_with_a_split_backward_is_refused_where_torch_cannot_run_it(monkeypatch, release, refused) -> None:
    """Before torch 2.13 the weight-gradient pass fails on a compiled block (the test above shows it on such a
    torch): the settings refuse compile with a split-backward schedule there, and only there."""
    from lightning_3d.core import torch_compat
    from lightning_3d.settings import ThreeDSettings

    monkeypatch.setattr(torch_compat, "torch_release", lambda: release)
    split = {"pp": 2, "stages_per_rank": 2, "schedule": "zbvzerobubble", "compile": True}
    if refused:
        with pytest.raises(ValueError, match=r"compile with schedule='zbvzerobubble'.*compile=False"):
            ThreeDSettings(**split)
    else:
        assert ThreeDSettings(**split).compile is not False
    assert ThreeDSettings(pp=2, schedule="1f1b", compile=True).compile is not False  # whole backwards: always
    assert ThreeDSettings(**{**split, "compile": False}).compile is False
