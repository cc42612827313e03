"""Validation, test, predict and torchmetrics through the pipeline equal single-device runs.

scripts/eval_run.py trains with sanity validation on and validation every 2 batches (mid-epoch), then calls
validate, test and predict. The validation/test sets end with a short batch that the micro-batch count does
not divide. Compared with the single-device reference: training values per step (so interleaved validation
does not change training), each validation epoch's loss and torchmetrics accuracy, what EarlyStopping and
ModelCheckpoint (monitoring a metric) decided from them, validate/test results,
and the predictions of each data-parallel replica (its share of the samples, in dataset order).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import copy_inits
from launch import run_lightning

LAYOUTS = [(2, 2, 2), (1, 4, 1)]
# a V schedule: four stages on two ranks, the first and the last on rank 0 (evaluation runs forward-only over them)
SCHEDULES = {(1, 2, 1): ("dualpipev", 2)}


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "dp"),
    [*LAYOUTS, *SCHEDULES],
    ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS] + [f"{s[0]}-pp{p}" for (_, p, _), s in SCHEDULES.items()],
)
def test_evaluation_matches_single_device(eval_reference, tmp_path, tp, pp, dp):
    copy_inits(eval_reference, tmp_path)
    schedule, stages_per_rank = SCHEDULES.get((tp, pp, dp), ("1f1b", 1))
    args = ["--tp", tp, "--pp", pp, "--dp", dp, "--schedule", schedule, "--stages-per-rank", stages_per_rank]
    run_lightning("eval_run.py", [*args, "--out", tmp_path], timeout=300)
    ref = torch.load(eval_reference / "eval.pt", weights_only=False)
    got = torch.load(tmp_path / "eval.pt", weights_only=False)
    assert got["sanity_ran"] == ref["sanity_ran"] == 1
    assert len(got["train"]) == len(ref["train"]) == 6
    for step, (r, g) in enumerate(zip(ref["train"], got["train"])):
        assert set(g) == set(r) == {"train_loss", "train_acc_step"}, step
        assert all(_close(g[k], r[k]) for k in r), (step, g, r)
    assert len(got["val"]) == len(ref["val"]) >= 2
    for r, g in zip(ref["val"], got["val"]):
        assert set(g) == set(r) == {"val_loss", "val_acc"}
        assert all(_close(g[k], r[k]) for k in r), (g, r)
    assert _close(got["early_stopping_best"], ref["early_stopping_best"])
    assert _close(got["checkpoint_best"][0], ref["checkpoint_best"][0])
    assert got["checkpoint_best"][1] == ref["checkpoint_best"][1]  # the same step was the best
    for kind in ("validate", "test"):
        assert set(got[kind]) == set(ref[kind]) and got[kind], kind
        assert all(_close(got[kind][k], ref[kind][k]) for k in ref[kind]), (kind, got[kind], ref[kind])
    # Replica 0 reads samples 0, dp, 2dp, ... (the strategy's sampler arguments): its predictions are those rows.
    expected = ref["predict"][0::dp]
    assert got["predict"].shape == expected.shape
    torch.testing.assert_close(got["predict"], expected, rtol=1e-5, atol=1e-6)
    # Lightning's documented writer (a file per global rank): one file per replica, each prediction written once
    # (until 2026-12-05 every rank of a replica wrote it: tp * pp copies)
    written = sorted((tmp_path / "written").glob("predictions_*.pt"))
    assert len(written) == dp, written
    rows: dict[int, torch.Tensor] = {}
    for file in written:
        predictions, (batch_indices,) = torch.load(file, weights_only=False)  # the indices are per dataloader
        for batch, indices in zip(predictions, batch_indices, strict=True):
            for row, index in zip(batch, indices, strict=True):
                assert index not in rows, index
                rows[index] = row
    assert sorted(rows) == list(range(len(ref["predict"])))
    torch.testing.assert_close(torch.stack([rows[i] for i in sorted(rows)]), ref["predict"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2", "pp2dp2"])
def test_state_kept_by_the_step_counts_each_micro_batch_once(tmp_path, layout):
    """A block-container model (the per-stage step path) without sanity validation: the training accuracy's epoch
    value, the validation and test accuracies, and the last step's macro F1 and precision (tensors a
    ``MetricCollection``'s forward returned, logged) equal one device's (float64, 1e-10); the list that
    ``validation_step`` appends to holds one entry per micro-batch on the last stage (mean: the batch's at tp2 x
    pp2; each replica's own half at dp2, as under DDP); and Lightning's documented epoch-end recipe (stack the list
    in ``on_*_epoch_end`` and log its mean) logs what one device logs (``sync_dist=True`` for training; without it
    validation logs replica 0's mean at dp2, as DDP's rank 0 does), from the module's hook and from a callback of
    the user's alike.

    Before the fixes torch's shape-inference forward ran the last stage's step once more on uninitialised memory
    at the first training and validation batch (the training accuracy counted micro-batch 0 twice, 0.0347 against
    0.03125, and the list held a fifth entry, NaN), and the recipe died on the first stage's ranks, where the list
    is empty (*"stack expects a non-empty TensorList"*), as did the callback until 2026-12-05; the macro values
    were the mean of the micro-batches'."""

    def run(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        args = ["--layout", name, "--init", tmp_path / "init.pt", "--out", out]
        run_lightning("eval_state_run.py", args, timeout=120 if name == "single" else 300)
        return json.loads(out.read_text())

    ref, got = run("single"), run(layout)
    for row in (ref, got):  # the user's callback read the last stage's list (it died on rank 0's empty one)
        assert row["val_callback_average"] == row["val_epoch_average"], row
    for key in ("train_acc", "val_acc", "test_acc", "train_epoch_average", "train_f1", "train_prec"):
        assert _close(got[key], ref[key], 1e-10), (key, got, ref)
    (ref_list,) = ref["val_lists"]
    assert ref_list[0]["entries"] == 2 and len(got["val_lists"]) == 2, got  # two last-stage ranks
    for lists in got["val_lists"]:
        assert [epoch["entries"] for epoch in lists] == [4], lists  # 2 batches x 2 micro-batches, no fifth
        assert all(epoch["mean"] == epoch["mean"] for epoch in lists), lists  # no NaN
    assert _close(ref["val_epoch_average"], ref_list[0]["mean"], 1e-12)
    if layout == "tp2pp2":
        assert all(_close(lists[0]["mean"], ref_list[0]["mean"], 1e-10) for lists in got["val_lists"]), got
        assert _close(got["val_epoch_average"], ref["val_epoch_average"], 1e-10), got
    else:  # the replicas' halves average to the whole; rank 0 logs replica 0's
        halves = [lists[0]["mean"] for lists in got["val_lists"]]
        assert _close(sum(halves) / 2, ref_list[0]["mean"], 1e-10), (halves, ref_list)
        assert got["val_epoch_average"] in halves and not _close(halves[0], halves[1], 1e-6), (got, halves)
