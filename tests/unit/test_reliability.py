"""Pure parts of reliability.py: rank ranges, the settings digest, the ConsistencyError layout (with the two
collectives of compare_across_ranks replaced by a simulated world), value texts and argument checks."""

from __future__ import annotations

import math
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.core.agreed import is_agreed
from lightning_3d.core.partition import StagePlan
from lightning_3d.reliability import (
    ConsistencyError,
    Reliability,
    _digest,
    _ranks_text,
    _text,
    as_timedelta,
    body_items,
    compare_across_ranks,
)
from lightning_3d.settings import ThreeDSettings


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([3], "rank 3"),
        ([0, 1, 2, 5], "ranks 0-2, 5"),
        ([0, 2, 4], "ranks 0, 2, 4"),
        ([1, 2, 4, 5, 6, 9], "ranks 1-2, 4-6, 9"),
        ([0, 1, 2, 3, 4, 5, 6, 7], "ranks 0-7"),
    ],
)
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert _ranks_text(ranks) == text


def test_digest_is_pinned_and_order_independent() -> None:
    items = {"strategy.tp": "2", "world_size": "8"}
    # sha256 of the sorted items as JSON, first 8 bytes: the same in every process (no hash randomisation)
    assert _digest(items) == -4236350151192511239
    assert _digest({"world_size": "8", "strategy.tp": "2"}) == _digest(items)
    assert _digest({**items, "world_size": "4"}) != _digest(items)
    assert _digest({"strategy.tp": "28", "world_size": ""}) != _digest(items)  # no ambiguity from joining
    assert -(2**63) <= _digest({}) < 2**63


def test_text_drops_memory_addresses() -> None:
    class Thing:
        pass

    assert " at 0x" not in _text(Thing())
    assert _text(Thing()) == _text(Thing())  # two objects, two addresses, the same text
    assert _text("a") == "'a'" and _text(None) == "None" and _text(2) == "2"


def test_as_timedelta() -> None:
    assert as_timedelta(5) == timedelta(seconds=5)
    assert as_timedelta(2.5) == timedelta(seconds=2.5)
    assert as_timedelta(timedelta(minutes=1)) == timedelta(minutes=1)
    assert as_timedelta(None) is None


def test_body_items_names_layers_and_stages() -> None:
    body = SimpleNamespace(module=nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    items = body_items(body, StagePlan([["0"], ["1"]]))
    assert items == {"body.0": "Linear", "body.1": "ReLU", "stages": "[['0'], ['1']]"}


def test_on_nonfinite_is_checked() -> None:
    with pytest.raises(ValueError, match=r"on_nonfinite must be one of \('raise', 'skip', 'off'\), got 'ignore'"):
        ThreeDSettings(on_nonfinite="ignore")
    assert Reliability(ThreeDSettings(on_nonfinite="skip")).on_nonfinite == "skip"


# ------------------------------------------------------------------------------------ compare_across_ranks
def simulate(monkeypatch: pytest.MonkeyPatch, everyone: list[dict[str, str]], rank: int, limit: int = 12) -> None:
    """Run compare_across_ranks as ``rank`` of a world whose ranks hold ``everyone``'s items."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(everyone))

    def all_gather(out: list[torch.Tensor], mine: torch.Tensor, group: object = None) -> None:
        assert int(mine) == _digest(everyone[rank])
        for i, items in enumerate(everyone):
            out[i].copy_(torch.tensor([_digest(items)]))

    def all_gather_object(out: list[object], obj: object, group: object = None) -> None:
        assert obj == everyone[rank]
        out[:] = [dict(items) for items in everyone]

    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    compare_across_ranks(everyone[rank], torch.device("cpu"), "the settings", limit=limit)


BASE = {"model.x": "parameter (3,) torch.float32", "strategy.tp": "2", "world_size": "4"}


def test_agreeing_ranks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(monkeypatch, [dict(BASE) for _ in range(4)], rank=2)


def test_single_rank_world_passes(gloo_world: dist.ProcessGroup) -> None:
    compare_across_ranks(dict(BASE), torch.device("cpu"), "the settings")


def test_differences_are_listed_by_key_with_the_ranks_of_each_value(monkeypatch: pytest.MonkeyPatch) -> None:
    everyone = [dict(BASE) for _ in range(4)]
    everyone[2]["strategy.tp"] = "1"
    del everyone[3]["model.x"]
    for rank in range(4):  # every rank raises the same agreed error
        with pytest.raises(ConsistencyError) as info:
            simulate(monkeypatch, everyone, rank)
        assert is_agreed(info.value)
        message = str(info.value)
        assert message.startswith("ThreeDStrategy: the ranks of this job do not agree on the settings;")
        differences = message.split("Differences:\n")[1].split("\nCheck that")[0].splitlines()
        assert differences == [
            "  model.x: parameter (3,) torch.float32 on ranks 0-2; <missing> on rank 3",
            "  strategy.tp: 2 on ranks 0-1, 3; 1 on rank 2",
        ]


def test_many_differences_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    everyone = [{f"k{i:02d}": str(rank) for i in range(5)} for rank in range(2)]
    with pytest.raises(ConsistencyError) as info:
        simulate(monkeypatch, everyone, rank=0, limit=3)
    lines = str(info.value).split("Differences:\n")[1].split("\nCheck that")[0].splitlines()
    assert lines == ["  k00: 0 on rank 0; 1 on rank 1", "  k01: 0 on rank 0; 1 on rank 1",
                     "  k02: 0 on rank 0; 1 on rank 1", "  ... and 2 more"]  # fmt: skip


# ---------------------------------------------------------------------------------------------- non-finite flags
def _reliability_with_stages(**settings: object):
    from types import SimpleNamespace

    from lightning_3d.core.log_relay import StepLogs
    from lightning_3d.core.step import HeldGrads
    from lightning_3d.reliability import Reliability
    from lightning_3d.settings import ThreeDSettings

    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.float64)]
    rel = Reliability(ThreeDSettings(**settings))
    rel.on_model_ready(torch.nn.Module(), [SimpleNamespace(index=i, module=m) for i, m in enumerate(stages)], 2)
    params = [p for m in stages for p in m.parameters()]
    return rel, params, HeldGrads, StepLogs


def test_local_flags_name_the_stage_and_the_loss_without_reading_the_device(gloo_world: dist.ProcessGroup) -> None:
    from benchmarks.b8_sync import SyncCounter

    rel, params, HeldGrads, StepLogs = _reliability_with_stages()
    grads = [torch.ones_like(p) for p in params]
    grads[2] = grads[2].clone()
    grads[2][0, 1] = float("nan")  # stage 1's weight (float64)
    logs = StepLogs()
    counter = SyncCounter()
    with counter:
        counter.begin()
        fine = rel.local_flags(HeldGrads(params, [torch.ones_like(p) for p in params]), None)
        bad = rel.local_flags(HeldGrads(params, grads), logs)
        logs.add_loss(torch.tensor(float("inf")), 1)
        loss_bad = rel.local_flags(HeldGrads(params, [None] * len(params)), logs)
        counter.end()
    assert counter.per_step() == [0]
    assert fine.tolist() == [0.0, 0.0, 0.0]
    assert bad.tolist() == [0.0, 1.0, 0.0]
    assert loss_bad.tolist() == [0.0, 0.0, 1.0]
    grads[0] = torch.full_like(params[0], float("inf"))  # stage 0 too; large finite values are no NaN
    big = [torch.full_like(p, 1e30) for p in params]
    assert [v > 0 for v in rel.local_flags(HeldGrads(params, grads), None).tolist()] == [True, True, False]
    assert rel.local_flags(HeldGrads(params, big), None).tolist() == [0.0, 0.0, 0.0]
    assert rel.flags_request() is not None and rel.n_flags == 3


def test_local_flags_of_interleaved_stages_and_mixed_dtypes(gloo_world: dist.ProcessGroup) -> None:
    """A rank holding stages 0 and 2 of 4 (interleaved), stage 2 in two dtypes: the flags land on the stages that
    hold the non-finite gradients, step after step (the scan's buffers are reused and reset)."""
    from types import SimpleNamespace

    from lightning_3d.core.step import HeldGrads
    from lightning_3d.reliability import Reliability
    from lightning_3d.settings import ThreeDSettings

    two = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.float64))
    stages = [SimpleNamespace(index=0, module=torch.nn.Linear(2, 2)), SimpleNamespace(index=2, module=two)]
    rel = Reliability(ThreeDSettings())
    rel.on_model_ready(torch.nn.Module(), stages, 4)
    params = [p for s in stages for p in s.module.parameters()]

    def flags(bad: set[int]) -> list[float]:
        grads = [torch.full_like(p, float("nan")) if i in bad else torch.ones_like(p) for i, p in enumerate(params)]
        return rel.local_flags(HeldGrads(params, grads), None).tolist()

    assert flags(set()) == [0.0, 0.0, 0.0, 0.0, 0.0]
    assert flags({0}) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert flags({2}) == [0.0, 0.0, 1.0, 0.0, 0.0]  # stage 2's float32 layer
    assert flags({2, 5}) == [0.0, 0.0, 2.0, 0.0, 0.0]  # both of stage 2's dtype groups
    assert flags({1, 4}) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert flags(set()) == [0.0, 0.0, 0.0, 0.0, 0.0]


def test_no_flags_requested_when_the_check_is_off() -> None:
    rel, *_ = _reliability_with_stages(on_nonfinite="off")
    assert rel.flags_request() is None


def test_with_norm_clipping_the_scan_computes_the_norms_clipping_reuses(gloo_world: dist.ProcessGroup) -> None:
    from types import SimpleNamespace

    from benchmarks.b8_sync import SyncCounter
    from lightning_3d.core.grad_norm import global_grad_norm

    rel, params, HeldGrads, _ = _reliability_with_stages()
    rel._module._trainer = SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in params]
    counter = SyncCounter()
    with counter:
        counter.begin()
        fine = rel.local_flags(HeldGrads(params, grads), None)
        counter.end()
    assert counter.per_step() == [0] and fine.tolist() == [0.0, 0.0, 0.0]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    # every gradient's norm is the scan's, so clipping does not read them again: a planted value shows it
    assert all(rel.scan_norms.lookup(g) is not None for g in grads)
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert float(global_grad_norm(params, 2.0, tp_group=None, pp_group=None, known=rel.scan_norms)) == pytest.approx(
        expected, rel=1e-6
    )
    grads[3] = grads[3].clone()
    grads[3][0] = float("-inf")  # stage 1's bias
    assert rel.local_flags(HeldGrads(params, grads), None).tolist() == [0.0, 1.0, 0.0]
    # a finite gradient whose float32 2-norm overflows counts as non-finite when clipping by that norm
    big = [torch.full_like(p, 1e30) if i == 0 else torch.ones_like(p) for i, p in enumerate(params)]
    assert rel.local_flags(HeldGrads(params, big), None).tolist() == [1.0, 0.0, 0.0]
    rel._module._trainer = SimpleNamespace(gradient_clip_val=None, gradient_clip_algorithm=None)
    assert rel.local_flags(HeldGrads(params, big), None).tolist() == [0.0, 0.0, 0.0]
    assert all(rel.scan_norms.lookup(g) is None for g in big)  # the per-element check keeps no norms


def test_batch_digest_tells_batches_apart_by_values_dtype_shape_and_structure() -> None:
    from lightning_3d.reliability import batch_digest

    x, y = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 0])
    same = batch_digest((x.clone(), y.clone()))
    assert batch_digest((x, y)) == same
    assert batch_digest((x + 1e-6, y)) != same  # values
    assert batch_digest((x.double(), y)) != same  # dtype
    assert batch_digest((x.reshape(3, 2), y)) != same  # shape
    assert batch_digest([x, y]) != same  # structure
    assert batch_digest({"input_ids": y, "n": 3}) == batch_digest({"input_ids": y.clone(), "n": 3})
    assert batch_digest({"input_ids": y, "n": 3}) != batch_digest({"input_ids": y, "n": 4})
    assert batch_digest((x[:, ::2], torch.empty(0))) == batch_digest((x[:, ::2].contiguous(), torch.empty(0)))
    # an object's repr may hold its address, which differs between processes: only its type counts
    assert batch_digest((y, object())) == batch_digest((y, object()))


def test_a_save_after_this_rank_alone_failed_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A save from Lightning's exception handling (``OnExceptionCheckpoint``) after an error of this rank: reported
    first (so the other ranks stop) and skipped; an error every rank raised, or a save outside exception
    handling, goes ahead."""
    from lightning_3d.core.agreed import mark_agreed

    reliability = Reliability(ThreeDSettings())
    error = RuntimeError("user error")
    assert not reliability.refuse_save_after_failure(False, error, "last.ckpt")  # not interrupted
    assert not reliability.refuse_save_after_failure(True, None, "last.ckpt")
    assert not reliability.refuse_save_after_failure(True, mark_agreed(ValueError("every rank")), "last.ckpt")
    assert not reliability.failed
    assert reliability.refuse_save_after_failure(True, error, "exc/on_exception.ckpt")
    assert reliability.failed
    assert "checkpoint 'exc/on_exception.ckpt' not saved: this rank failed (RuntimeError)" in capsys.readouterr().out
    reliability.on_exception(error)  # Lightning's Strategy.on_exception afterwards: already reported, once
