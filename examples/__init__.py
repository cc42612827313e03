"""Example LightningModules and data for lightning_3d."""

from lightning_3d_examples.gpt import GPT, PRESETS, GPTConfig, generate
from lightning_3d_examples.mlp import BlobsDataModule, MLPClassifier
from lightning_3d_examples.text_data import ByteTextDataModule, decode, encode

__all__ = [
    "GPT",
    "PRESETS",
    "BlobsDataModule",
    "ByteTextDataModule",
    "GPTConfig",
    "MLPClassifier",
    "decode",
    "encode",
    "generate",
]
