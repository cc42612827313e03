"""B8's host-synchronisation counter: what it counts and what it does not."""

from __future__ import annotations

import torch

from benchmarks.b8_sync import LAYOUTS, SyncCounter, added


def _count(fn) -> dict:
    counter = SyncCounter()
    with counter:
        counter.begin()
        fn()
        counter.end()
        fn()  # outside the window: not counted
    return counter.summary()


def test_item_bool_float_tolist_cpu_numpy_and_to_cpu_are_counted() -> None:
    t = torch.ones(3)

    def step() -> None:
        t.sum().item()
        bool(t.sum() > 0)
        float(t[0])
        t.tolist()
        t.cpu()
        t.numpy()
        t.to("cpu")

    summary = _count(step)
    assert summary["per_step"] == 7, summary
    kinds = sorted(k.split(":")[0] for k in summary["sources"])  # one source per line of `step`
    assert kinds == ["cpu", "item", "item", "item", "numpy", "to('cpu')", "tolist"], kinds
    assert all("test_sync_counter.py" in k for k in summary["sources"])  # the caller is named


def test_device_side_arithmetic_is_not_counted() -> None:
    t = torch.ones(3, requires_grad=True)

    def step() -> None:
        loss = (t * 2 + 1).sum()
        loss.backward()
        torch.stack([loss.detach(), loss.detach()]).to(torch.float64)
        t.detach().to(torch.device("cpu"))  # a move to the training device: not told apart on CPU, not counted

    assert _count(step)["per_step"] == 0


def test_optimizer_counters_are_listed_not_counted() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1)

    def step() -> None:
        p.grad = torch.ones(2)
        opt.step()

    summary = _count(step)
    assert summary["per_step"] == 0 and summary["optimizer_per_step"] >= 1, summary


def test_added_per_step_and_per_micro_batch() -> None:
    baseline = {"per_step": 2, "in_micro_batches_per_step": 0}
    layouts = {
        "tp1_pp1": {"per_step": 3, "in_micro_batches_per_step": 2},  # m=1: the user's 2 per step, nothing more
        "tp2_pp2_dp2_1f1b_m4": {"per_step": 12, "in_micro_batches_per_step": 10},  # (10 - 2) / 4 = 2 per micro-batch
    }
    measured, per_micro, rows = added(layouts, baseline)
    assert LAYOUTS["tp2_pp2_dp2_1f1b_m4"]["micro_batches"] == 4
    assert measured == 10 and per_micro == 2.0
    assert rows["tp1_pp1"] == {"added_per_step": 1, "added_per_micro_batch": 0.0, "micro_batches": 1}
