"""Byte-level language-modelling data that needs no download.

By default the corpus is the Python standard library's own ``.py`` sources, found at run time under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded) and read in sorted order: real text,
a few MB of it on every machine that runs Python, identical on every rank, and nothing to commit.
Any other text file can be used with ``path=``. Tokens are raw bytes, so the vocabulary is 256.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256

# Directories under the stdlib path that are not the stdlib (they differ from one install to the next).
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as a 1-D LongTensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: Tensor | Iterable[int]) -> str:
    """Token ids back to text; bytes that are not valid UTF-8 become U+FFFD instead of raising."""
    if isinstance(tokens, Tensor):
        tokens = tokens.flatten().tolist()
    return bytes(tokens).decode("utf-8", errors="replace")


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(path: str | os.PathLike | None = None, max_bytes: int = 2_000_000) -> bytes:
    """The first ``max_bytes`` bytes of ``path``, or of the stdlib sources concatenated when it is None."""
    if path is not None:
        with open(path, "rb") as f:
            return f.read(max_bytes)
    chunks, total = [], 0
    for file in stdlib_sources():
        if total >= max_bytes:
            break
        data = file.read_bytes()
        chunks.append(data)
        total += len(data)
    if not chunks:
        root = sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(f"ByteTextDataModule: no .py files under {root!r}; pass path= to a text file.")
    return b"".join(chunks)[:max_bytes]


class ByteWindows(Dataset):
    """Contiguous, non-overlapping windows of ``block_size + 1`` bytes as ``(x, y)`` shifted by one."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data = data  # uint8, 1 byte per token: 2 MB of corpus is 2 MB of memory
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) // (self.block_size + 1)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        n = self.block_size + 1
        window = self.data[i * n : (i + 1) * n].long()
        return window[:-1], window[1:]


class ByteTextDataModule(LightningDataModule):
    """Byte-level language-modelling DataModule.

    The corpus is cut into ``len(corpus) // (block_size + 1)`` windows; the last ``val_fraction`` of them
    (the end of the corpus) is the validation set, the rest the training set.

    Args:
        path: a text file; None uses the Python standard library's sources.
        block_size: context length of a sample (a window holds ``block_size + 1`` bytes).
        batch_size: samples per batch (per data-parallel replica once Lightning adds its sampler).
        val_fraction: share of the windows kept for validation, in [0, 1).
        max_bytes: read at most this many bytes of the corpus.
        num_workers: DataLoader worker processes.
    """

    vocab_size = VOCAB_SIZE
    encode = staticmethod(encode)
    decode = staticmethod(decode)

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        max_bytes: int = 2_000_000,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"ByteTextDataModule: val_fraction={val_fraction} must be in [0, 1).")
        self.save_hyperparameters()
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        """Read the corpus once per process (a few ms to read 2 MB) and split it by position."""
        if hasattr(self, "train_set"):
            return
        corpus = read_corpus(self.path, self.max_bytes)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n = self.block_size + 1
        n_windows = len(data) // n
        n_val = round(n_windows * self.val_fraction)
        n_train = n_windows - n_val
        if n_train < 1 or (self.val_fraction > 0 and n_val < 1):
            raise ValueError(
                f"ByteTextDataModule: {len(data)} bytes make {n_windows} windows of {n} bytes, too few for "
                f"val_fraction={self.val_fraction}; use a longer corpus, a larger max_bytes or a smaller "
                "block_size."
            )
        self.train_set = ByteWindows(data[: n_train * n], self.block_size)
        self.val_set = ByteWindows(data[n_train * n : n_windows * n], self.block_size)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        # shuffle=True: under a distributed strategy Lightning swaps in a DistributedSampler that shuffles.
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
