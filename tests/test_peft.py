"""PEFT LoRA on a Hugging Face Llama at tp2 x pp2 and pp2 x FSDP dp2, against one device (float64)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import run_lightning


def _run(tmp_path: Path, layout: str) -> dict:
    out = tmp_path / f"{layout}.json"
    args = ["--layout", layout, "--init", tmp_path / "init.pt", "--out", out]
    if layout != "single":
        args += ["--ref", tmp_path / "single.pt"]
    run_lightning("lora_run.py", args, timeout=120 if layout == "single" else 300)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2pp2", "pp2fsdp"])
def test_lora_adapters_start_as_peft_makes_them_and_train_as_on_one_device(tmp_path: Path, layout: str) -> None:
    """Built in ``configure_model`` (on the meta device), the adapters start as PEFT makes them: ``B`` zero (on the
    token embedding ``A``), so the adapted model is the base model (the model's own ``_init_weights`` drew ``B`` from
    a normal before, on every layout). At tp2 the plan's styles go to the LoRA layer's base and adapters
    (column-parallel base: ``B`` sharded with it; row-parallel: ``A``; the embedding's adapters whole); before, setup
    refused *"style 'colwise' on ...q_proj (Linear) applies to linear and conv1d modules only"*, as for the head's
    ``modules_to_save`` wrapper, whose original and trained copy now get its style (the copy starts as the original;
    drawn on its own before). Four AdamW steps on the adapters and the copy: the losses and trained weights match one
    device to round-off, the frozen base does not move. ``strategy.save_hf`` writes the adapters as one device's
    ``save_pretrained``; rank 0's own ``self.model.save_pretrained`` is refused (it wrote stage 0's adapters alone)."""
    ref, got = _run(tmp_path, "single"), _run(tmp_path, layout)
    for report in ref["reports"] + got["reports"]:
        assert report["adapters"] > 0 and report["b_zero"] and report["a_nonzero"], got["reports"]
        assert report["copy_is_original"], got["reports"]
    # LoRA on the embedding (first stage): A zero, B drawn, and the same B on the tp peers that hold it whole (drawn
    # with per-module seeds on the meta device, so not one device's global-generator draw); its base
    # vocabulary-parallel at tp2. Until 2026-12-06 tp > 1 refused it, and on the meta device A was left as drawn
    # instead of zero: a start that was not the base model's.
    holders = [r for r in ref["reports"] + got["reports"] if r["embedding"]]
    assert len(holders) == 3, got["reports"]  # one device, two first-stage ranks (tp peers or dp replicas)
    for report in holders:
        (a_name, a_zero, a_finite, _), (b_name, b_zero, b_finite, _) = report["embedding"]
        assert (a_name, b_name) == ("lora_embedding_A", "lora_embedding_B") and a_zero and not b_zero, report
        assert a_finite and b_finite, report
    # base, A, B: at tp2 the base sharded over the vocabulary, the adapters whole; under FSDP all three sharded
    assert holders[0]["embedding_dtensors"] == [False] * 3, holders[0]
    for report in holders[1:]:
        assert report["embedding_dtensors"] == ([True, False, False] if layout == "tp2pp2" else [True] * 3), report
    if layout == "tp2pp2":  # (under FSDP each rank holds a shard of them)
        assert len({r["embedding"][1][3] for r in holders[1:]}) == 1, holders
    assert len(got["train"]) == 4
    for a, b in zip(got["train"], ref["train"], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b), (got["train"], ref["train"])
    assert abs(got["val"] - ref["val"]) <= 1e-12 * abs(ref["val"]), (got["val"], ref["val"])
    assert got["adapters_moved"] > 1e-3 and got["adapter_diff"] < 1e-12, got
    assert got["base_diff"] == 0.0, got
    # the adapters written by strategy.save_hf are one device's save_pretrained's (pp2 wrote stage 0's 16 of 32)
    assert got["saved_keys_equal"] and got["saved_diff"] < 1e-12 and got["saved_config_equal"], got
    assert "self.model.save_pretrained(" in got["refused"] and "trainer.strategy.save_hf(path)" in got["refused"]
