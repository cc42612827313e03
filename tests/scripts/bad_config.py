"""A job with one configuration error; every rank must raise the same clear error and exit, none may hang.

Usage: ``python bad_config.py CASE`` (Lightning's launcher starts the ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import HFCausalLM, NanoGPT, TinyGPT, TinyMLP, dataset, loader


class NoBody(TinyMLP):
    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.layers = nn.ModuleList([nn.Linear(16, 4)])

    def forward(self, x):
        return self.layers[0](x)


class OutsideParameter(TinyMLP):
    def configure_model(self) -> None:
        super().configure_model()
        self.scale = nn.Parameter(torch.ones(()))


class RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.weight


class NoResetParameters(TinyMLP):
    def configure_model(self) -> None:
        if not hasattr(self, "body"):
            self.body = nn.Sequential(RawParameter(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 4))


class BodyNotCalled(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(x[:, :4], y)


class FiveHeads(TinyGPT):
    heads, dim = 5, 20


class SkipAcrossStages(NanoGPT):
    """A U-Net-like skip added between two blocks: the first block's output is added to the second's, which is the
    input of the third, on the next stage at pp=2. A module's output a later stage reads is carried across the
    boundary (``core/carry.py``: added after the last block, this skip trains), but a sum made between the blocks on
    either side of a boundary would be lost there."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x)
            if i == 0:
                skip = x
            if i == 1:
                x = x + skip
        return self.lm_head(self.transformer.ln_f(x))


class SkipFoundAtSetup(SkipAcrossStages):
    """The same skip, in a module with an ``example_input_array``: found at setup, on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)


class ResidualOutsideBlocks(NanoGPT):
    """The residual is added in the model's loop, not inside the block: the stage input would be overwritten."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = x + block(x)
        return self.lm_head(self.transformer.ln_f(x))


class NoContainer(TinyMLP):
    def configure_model(self) -> None:
        if not hasattr(self, "first"):
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class WorldRankData(TinyMLP):
    """The DDP habit: the data split by the world's ranks, so the two pipeline stages of the one replica read
    different samples."""

    def train_dataloader(self) -> DataLoader:
        data = dataset("mlp", 48)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(data, range(rank, len(data), world)), batch_size=8)


# case: (module, strategy kwargs, devices, per-replica batch)
CASES = {
    "no_body": (NoBody, {"pp": 2}, 2, 8),
    "outside_parameter": (OutsideParameter, {"pp": 2}, 2, 8),
    "too_few_layers": (TinyMLP, {"pp": 5, "micro_batches": 5}, 5, 10),
    "no_reset_parameters": (NoResetParameters, {"pp": 2}, 2, 8),
    "batch_not_divisible": (TinyMLP, {"pp": 2, "micro_batches": 4}, 2, 6),
    "body_not_called": (BodyNotCalled, {"pp": 2}, 2, 8),
    "heads_not_divisible": (FiveHeads, {"tp": 2}, 2, 8),
    "skip_across_stages": (SkipAcrossStages, {"pp": 2}, 2, 8),
    "residual_outside_blocks": (ResidualOutsideBlocks, {"pp": 2}, 2, 8),
    "skip_found_at_setup": (SkipFoundAtSetup, {"pp": 2}, 2, 8),
    "no_container": (NoContainer, {"pp": 2}, 2, 8),
    "kv_heads_not_divisible": (lambda: HFCausalLM("llama"), {"tp": 4}, 4, 8),
    "batch_per_world_rank": (WorldRankData, {"pp": 2}, 2, 8),
}


def main() -> None:
    module_cls, kwargs, devices, batch = CASES[sys.argv[1]]
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ThreeDStrategy(print_layout=False, **kwargs),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = module_cls()
    model_name = "gpt" if isinstance(model, (TinyGPT, NanoGPT, HFCausalLM)) else "mlp"
    if isinstance(model, WorldRankData):
        trainer.fit(model)  # its own train_dataloader
    else:
        trainer.fit(model, loader(model_name, batch, n=48))


if __name__ == "__main__":
    main()
