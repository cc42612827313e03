"""Example LightningModules and data for lightning_3d."""

from lightning_3d_examples.gpt import GPT, PRESETS, GPTConfig, generate
from lightning_3d_examples.hf_llama import HF_LLAMA_PRESETS, HFCausalLM
from lightning_3d_examples.mlp import BlobsDataModule, MLPClassifier
from lightning_3d_examples.text_data import ByteTextDataModule, decode, encode

__all__ = [
    "GPT",
    "HF_LLAMA_PRESETS",
    "PRESETS",
    "BlobsDataModule",
    "ByteTextDataModule",
    "GPTConfig",
    "HFCausalLM",
    "MLPClassifier",
    "decode",
    "encode",
    "generate",
]
