"""The smallest useful example: an MLP classifier on synthetic Gaussian blobs.

It follows the same contract as the GPT (one ``nn.Sequential`` called ``body`` built in
``configure_model``) and adds a torchmetrics metric, so the strategy's handling of metric objects
(``self.log("val_acc", self.val_acc)``) is exercised by a model that trains in seconds.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from lightning import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class MLPClassifier(LightningModule):
    """Multi-layer perceptron: ``depth`` hidden Linear+ReLU layers, then a Linear to the classes.

    Args:
        in_features: input width.
        hidden: hidden width.
        num_classes: number of classes (output width).
        depth: number of hidden layers; the body is ``Linear, ReLU`` x depth then ``Linear``.
        lr: Adam learning rate.
        example_batch: samples in one micro-batch; when given, ``example_input_array`` is that many zero
            feature vectors (what ``partitioner="compute"`` / ``"memory"`` run on). The training app passes its
            micro-batch.
    """

    def __init__(
        self,
        in_features: int = 16,
        hidden: int = 64,
        num_classes: int = 4,
        depth: int = 2,
        lr: float = 1e-2,
        example_batch: int | None = None,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLPClassifier: depth={depth} must be >= 1 (number of hidden layers).")
        self.save_hyperparameters()
        if example_batch:
            self.example_input_array = torch.zeros(example_batch, in_features)
        # The metric is created here, not in configure_model: its states are not parameters and must not
        # be built on the meta device.
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)

    def configure_model(self) -> None:
        """Build the layers (idempotent)."""
        if hasattr(self, "body"):
            return
        hp = self.hparams
        widths = [hp.in_features] + [hp.hidden] * hp.depth
        layers: list[nn.Module] = []
        for w_in, w_out in itertools.pairwise(widths):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], hp.num_classes))
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Features ``(B, in_features)`` to logits ``(B, num_classes)``."""
        return self.body(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.val_acc.update(logits, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        # Logging the metric object: Lightning computes (and syncs) it once at the end of the epoch.
        self.log("val_acc", self.val_acc, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("test_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Logits for the inputs (a batch may be ``x`` or ``(x, y)``)."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class BlobsDataModule(LightningDataModule):
    """Gaussian blobs: one random centre per class, points scattered around it.

    Fully deterministic for a given ``seed`` (a private ``torch.Generator``), so every rank builds the
    same tensors in ``setup()`` without any file or communication.

    Args:
        num_samples: total points, split into train / val / test.
        in_features: dimension of the points.
        num_classes: number of blobs.
        batch_size: batch size of every loader.
        seed: seed of the data generator.
        cluster_std: spread of each blob; centres are N(0, 1), so 1.0 lets a small MLP reach ~98%.
        val_fraction: share of the points used for validation (and, again, for test).
    """

    def __init__(
        self,
        num_samples: int = 2048,
        in_features: int = 16,
        num_classes: int = 4,
        batch_size: int = 64,
        seed: int = 0,
        cluster_std: float = 1.0,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 0.5:
            raise ValueError(f"BlobsDataModule: val_fraction={val_fraction} must be in (0, 0.5).")
        self.save_hyperparameters()
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        """Generate the three splits (cheap; identical on every rank)."""
        if hasattr(self, "train_set"):
            return
        hp = self.hparams
        g = torch.Generator().manual_seed(hp.seed)
        centres = torch.randn(hp.num_classes, hp.in_features, generator=g)
        # Balanced classes in random order.
        y = torch.arange(hp.num_samples) % hp.num_classes
        y = y[torch.randperm(hp.num_samples, generator=g)]
        x = centres[y] + hp.cluster_std * torch.randn(hp.num_samples, hp.in_features, generator=g)
        n_val = n_test = int(hp.num_samples * hp.val_fraction)
        n_train = hp.num_samples - n_val - n_test
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        self.val_set = TensorDataset(x[n_train : n_train + n_val], y[n_train : n_train + n_val])
        self.test_set = TensorDataset(x[n_train + n_val :], y[n_train + n_val :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, drop_last=False)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size, drop_last=False)
