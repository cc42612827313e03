"""A checkpoint folder read as the single file one device's Lightning writes (``checkpoint/lightning_file.py``).

The folders here are written in one process the way ``checkpoint.save_checkpoint`` lays them out (DCP tensors under
``state_dict.`` / ``model_copy_<i>.``, each tied weight once, ``meta.pt`` with the rest and the ``lightning_3d``
section); ``tests/test_weight_averaging.py`` reads folders written by 4-process runs against one device's files.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core import saving
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_3d  # noqa: F401  (makes Lightning's loader read folders)
from lightning_3d.checkpoint import META_FILE, SECTION
from lightning_3d.checkpoint.__main__ import main
from lightning_3d.checkpoint.lightning_file import (
    _optimizer_by_name,
    consolidate,
    is_checkpoint_folder,
    lightning_checkpoint,
    read_folders_as_files,
    single_device_groups,
)


class Tied(L.LightningModule):
    """An embedding and a head tied to it, a buffer, and hyperparameters to rebuild it from."""

    def __init__(self, width: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(8, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 8, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)) * self.scale)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (x,) = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), x))


def _folder(tmp_path: Path, module: Tied, copies: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """``module``'s checkpoint as ``ThreeDStrategy`` writes it, in one process: the model with the tied head under
    its canonical name only, ``copies`` (path -> state dict) as model copies, the rest in ``meta.pt``."""
    saved_once = {"head.weight"} if module.hparams.tie else set()
    state = {k: v.clone() for k, v in module.state_dict().items() if k not in saved_once}
    tensors: dict[str, object] = {"state_dict": state}
    meta: dict[str, object] = {
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": L.__version__,
        "hyper_parameters": dict(module.hparams),
        "callbacks": {"Other": {"kept": 1}},
    }
    paths = []
    for i, (where, copy) in enumerate((copies or {}).items()):
        tensors[f"model_copy_{i}"] = {k: v for k, v in copy.items() if k not in saved_once}
        paths.append(where.split("/"))
    folder = tmp_path / "epoch=3-step=12.ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)
    aliases = {"head.weight": "emb.weight"} if module.hparams.tie else {}
    meta[SECTION] = {"keys": list(state), "model_copies": paths, "aliases": aliases}
    torch.save(meta, folder / META_FILE)
    return folder


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_load_from_checkpoint_reads_a_folder(tmp_path: Path) -> None:
    """``MyModule.load_from_checkpoint(folder)``, every Lightning tutorial's last line, died with
    ``IsADirectoryError``: the module comes back with its hyperparameters, every weight (the tied head through its
    own key, loaded strictly) and its buffers."""
    torch.manual_seed(0)
    trained = Tied(width=6)
    folder = _folder(tmp_path, trained)
    loaded = Tied.load_from_checkpoint(folder)
    assert loaded.hparams.width == 6
    _same(loaded.state_dict(), trained.state_dict())
    assert loaded.head.weight is loaded.emb.weight  # still one parameter
    # the dict itself: every key of the plain module's state_dict, in its order (the tied head last)
    checkpoint = lightning_checkpoint(folder)
    assert list(checkpoint["state_dict"]) == list(trained.state_dict())
    assert checkpoint["epoch"] == 3 and checkpoint["callbacks"] == {"Other": {"kept": 1}}
    assert SECTION not in checkpoint and "optimizer_states" not in checkpoint


def test_model_copies_go_back_where_they_were(tmp_path: Path) -> None:
    """EMA's trained weights (``current_model_state``) and a callback's model-shaped state (SWA's average) are read
    whole and put back at their places, tied weights under both names."""
    torch.manual_seed(0)
    module, other = Tied(), Tied()
    copies = {"current_model_state": other.state_dict(), "callbacks/Avg/average": module.state_dict()}
    checkpoint = lightning_checkpoint(_folder(tmp_path, module, copies))
    _same(checkpoint["current_model_state"], other.state_dict())
    _same(checkpoint["callbacks"]["Avg"]["average"], module.state_dict())
    assert checkpoint["callbacks"]["Other"] == {"kept": 1}


def test_map_location_and_untied(tmp_path: Path) -> None:
    module = Tied(tie=False)
    folder = _folder(tmp_path, module)
    for where in ("cpu", torch.device("meta")):
        checkpoint = lightning_checkpoint(folder, map_location=where)
        assert {t.device for t in checkpoint["state_dict"].values()} == {torch.device(where)}
    _same(lightning_checkpoint(folder, map_location=lambda s, _: s)["state_dict"], module.state_dict())


def test_other_paths_go_to_lightning(tmp_path: Path) -> None:
    """A file is loaded by Lightning as before; a folder that is not a complete checkpoint is not taken either."""
    file = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, file)
    assert saving.pl_load(file)["state_dict"]["w"].tolist() == [1.0, 1.0]
    partial = tmp_path / "partial.ckpt"
    partial.mkdir()
    (partial / META_FILE).write_bytes(b"")
    assert not is_checkpoint_folder(partial) and not is_checkpoint_folder("https://host/x.ckpt")
    with pytest.raises(IsADirectoryError):  # Lightning's own loader's error, unchanged
        saving.pl_load(partial)
    read_folders_as_files()  # again: still one wrapper around Lightning's loader
    assert not hasattr(saving.pl_load.__wrapped__, "__wrapped__")


def test_consolidate_writes_a_file_plain_lightning_loads(tmp_path: Path) -> None:
    """``python -m lightning_3d.checkpoint consolidate FOLDER``: ``FOLDER.consolidated`` (Lightning's tool's name),
    an ordinary ``torch.load`` file; it refuses to overwrite."""
    torch.manual_seed(0)
    module = Tied()
    folder = _folder(tmp_path, module)
    assert main(["consolidate", str(folder)]) == 0
    out = folder.with_name(folder.name + ".consolidated")
    plain = torch.load(out, weights_only=True)
    _same(plain["state_dict"], lightning_checkpoint(folder)["state_dict"])
    _same(Tied.load_from_checkpoint(out).state_dict(), module.state_dict())
    assert main(["consolidate", str(folder), str(out)]) == 2
    with pytest.raises(FileExistsError):
        consolidate(folder, out)


def test_single_device_trainer_takes_a_folder_as_ckpt_path(tmp_path: Path) -> None:
    """``Trainer(devices=1).validate(model, ckpt_path=folder)`` (``TorchCheckpointIO``) evaluates the saved weights."""
    torch.manual_seed(0)
    trained = Tied()
    folder = _folder(tmp_path, trained)
    data = DataLoader(TensorDataset(torch.arange(8).repeat(2)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    torch.manual_seed(1)
    (result,) = trainer.validate(Tied(), data, ckpt_path=folder, verbose=False)
    (want,) = trainer.validate(trained, data, verbose=False)
    assert result["val_loss"] == want["val_loss"]


class TwoGroups(Tied):
    """Tied, with one device's optimizer in two groups (the middle layer's, then the rest) and a scheduler."""

    def configure_optimizers(self):
        mid = list(self.mid.parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in mid)]
        opt = torch.optim.Adam([{"params": mid, "lr": 0.1}, {"params": rest}], lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}


def test_single_device_groups_name_one_devices_optimizer_in_order() -> None:
    """The names that number one device's optimizer state: group by group, in the groups' order, a tied weight by
    its first name; a copy that cannot be made, or parameters from elsewhere, are refused with the reason."""
    from lightning_3d.core.boundary_check import make_skeleton

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = TwoGroups()
    module.trainer = trainer  # as during a fit
    assert single_device_groups(make_skeleton(module)) == [[["mid.weight", "mid.bias"], ["emb.weight"]]]
    with pytest.raises(ValueError, match="could not be copied"):
        single_device_groups("the model could not be copied (TypeError: x)")

    class Elsewhere(TwoGroups):
        def configure_optimizers(self):
            return torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)

    elsewhere = Elsewhere()
    elsewhere.trainer = trainer
    with pytest.raises(ValueError, match="not the LightningModule's"):
        single_device_groups(make_skeleton(elsewhere))


def test_one_devices_optimizer_state_by_name() -> None:
    """``optimizer.state_dict()`` of one device, keyed by name through the groups; groups of other sizes are
    refused before anything is read into the model."""
    module = TwoGroups()
    opt = module.configure_optimizers()["optimizer"]
    module(torch.arange(8)).sum().backward()
    opt.step()
    groups = [["mid.weight", "mid.bias"], ["emb.weight"]]
    by_name = _optimizer_by_name(opt.state_dict(), groups, 0, Path("x.ckpt"))
    assert list(by_name) == ["mid.weight", "mid.bias", "emb.weight"]
    hyper, state = by_name["mid.bias"]
    assert hyper["lr"] == 0.1 and torch.equal(state["exp_avg"], opt.state[module.mid.bias]["exp_avg"])
    assert by_name["emb.weight"][0]["lr"] == 0.01
    with pytest.raises(ValueError, match=r"groups of \[2, 1\] parameters, but configure_optimizers gives the unsplit"):
        _optimizer_by_name(opt.state_dict(), [["mid.weight"], ["mid.bias", "emb.weight"]], 0, Path("x.ckpt"))
