"""Validation, test, predict and torchmetrics through the pipeline equal single-device runs.

scripts/eval_run.py trains with sanity validation on and validation every 2 batches (mid-epoch), then calls
validate, test and predict. The validation/test sets end with a short batch that the micro-batch count does
not divide. Compared with the single-device reference: training values per step (so interleaved validation
does not change training), each validation epoch's loss and torchmetrics accuracy, what EarlyStopping and
ModelCheckpoint (monitoring a metric) decided from them, validate/test results,
and the predictions of each data-parallel replica (its share of the samples, in dataset order).
"""

from __future__ import annotations

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
