"""Hugging Face folders <-> LightningModule state dicts (``lightning_3d.checkpoint.hf``), in one process.

A tiny Llama held as ``self.model``: its state dict -> ``export_hf`` folder -> ``from_pretrained`` gives the same
logits; the folder -> ``read_hf_folder`` gives back the same state dict; ``LoadWeights`` takes the folder; and
``python -m lightning_3d.checkpoint export-hf`` exports a checkpoint folder (written here with DCP in the
ThreeDStrategy format: ``state_dict.<key>`` tensors + ``meta.pt``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from lightning_3d.checkpoint import LoadWeights
from lightning_3d.checkpoint.__main__ import main as checkpoint_cli
from lightning_3d.checkpoint.hf import (
    HF_CONFIG_KEY,
    export_hf,
    guard_save_pretrained,
    hf_configs,
    hf_model_attr,
    infer_prefix,
    is_hf_folder,
    read_hf_folder,
)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class Holder(nn.Module):
    """Stands for a LightningModule holding the Hugging Face model as ``self.model``."""

    def __init__(self, seed: int, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = AutoConfig.for_model(
            "llama",
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            tie_word_embeddings=tie,
            use_cache=False,
        )
        self.model = AutoModelForCausalLM.from_config(config)
        self.model.eval()


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        return model(input_ids=ids).logits


def stored_keys(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("tie", [False, True])
def test_export_then_from_pretrained_gives_identical_logits(tmp_path: Path, tie: bool) -> None:
    holder = Holder(seed=0, tie=tie)
    out = export_hf(holder.state_dict(), tmp_path / "hf", holder.model.config)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and is_hf_folder(out)
    keys = stored_keys(out)
    assert not any(k.startswith("model.model.") for k in keys), "the attribute prefix was not stripped"
    assert ("lm_head.weight" in keys) is (not tie), "a tied head must be stored once (as the embedding)"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert torch.equal(logits(loaded), logits(holder.model))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie


@pytest.mark.parametrize("tie", [False, True])
def test_folder_to_state_dict_round_trip_and_load_weights(tmp_path: Path, tie: bool) -> None:
    holder = Holder(seed=0, tie=tie)
    out = export_hf(holder.state_dict(), tmp_path / "hf", holder.model.config, module_attr="model")
    other = Holder(seed=1, tie=tie)
    assert not torch.equal(logits(other.model), logits(holder.model))
    state_dict = read_hf_folder(out, other)
    expected = holder.state_dict()
    assert list(state_dict) == list(expected)  # keyed like the module, tied names included
    for key, value in expected.items():
        assert torch.equal(state_dict[key], value), key
    # LoadWeights takes the folder (a strategy without load_full_state_dict: plain load_state_dict)
    LoadWeights(out).on_fit_start(SimpleNamespace(strategy=object()), other)  # type: ignore[arg-type]
    assert torch.equal(logits(other.model), logits(holder.model))
    # without a module: AutoModelForCausalLM, attribute "model"
    assert list(read_hf_folder(out)) == list(expected)


def _write_checkpoint(folder: Path, holder: nn.Module, hf_config: dict | None) -> None:
    """A checkpoint folder in ThreeDStrategy's format (DCP ``state_dict.*`` + ``meta.pt``), in one process."""
    dcp.save({"state_dict": dict(holder.state_dict())}, checkpoint_id=folder, no_dist=True)
    meta: dict = {"epoch": 0, "global_step": 3, "lightning_3d": {"keys": list(holder.state_dict())}}
    if hf_config is not None:
        meta[HF_CONFIG_KEY] = hf_config
    torch.save(meta, folder / "meta.pt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_cli_export_hf_from_a_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holder = Holder(seed=0, tie=True)
    ckpt = tmp_path / "last.ckpt"
    _write_checkpoint(ckpt, holder, hf_configs(holder))
    assert checkpoint_cli(["export-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    assert "config.json" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), logits(holder.model))

    # no config stored: refused with a hint, then accepted with --config and --module-attr
    bare = tmp_path / "bare.ckpt"
    _write_checkpoint(bare, holder, None)
    assert checkpoint_cli(["export-hf", str(bare), str(tmp_path / "hf2")]) == 2
    assert "--config" in capsys.readouterr().err
    code = checkpoint_cli(
        ["export-hf", str(bare), str(tmp_path / "hf2"), "--config", str(tmp_path / "hf"), "--module-attr", "model"]
    )
    assert code == 0
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()), logits(holder.model))


def test_export_refuses_untied_values_of_tied_weights_and_unknown_prefix(tmp_path: Path) -> None:
    holder = Holder(seed=0, tie=True)
    state_dict = {k: v.clone() for k, v in holder.state_dict().items()}
    state_dict["model.lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match=r"ties model\.embed_tokens\.weight and lm_head\.weight"):
        export_hf(state_dict, tmp_path / "hf", holder.model.config)
    with pytest.raises(ValueError, match="lacks"):
        export_hf(holder.state_dict(), tmp_path / "hf", holder.model.config, module_attr="net")
    keys = ["a.weight", "b.weight"]
    assert infer_prefix({"x.a.weight": 0, "x.b.weight": 0, "y.a.weight": 0}, keys) == "x."
    with pytest.raises(ValueError, match="several prefixes"):
        infer_prefix({"x.a.weight": 0, "x.b.weight": 0, "y.a.weight": 0, "y.b.weight": 0}, keys)


def test_save_pretrained_guard_and_model_attr(tmp_path: Path) -> None:
    holder = Holder(seed=0)
    assert hf_model_attr(holder) == ("model", holder.model)
    with pytest.raises(ValueError, match="'other' is not one of them"):
        hf_model_attr(holder, "other")
    undo = guard_save_pretrained(holder, "its part of the model (pipeline stage(s) [0] of 2)")
    with pytest.raises(RuntimeError, match=r"self\.model\.save_pretrained\('.*'\) on this rank would write its part"):
        holder.model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    holder.model.save_pretrained(tmp_path / "given", state_dict=holder.model.state_dict())  # gathered by the caller
    assert is_hf_folder(tmp_path / "given")
    undo()
    holder.model.save_pretrained(tmp_path / "after")
    assert is_hf_folder(tmp_path / "after")


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.slow
def test_save_hf_during_fit_writes_what_one_device_writes_and_save_pretrained_is_refused(tmp_path: Path) -> None:
    """``trainer.strategy.save_hf`` at tp2 x pp2, called on every rank in ``on_train_start`` and ``on_train_end``:
    the folders load with ``from_pretrained`` and hold the single-device ``save_pretrained`` folders' weights
    (bitwise before training; within 1e-4 after two float32 steps). The model's own ``save_pretrained`` on rank 0
    is refused with the way that works (it wrote pipeline stage 0's layers alone, the others newly initialised)."""
    from launch import run_lightning

    init = tmp_path / "init.pt"
    run_lightning("save_hf_run.py", ["--layout", "single", "--init", init, "--out", tmp_path / "ref"], timeout=120)
    run_lightning("save_hf_run.py", ["--layout", "tp2pp2", "--init", init, "--out", tmp_path / "got"], timeout=300)
    for name, tolerance in (("start", 0.0), ("end", 1e-4)):
        ref, got = _weights(tmp_path / "ref" / name), _weights(tmp_path / "got" / name)
        assert set(got) == set(ref), name
        worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert worst <= tolerance, (name, worst)
    args = ["--layout", "tp2pp2", "--init", init, "--out", tmp_path / "plain", "--plain"]
    result = run_lightning("save_hf_run.py", args, timeout=300, check=False)
    assert result.returncode != 0 and not (tmp_path / "plain" / "end").exists()
    assert "self.model.save_pretrained(" in result.output
    assert "would write its part of the model (pipeline stage(s) [0] of 2, tensor-parallel shard 0 of 2)" in (
        result.output
    )
    assert "Call trainer.strategy.save_hf(path) instead, on every rank" in result.output
