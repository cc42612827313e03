"""Exact resume: every rank's random-number state and the position in the training data.

A checkpoint (see ``checkpoint.py``) holds the weights, the optimizer and Lightning's loop counters; this
module holds the rest of what "continue exactly" needs:

* **RNG states** of every rank (torch CPU, CUDA, python ``random``, numpy), saved as tensors and plain types
  so that ``torch.load(weights_only=True)`` reads them. At the same layout rank ``r`` gets back its own
  state; at another layout a rank takes the state of the saved rank with the same (dp, pp, tp)
  coordinates modulo the saved degrees, so tensor-parallel peers still share their state.
* **Data position.** With a plain ``DataLoader``, Lightning restarts an interrupted epoch from its first
  batch (and warns that the loader is not resumable). :class:`ResumePosition` instead sets the sampler's
  epoch, restarts the loader's iterator and skips the batches the epoch had already consumed, then puts
  the RNG states back, right before the first training batch, so that a resumed run consumes random
  numbers in exactly the order the uninterrupted run did.

When the data-parallel degree changes, the skip is exact if the global batch (dp x per-replica batch) is
unchanged and the sampler deals samples round-robin over replicas (``DistributedSampler``): the replicas
together then consumed the first ``steps x global batch`` samples of the epoch's order, whatever dp is.
Otherwise the position is rounded down to whole new global batches, with a warning.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from ..core.rng import BodyRandomness
    from ..core.topology import Topology

_LIGHTNING_RESUME_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


# ------------------------------------------------------------------------------------------- RNG states
def rng_state(device: torch.device | None = None, randomness: BodyRandomness | None = None) -> dict[str, Any]:
    """This process's random-number states, as tensors and plain Python types (plus the body's streams)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if randomness is not None:
        state["streams"] = randomness.state_dict()
    return state


def set_rng_state(
    state: dict[str, Any], device: torch.device | None = None, randomness: BodyRandomness | None = None
) -> None:
    """Restore states written by :func:`rng_state` (the body's streams only into ``randomness``, if given)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if randomness is not None and "streams" in state:
        randomness.load_state_dict(state["streams"])


def source_rank(saved: dict[str, int], topology: Topology, rank: int) -> int:
    """The saved rank whose RNG state ``rank`` takes: itself at the same layout, else by coordinates."""
    dp, pp, tp = topology.shape
    if (saved["dp"], saved["pp"], saved["tp"]) == (dp, pp, tp):
        return rank
    c = topology.coordinates(rank)
    d, p, t = c["dp"] % saved["dp"], c["pp"] % saved["pp"], c["tp"] % saved["tp"]
    return (d * saved["pp"] + p) * saved["tp"] + t


# ------------------------------------------------------------------------------------------- data position
def train_batch_size(trainer: pl.Trainer) -> int | None:
    """The per-replica training batch size, when the training loader declares one."""
    loader = trainer.fit_loop._combined_loader
    if loader is None:
        return None
    sizes = set()
    for dl in loader.flattened:
        size = getattr(dl, "batch_size", None)
        if size is None:
            size = getattr(getattr(dl, "batch_sampler", None), "batch_size", None)
        sizes.add(size)
    return sizes.pop() if len(sizes) == 1 else None


def _consumed_batches(trainer: pl.Trainer) -> int:
    """Batches of the current epoch the checkpointed run had finished, counted as Lightning counts them."""
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress.current
    return progress.completed + (1 if epoch_loop.restarted_on_train_batch_end else 0)


def _skip_for_layout(k: int, saved: dict[str, Any], dp: int, batch: int | None) -> tuple[int, str | None]:
    """Batches to skip under the new layout and, if the position is not exact, why."""
    old_dp, old_batch = int(saved.get("dp", dp)), saved.get("batch_size")
    if old_dp == dp and (old_batch is None or batch is None or old_batch == batch):
        return k, None
    if old_batch is None or batch is None:
        return k, (
            f"the checkpoint was written with dp={old_dp} and this run has dp={dp}, but the per-replica batch size "
            f"is unknown, so {k} batches per replica are skipped as saved"
        )
    old_global, new_global = old_dp * old_batch, dp * batch
    if old_global == new_global:
        rank_zero_info(
            f"lightning_3d: dp changed from {old_dp} to {dp} with the same global batch ({new_global}): each replica "
            f"skips {k} batches, which resumes at the same sample of the epoch (exact for samplers that deal "
            "samples round-robin over replicas, as DistributedSampler does)."
        )
        return k, None
    samples = k * old_global
    new_k = samples // new_global
    return new_k, (
        f"the global batch changed from {old_global} (dp={old_dp} x {old_batch}) to {new_global} (dp={dp} x "
        f"{batch}): the epoch had consumed {samples} samples, so {new_k} new batches ({new_k * new_global} samples) "
        f"are skipped and {samples - new_k * new_global} samples are seen again"
    )


class ResumePosition(pl.Callback):
    """Put the data position and the RNG states back right before the first resumed training batch.

    Attached by ``ThreeDStrategy.load_checkpoint``; acts once, in ``on_train_start`` (after Lightning built
    the training loader and before it sets the sampler's epoch and fetches the first batch).

    Args:
        rng: the RNG state this rank restores, or ``None``.
        data: what the checkpoint recorded about the data (``dp``, per-replica ``batch_size``).
        dp: this run's data-parallel degree.
        device: this rank's device (for CUDA RNG).
        randomness: the body's random streams, restored from ``rng["streams"]``.
    """

    def __init__(
        self,
        rng: dict[str, Any] | None,
        data: dict[str, Any],
        dp: int,
        device: torch.device,
        randomness: BodyRandomness | None = None,
    ) -> None:
        self.rng, self.data, self.dp, self.device = rng, data, dp, device
        self.randomness = randomness
        self.done = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.done:
            return
        self.done = True
        fit_loop = trainer.fit_loop
        fetcher = fit_loop._data_fetcher
        combined = fit_loop._combined_loader
        if fetcher is None or combined is None:
            self._restore_rng()
            return
        from lightning.fabric.utilities.data import _set_sampler_epoch
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

        mid_epoch = fit_loop.restarted_mid_epoch
        k = _consumed_batches(trainer) if mid_epoch else 0
        if k >= trainer.num_training_batches:
            k = 0
        if k and all(hasattr(dl, "load_state_dict") for dl in combined.flattened):
            k = 0  # a resumable loader restored its own position (Lightning's ``combined_loader`` state)
        if type(fetcher) is not _PrefetchDataFetcher:
            if k:
                rank_zero_warn(
                    f"lightning_3d: cannot restore the data position with a {type(fetcher).__name__}; Lightning "
                    "replays the interrupted epoch from its first batch.",
                    stacklevel=1,
                )
            self._restore_rng()
            return
        if k and fetcher.length is None:
            rank_zero_warn(
                "lightning_3d: cannot restore the data position in a training loader without a length; Lightning "
                "replays the interrupted epoch from its first batch.",
                stacklevel=1,
            )
            k = 0
        skip, problem = _skip_for_layout(k, self.data, self.dp, train_batch_size(trainer)) if k else (0, None)
        if problem:
            rank_zero_warn(f"lightning_3d: the data position is approximate: {problem}.")  # every rank alike
        epoch = fit_loop.epoch_progress.current.processed
        for dl in combined.flattened:
            _set_sampler_epoch(dl, epoch)
        if k:
            # The uninterrupted run created this epoch's iterator before the saved RNG state; do the same.
            iter(fetcher)
            assert fetcher.iterator is not None
            for _ in range(skip):
                next(fetcher.iterator)
            self._restore_rng()
            warnings.filterwarnings("ignore", message=_LIGHTNING_RESUME_WARNING)
            rank_zero_info(
                f"lightning_3d: resumed epoch {epoch} after its first {skip} batches (data position restored)."
            )
        else:
            # At an epoch boundary the uninterrupted run created the next epoch's iterator after the save.
            self._restore_rng()
            iter(fetcher)

    def _restore_rng(self) -> None:
        if self.rng is not None:
            set_rng_state(self.rng, self.device, self.randomness)


# ------------------------------------------------------------------------------------------- elastic restart
ELASTIC_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def elastic_ckpt_path(ckpt_path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The checkpoint ``trainer.fit`` resumes from: ``"last"`` when torchrun restarted the group, else ``ckpt_path``.

    torchrun (``--max-restarts N``) sets ``TORCHELASTIC_RESTART_COUNT`` to the attempt number (0 first). On a
    restart, with no explicit ``ckpt_path``, Lightning's ``ckpt_path="last"`` picks the newest complete
    checkpoint of the run's ``ModelCheckpoint`` folder (partial saves have dot-names it does not see); if there
    is none yet, Lightning warns and training starts from scratch. An explicit ``ckpt_path`` always wins.

    Args:
        ckpt_path: the path the user asked for (``None``: start fresh).
        environ: the process environment.

    Returns:
        The value for ``trainer.fit(ckpt_path=...)``.
    """
    if ckpt_path is None and environ.get(ELASTIC_RESTART_ENV, "0").strip() not in ("", "0"):
        return "last"
    return ckpt_path


def elastic_store_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a torchrun restart may fail to form its process group, or ``None``.

    By default torchrun's c10d rendezvous shares its agent's TCPStore with the workers, and (torch 2.13) keeps
    that store across restarts without a per-attempt prefix: a restarted rank can read the address a rank of the
    previous attempt published and fail to connect (pytorch/pytorch#135712, #167288). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment, rank 0 hosts a fresh store each attempt.

    Args:
        environ: the process environment.

    Returns:
        A one-line warning on a restarted attempt that uses the shared store, else ``None``.
    """
    restarted = environ.get(ELASTIC_RESTART_ENV, "0").strip() not in ("", "0")
    if restarted and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (
            "lightning_3d: torchrun restarted the group with its shared rendezvous store, which still holds the "
            "previous attempt's addresses; if the process group fails to connect, launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch/pytorch#135712)."
        )
    return None
