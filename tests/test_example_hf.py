"""The Hugging Face example (``lightning_3d_examples.HFCausalLM``) on one CPU device, and ``model=hf_llama``.

The module trains under plain Lightning with Hugging Face's own loss, which must be the standard next-byte
loss over every position of ``ByteTextDataModule``'s ``(x, y)`` windows; the Hydra app builds it from
``conf/model/hf_llama.yaml`` and samples from it at the end. A few seconds on one CPU thread.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from transformers.utils import logging as hf_logging

from lightning_3d.checkpoint.hf import HF_CONFIG_KEY
from lightning_3d.train.app import CONF_DIR, _register_resolvers, build
from lightning_3d.train.callbacks import SampleText
from lightning_3d.train.config import register_configs
from lightning_3d_examples import HF_LLAMA_PRESETS, ByteTextDataModule, HFCausalLM

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
hf_logging.set_verbosity_error()


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))


@pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`:UserWarning")
def test_loss_is_the_next_byte_cross_entropy_over_every_position() -> None:
    torch.manual_seed(0)
    model = HFCausalLM("tiny", block_size=16)
    model.configure_model()
    assert type(model.model).__name__ == "LlamaForCausalLM"
    assert model.model.config.use_cache is False and model.model.config.vocab_size == 256
    dm = ByteTextDataModule(block_size=16, batch_size=4, max_bytes=20_000)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    loss = model.training_step((x, y), 0)
    logits = model(x)
    expected = F.cross_entropy(logits.reshape(-1, 256).float(), y.reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    dropped_last = F.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), y[:, :-1].reshape(-1))
    assert abs(loss.item() - dropped_last.item()) > 1e-6  # all 16 positions count, not 15


def test_trains_a_few_steps_with_loss_decreasing() -> None:
    L.seed_everything(0, verbose=False)
    model = HFCausalLM("tiny", lr=1e-2, block_size=32)
    dm = ByteTextDataModule(block_size=32, batch_size=8, max_bytes=50_000)
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[losses],
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert len(losses.losses) == 3
    assert losses.losses[0] == pytest.approx(5.55, abs=0.1)  # uniform over 256 bytes: ln 256 = 5.545
    assert losses.losses[0] > losses.losses[1] > losses.losses[2], losses.losses
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    assert checkpoint[HF_CONFIG_KEY]["model"]["model_type"] == "llama"


def _compose(overrides: list[str]):  # type: ignore[no-untyped-def]
    register_configs()
    _register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_hf_llama_config_matches_the_preset_and_builds(tmp_path: Path) -> None:
    cfg = _compose(["model=hf_llama", "trainer.max_steps=10"])
    for field, value in HF_LLAMA_PRESETS["small"].items():
        assert cfg.model[field] == value, f"conf/model/hf_llama.yaml: {field}={cfg.model[field]}, preset {value}"
    cfg.run_dir = str(tmp_path)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert cfg.data.block_size == cfg.model.block_size == 64
    trainer, model, data = build(cfg)
    assert isinstance(data, ByteTextDataModule) and data.block_size == 64
    assert isinstance(model, HFCausalLM) and model.hparams.max_steps == 10
    assert any(isinstance(cb, SampleText) for cb in trainer.callbacks)
    model.configure_model()
    assert model.model.config.num_key_value_heads == 2 and model.model.config.max_position_embeddings == 64
    with pytest.raises(ConfigCompositionException):
        _compose(["model=hf_llama", "model.hidden_sz=64"])


def test_sample_text_from_an_hf_model_is_deterministic() -> None:
    torch.manual_seed(0)
    model = HFCausalLM("tiny", block_size=16)
    model.configure_model()
    trainer = SimpleNamespace(strategy=object(), is_global_zero=True, global_step=0)
    texts = []
    for _ in range(2):
        callback = SampleText(prompt="def ", max_new_tokens=20, temperature=0.8, top_k=40, seed=3)
        callback.on_train_end(trainer, model)  # type: ignore[arg-type]
        texts.append(callback.text)
    assert texts[0] == texts[1] and texts[0] is not None and texts[0].startswith("def ")
    assert len(texts[0].encode("utf-8", errors="surrogateescape")) >= 4 + 1
