"""Checkpoints under ThreeDStrategy: sharded save, exact resume, resharding, export / import, safety.

Multi-process checks go through ``launch.run_lightning`` (hard time limits) and share launches:

* one pp2 x dp2 launch (``ckpt_resume.py``): reference runs, bitwise resume from an end-of-epoch and a mid-epoch
  checkpoint, ModelCheckpoint top-k / save_last / removal, another model's checkpoint;
* reshard loads of its step-5 checkpoint at (tp1, pp4, dp1), (tp2, pp1, dp1) and one process, each also
  checking import (``LoadWeights``), and the one-process launch plain single-device Lightning;
* a kill launch and a resume launch (``ckpt_kill.py``);
* one pp2 x dp2 launch (``ckpt_schedules.py``) under the CSV action list ``conf/schedules/zbv_pp2_m4.csv`` and
  torch's ``zbvzerobubble`` and ``dualpipev`` (V placement: rank 0 holds the first and the last stage), with
  dropout and validation during training: bitwise resume (also with gradient accumulation, under the CSV list),
  checkpointing that changes nothing (validation included), ModelCheckpoint top-k on ``val_loss``, the V-saved
  checkpoint loaded under 1F1B and read in one process, ``trainer.validate(ckpt_path=...)``;
* opt-in (``LIGHTNING_3D_TP_MATRIX=1``): the (tp2, pp2, dp2) save, bitwise resume and reshard matrix (tp1 pp4
  dp2, tp4 pp1 dp2, tp2 pp1 dp1, one process): 8-process launches, several minutes on 2 cores.

The rest runs in this process: key checks, folder completeness, the atomic rename, Lightning's ``last``
pattern, the optimizer-state layout against torch's, the data-position arithmetic.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_3d import checkpoint as ckpt
from lightning_3d.checkpoint.named_state import compare_keys, optimizer_state_dict, torch_optimizer_state
from lightning_3d.checkpoint.resume import _skip_for_layout, source_rank
from lightning_3d.core.topology import Topology

from launch import base_env, run_commands, run_lightning

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 10
REL = 1e-4  # float32, after several optimizer steps


# --------------------------------------------------------------------------------------------- helpers
def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (bitwise), plus keys present on one side only."""
    diff = sorted(set(a) ^ set(b))
    return diff + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _launch(out: Path, tp: int, pp: int, dp: int, timeout: float) -> dict:
    run_lightning("ckpt_resume.py", ["--tp", tp, "--pp", pp, "--dp", dp, "--out", out], timeout=timeout)
    return _load(out / "resume.pt")


def _check_resume(rec: dict) -> None:
    straight = rec["straight"]
    assert len(straight["losses"]) == STEPS
    # Saving after every step changes nothing in the run being saved.
    assert rec["saving"]["losses"] == straight["losses"]
    assert not _differences(rec["saving"]["snap_end"]["params"], straight["snap_end"]["params"])
    # 10 steps == N steps + save + resume + (10 - N) steps, bitwise: losses, parameters, Adam states.
    for name, start in (("from4", 4), ("from5", 5)):
        resumed = rec[name]
        assert resumed["steps"] == list(range(start + 1, STEPS + 1)), name
        assert resumed["losses"] == straight["losses"][start:], name
        assert not _differences(resumed["snap_end"]["params"], straight["snap_end"]["params"]), name
        assert not _differences(resumed["snap_end"]["opt"], straight["snap_end"]["opt"]), name
    # Dropout in the body: the body's random numbers continue exactly too.
    drop, drop_resumed = rec["drop_straight"], rec["drop_from5"]
    assert drop_resumed["steps"] == list(range(6, STEPS + 1))
    assert drop_resumed["losses"] == drop["losses"][5:], (drop["losses"][5:], drop_resumed["losses"])
    assert not _differences(drop_resumed["snap_end"]["params"], drop["snap_end"]["params"])
    # With accumulate_grad_batches=2 (a checkpoint per optimizer step, so every two batches): resuming from step 3
    # (batch 6, the middle of epoch 1) replays batches 7..20 exactly.
    acc, acc_resumed = rec["acc_straight"], rec["acc_from3"]
    assert len(acc["losses"]) == 2 * STEPS and acc["steps"][-1] == STEPS
    assert acc["steps"][:4] == [0, 1, 1, 2], acc["steps"]  # one optimizer step every two batches
    assert acc_resumed["steps"] == acc["steps"][6:]
    assert acc_resumed["losses"] == acc["losses"][6:]
    assert not _differences(acc_resumed["snap_end"]["params"], acc["snap_end"]["params"])
    assert not _differences(acc_resumed["snap_end"]["opt"], acc["snap_end"]["opt"])


def _check_reshard(rec: dict, ref: dict, export: dict[str, torch.Tensor] | None) -> None:
    """Full parameters and optimizer states equal right after loading; the continuation within float32."""
    resumed = rec["resume"]
    at5 = ref["snap_5"]
    assert not _differences(resumed["snap_start"]["params"], at5["params"])
    assert len(at5["opt"]) == 3 * len(at5["params"])  # step, exp_avg, exp_avg_sq per parameter
    assert not _differences(resumed["snap_start"]["opt"], at5["opt"])
    assert resumed["steps"] == list(range(6, STEPS + 1))
    for got, want in zip(resumed["losses"], ref["losses"][5:]):
        assert abs(got - want) <= REL * abs(want), (resumed["losses"], ref["losses"][5:])
    assert _max_rel(resumed["snap_end"]["params"], ref["snap_end"]["params"]) <= REL
    if export is not None and "imported" in rec:
        assert not _differences(rec["imported"], export)  # 3D training starts from the exported weights


def _reshard(out: Path, tp: int, pp: int, dp: int, extra: list, timeout: float) -> dict:
    args = ["--tp", tp, "--pp", pp, "--dp", dp, "--ckpt", out / "all" / "step=5.ckpt", "--out", out, *extra]
    run_lightning("ckpt_reshard.py", args, timeout=timeout)
    return _load(out / f"reshard-tp{tp}-pp{pp}-dp{dp}.pt")


# --------------------------------------------------------------------------------------------- pp2 x dp2
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pp2 x dp2 launch of ``ckpt_resume.py``, and the step-5 checkpoint exported by the CLI."""
    out = tmp_path_factory.mktemp("ckpt")
    _launch(out, 1, 2, 2, timeout=300)
    return out


@pytest.fixture(scope="module")
def exported(saved: Path) -> Path:
    """``python -m lightning_3d.checkpoint export`` of the step-5 checkpoint (one process, no process group)."""
    target = saved / "step5.pt"
    # as ``python -m`` runs them (a fork of the test zygote: runpy.run_module, as the interpreter does)
    cmd = [sys.executable, "-m", "lightning_3d.checkpoint", "export", str(saved / "all" / "step=5.ckpt"), str(target)]
    done = run_commands([cmd], [base_env()], timeout=120, fork=True)
    assert "wrote" in done.output and "RuntimeWarning" not in done.output, done.output
    info = [sys.executable, "-m", "lightning_3d.checkpoint", "info", str(saved / "all" / "step=5.ckpt")]
    shown = run_commands([info], [base_env()], timeout=120, fork=True)
    assert "global step 5" in shown.output and "body.0.weight" in shown.output, shown.output
    keys = [line.split(":")[0].strip() for line in shown.output.splitlines() if line.startswith("  body.")]
    natural = [[int(x) if x.isdigit() else x for x in re.split(r"(\d+)", k)] for k in keys]
    assert len(keys) > 2 and natural == sorted(natural), keys  # in model order
    return target


@pytest.mark.slow
def test_resume_is_bitwise_pp2_dp2(saved: Path) -> None:
    _check_resume(_load(saved / "resume.pt"))


@pytest.mark.slow
def test_model_checkpoint_top_k_last_and_removal(saved: Path) -> None:
    top = _load(saved / "resume.pt")["top"]
    # monitor="train_loss", save_top_k=2, save_last=True, saving every step: exactly the two best survive
    assert len(top["best_k"]) == 2
    assert sorted(Path(p).name for p in top["best_k"]) == sorted(n for n in top["listing"] if n != "last.ckpt")
    assert top["listing"] == sorted(top["listing"]) and "last.ckpt" in top["listing"]
    assert not [n for n in top["listing"] if n.startswith(".")]  # no staging / deleting leftovers
    assert top["best"] == min(top["best_k"], key=top["best_k"].get)
    for name in top["listing"]:  # every survivor is a complete checkpoint folder
        ckpt.check_complete(saved / "top" / name)
    last = torch.load(saved / "top" / "last.ckpt" / ckpt.META_FILE, weights_only=False)
    assert last["global_step"] == STEPS


@pytest.mark.slow
def test_other_model_names_keys_and_changes_nothing(saved: Path) -> None:
    wrong = _load(saved / "resume.pt")["wrong"]
    assert wrong["error"] and wrong["error"].startswith("KeyError")
    message = wrong["error"]
    for key in ("body.3.weight", "body.5.weight"):  # in the model, not in the checkpoint
        assert key in message.split("Unexpected")[0]
    for key in ("body.4.weight", "body.6.weight"):  # in the checkpoint, not in the model
        assert key in message.split("Unexpected")[1]
    assert "Nothing was loaded" in message
    assert wrong["unchanged_all_ranks"] == [True] * 4
    assert wrong["optimizer_untouched"]


@pytest.mark.slow
def test_export_loads_into_the_single_device_module(saved: Path, exported: Path) -> None:
    from models import TinyMLP

    state = torch.load(exported, weights_only=True)
    model = TinyMLP(build="init")
    result = model.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert list(state) == list(model.state_dict())  # the plain module's keys, in its order
    assert not _differences(dict(model.named_parameters()), _load(saved / "resume.pt")["clean"]["snap_5"]["params"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "dp", "weights", "plain"),
    [(1, 4, 1, True, False), (2, 1, 1, False, False), (1, 1, 1, True, True)],
    ids=["tp1-pp4-dp1", "tp2-pp1-dp1", "one-process"],
)
def test_reshard_from_pp2_dp2(
    saved: Path, exported: Path, tp: int, pp: int, dp: int, weights: bool, plain: bool
) -> None:
    extra = (["--weights", exported] if weights else []) + (["--plain"] if plain else [])
    rec = _reshard(saved, tp, pp, dp, extra, timeout=240)
    export = torch.load(exported, weights_only=True)
    _check_reshard(rec, _load(saved / "resume.pt")["clean"], export)
    assert ("imported" in rec) == weights
    if plain:  # plain single-device Lightning: LoadWeights and load_state_dict of the export
        assert not _differences(rec["plain_imported"], export)
        assert rec["plain"]["missing"] == [] and rec["plain"]["unexpected"] == []
        assert not _differences(rec["plain"]["params"], export)
        got, want = rec["validate"]  # trainer.validate(ckpt_path=...) restores the weights only
        assert abs(got - want) <= 1e-6 * abs(want)


@pytest.mark.slow
def test_killed_save_is_never_resumed(tmp_path: Path) -> None:
    job = run_lightning("ckpt_kill.py", ["--phase", "kill", "--out", tmp_path], timeout=240, check=False)
    assert job.returncode != 0 and "KILLING rank 0" in job.output, job.tail()
    folder = tmp_path / "kill"
    partial = folder / ".last.ckpt.partial"
    # DCP finished (.metadata written) but the checkpoint was not: never named last.ckpt
    assert (partial / ckpt.DCP_METADATA).is_file() and not (partial / ckpt.META_FILE).exists()
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.check_complete(partial)
    ckpt.check_complete(folder / "last.ckpt")
    assert torch.load(folder / "last.ckpt" / ckpt.META_FILE, weights_only=False)["global_step"] == 2

    run_lightning("ckpt_kill.py", ["--phase", "resume", "--out", tmp_path], timeout=240)
    rec = _load(tmp_path / "kill.pt")
    assert Path(rec["picked"]).name == "last.ckpt"
    assert rec["resumed"]["steps"] == [3, 4, 5, 6]
    assert rec["resumed"]["losses"] == rec["straight"]["losses"][2:]
    assert not _differences(rec["resumed"]["snap_end"]["params"], rec["straight"]["snap_end"]["params"])
    assert ".last.ckpt.partial" in rec["before"]
    assert not [n for n in rec["after"] if n.startswith(".")]  # the next save of last.ckpt cleared it


# --------------------------------------------------------------------------------------------- tp2 x pp2 x dp2
@pytest.mark.slow
def test_tp2_pp2_dp2_resume_and_reshard_matrix(tmp_path: Path) -> None:
    """Save at (tp2, pp2, dp2), resume bitwise there, load at (tp1, pp4, dp2), (tp4, pp1, dp2), (tp2, pp1, dp1)
    and in one process (several minutes on 2 cores)."""
    rec = _launch(tmp_path, 2, 2, 2, timeout=900)
    _check_resume(rec)
    ref = rec["clean"]
    export = tmp_path / "step5.pt"
    ckpt.export(tmp_path / "all" / "step=5.ckpt", export)
    weights = torch.load(export, weights_only=True)
    assert not _differences(weights, ref["snap_5"]["params"])
    for tp, pp, dp, extra in [
        (1, 4, 2, []),
        (4, 1, 2, []),
        (2, 1, 1, ["--weights", export]),
        (1, 1, 1, ["--weights", export, "--plain"]),
    ]:
        _check_reshard(_reshard(tmp_path, tp, pp, dp, extra, timeout=900), ref, weights)


# --------------------------------------------------------------------------------------------- CSV and V schedules
# run names in ckpt_schedules.py: the CSV action list, torch's two V schedules, its interleaved zero-bubble schedule
# over one stage per rank (ZB-H1)
SPLIT_RESUMES = ["csv", "zbv", "dualpipev", "zbh1"]


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (model and optimizer states, DCP keys), read in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def _after(values: list[tuple[int, float]], step: int) -> list[tuple[int, float]]:
    return [(s, v) for s, v in values if s > step]


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pp2 x dp2 launch of ``ckpt_schedules.py`` (about 50 s on 2 quiet cores)."""
    out = tmp_path_factory.mktemp("schedules")
    run_lightning("ckpt_schedules.py", ["--dp", 2, "--out", out], timeout=240)
    return out


@pytest.fixture(scope="module")
def schedules(scheduled: Path) -> dict:
    return _load(scheduled / "schedules.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", SPLIT_RESUMES)
def test_resume_is_bitwise_under_csv_and_zero_bubble_schedules(schedules: dict, name: str) -> None:
    """10 steps == 5 steps + save + resume + 5 steps under the split-backward schedules: the V placement (rank 0
    holds the first and the last stage) and ZB-H1, with dropout in the body: losses, logged values, parameters and
    Adam states, bitwise."""
    straight, resumed = schedules[f"{name}_saving"], schedules[f"{name}_from5"]
    assert len(straight["losses"]) == STEPS
    assert resumed["steps"] == list(range(6, STEPS + 1))
    assert resumed["losses"] == straight["losses"][5:]
    assert resumed["logged_train"] == straight["logged_train"][5:]
    assert [s for s, _ in straight["logged_val"]] == [2, 4, 6, 8, 10]
    assert resumed["logged_val"] == _after(straight["logged_val"], 5)
    at5 = straight["snap_5"]
    assert len(at5["opt"]) == 3 * len(at5["params"])  # step, exp_avg, exp_avg_sq per parameter
    assert not _differences(resumed["snap_start"]["params"], at5["params"])
    assert not _differences(resumed["snap_start"]["opt"], at5["opt"])
    assert not _differences(resumed["snap_end"]["params"], straight["snap_end"]["params"])
    assert not _differences(resumed["snap_end"]["opt"], straight["snap_end"]["opt"])
    for run in (straight, resumed):  # every rank was handed the same logged values (the relay from rank 0's stage)
        assert all(r == {"train": run["logged_train"], "val": run["logged_val"]} for r in run["logged_by_rank"])


@pytest.mark.slow
def test_checkpointing_changes_nothing_under_a_csv_schedule(schedules: dict) -> None:
    """Saving every step (and the top-k callback on val_loss) leaves the run, its validation included, bit for bit
    as it is without checkpointing; torch's named ZB-V (the list the file was written from) agrees with it."""
    plain, saving = schedules["csv_plain"], schedules["csv_saving"]
    assert saving["losses"] == plain["losses"]
    assert saving["logged_train"] == plain["logged_train"]
    assert saving["logged_val"] == plain["logged_val"] and len(plain["logged_val"]) == 5
    assert not _differences(saving["snap_end"]["params"], plain["snap_end"]["params"])
    assert not _differences(saving["snap_end"]["opt"], plain["snap_end"]["opt"])
    for name in ("zbv", "dualpipev"):
        other = schedules[f"{name}_saving"]
        for got, want in zip(other["losses"], plain["losses"]):
            assert abs(got - want) <= REL * abs(want), (name, other["losses"], plain["losses"])


@pytest.mark.slow
def test_model_checkpoint_monitors_val_loss_under_a_csv_schedule(scheduled: Path, schedules: dict) -> None:
    top = schedules["csv_top"]
    best = sorted(schedules["csv_saving"]["logged_val"], key=lambda sv: sv[1])[:2]
    expected = sorted(f"step={s}-val_loss={v:.5f}.ckpt" for s, v in best)
    assert sorted(Path(p).name for p in top["best_k"]) == expected == top["listing"]
    assert sorted(top["best_k"].values()) == sorted(v for _, v in best)
    assert Path(top["best"]).name == f"step={best[0][0]}-val_loss={best[0][1]:.5f}.ckpt"
    for name in top["listing"]:
        ckpt.check_complete(scheduled / "csv_top" / name)


@pytest.mark.slow
def test_resume_with_accumulation_under_a_csv_schedule(schedules: dict) -> None:
    """accumulate_grad_batches=2 under the action list: resumed from step 3 (batch 6, mid-epoch 1), batches 7..20
    replay exactly."""
    acc, resumed = schedules["csv_acc_saving"], schedules["csv_acc_from3"]
    assert len(acc["losses"]) == 2 * STEPS and acc["steps"][:4] == [0, 1, 1, 2]
    assert resumed["steps"] == acc["steps"][6:]
    assert resumed["losses"] == acc["losses"][6:]
    assert resumed["logged_val"] == _after(acc["logged_val"], 3)
    assert not _differences(resumed["snap_end"]["params"], acc["snap_end"]["params"])
    assert not _differences(resumed["snap_end"]["opt"], acc["snap_end"]["opt"])


@pytest.mark.slow
def test_csv_checkpoint_loads_under_1f1b_and_in_one_process(scheduled: Path, schedules: dict) -> None:
    """A checkpoint saved under the V placement loads exactly under 1F1B (the last Linear moves from pp rank 0 to
    pp rank 1) and in one process; 1F1B then continues as the action list does; saves after a resume are the
    uninterrupted run's; ``trainer.validate(ckpt_path=...)`` gives the val_loss the fit logged."""
    at5 = schedules["csv_saving"]["snap_5"]
    quiet, moved = schedules["csv_quiet_from5"], schedules["1f1b_from_csv5"]
    for rec in (quiet, moved):
        assert not _differences(rec["snap_start"]["params"], at5["params"])
        assert not _differences(rec["snap_start"]["opt"], at5["opt"])
        assert rec["steps"] == list(range(6, STEPS + 1))
    curves = [rec["losses"] + [v for _, v in rec["logged_val"]] for rec in (moved, quiet)]  # training, then val
    for got, want in zip(*curves):
        assert abs(got - want) <= REL * abs(want), curves
    assert _max_rel(moved["snap_end"]["params"], quiet["snap_end"]["params"]) <= REL
    # one process, no process group: the full model and optimizer states of the V-saved checkpoint
    saved = _read_all(scheduled / "csv" / "step=5.ckpt")
    model = {k.removeprefix("state_dict."): v for k, v in saved.items() if k.startswith("state_dict.")}
    opt = {k.removeprefix("optimizer_0.state."): v for k, v in saved.items() if k.startswith("optimizer_0.state.")}
    assert not _differences(model, at5["params"]) and not _differences(opt, at5["opt"])
    assert not _differences(ckpt.load_consolidated(scheduled / "csv" / "step=5.ckpt"), at5["params"])
    # the resumed run's own checkpoints are the uninterrupted run's, tensor for tensor
    for step in (6, STEPS):
        name = f"step={step}.ckpt"
        assert not _differences(_read_all(scheduled / "csv_resumed" / name), _read_all(scheduled / "csv" / name))
    at10 = dict(schedules["csv_saving"]["logged_val"])[STEPS]
    assert schedules["validate"]["csv"] == at10
    assert abs(schedules["validate"]["1f1b"] - at10) <= REL * abs(at10)


# --------------------------------------------------------------------------------------------- in-process
def test_incomplete_or_missing_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.check_complete(tmp_path / "nope.ckpt")
    folder = tmp_path / "half.ckpt"
    folder.mkdir()
    (folder / ckpt.DCP_METADATA).write_bytes(b"x")
    with pytest.raises(ValueError, match=r"incomplete \(no meta.pt\)"):
        ckpt.check_complete(folder)
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(ValueError, match="LoadWeights"):
        ckpt.check_complete(tmp_path / "file.ckpt")


def test_staging_and_trash_names_are_invisible_to_model_checkpoint(tmp_path: Path) -> None:
    """``ckpt_path="last"`` considers ``last*.ckpt`` only: no staging, trash or deleting folder matches."""
    for name in ("last.ckpt", ".last.ckpt.partial", ".last.ckpt.old", ".last-v1.ckpt.deleting", "step=3.ckpt"):
        (tmp_path / name).mkdir()
    mc = ModelCheckpoint(dirpath=tmp_path)
    found = mc._find_last_checkpoints(trainer=None)  # dirpath is set, so the trainer is not consulted
    assert {Path(p).name for p in found} == {"last.ckpt"}
    assert ckpt.staging_path(tmp_path / "last.ckpt").name == ".last.ckpt.partial"


def test_publish_replaces_atomically_and_remove_hides_first(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    for version in ("old", "new"):
        staging = ckpt.staging_path(target)
        staging.mkdir()
        (staging / "version").write_text(version)
        ckpt._publish(staging, target)
        assert (target / "version").read_text() == version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    link = tmp_path / "link.ckpt"
    link.symlink_to(target.name)
    ckpt.remove_checkpoint(target, global_rank=1)  # only rank 0 deletes
    assert target.is_dir()
    ckpt.remove_checkpoint(link, global_rank=0)  # a save_last="link" symlink: the link goes, the target stays
    assert not link.exists() and target.is_dir()
    ckpt.remove_checkpoint(target, global_rank=0)
    assert list(tmp_path.iterdir()) == []


def test_compare_keys_names_everything() -> None:
    report = compare_keys({"a": (2,), "b": (3,), "c": (4,)}, {"a": (2,), "c": (5,), "d": (1,)})
    assert report.missing == ["b"] and report.unexpected == ["d"]
    assert report.mismatched == ["c: checkpoint (5,), model (4,)"]
    message = report.message("x.ckpt")
    assert re.search(r"Missing keys .*: b\. Unexpected keys .*: d\. Shape mismatches: c: ", message)
    assert not compare_keys({"a": (2,)}, {"a": (2,)})


def test_optimizer_state_matches_torch_flattened_layout_and_round_trips() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}], lr=0.01)
    assert optimizer_state_dict(model, opt).keys() == {
        f"param_groups.{n}.{k}"
        for g in opt.param_groups
        for n, p in model.named_parameters()
        if any(p is q for q in g["params"])
        for k in g
        if k != "params"
    }  # an optimizer that never stepped: hyperparameters only, no fake initialising step
    assert not opt.state
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    ours = optimizer_state_dict(model, opt)
    theirs = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert ours.keys() == theirs.keys()
    rebuilt = torch_optimizer_state({id(p): n for n, p in model.named_parameters()}, opt, ours)
    original = opt.state_dict()
    assert rebuilt["param_groups"] == original["param_groups"]
    for index, state in original["state"].items():
        assert rebuilt["state"][index].keys() == state.keys()
        assert all(torch.equal(rebuilt["state"][index][k], v) for k, v in state.items())


def test_data_position_across_data_parallel_degrees() -> None:
    # same layout, or the same global batch at another dp: skip the saved number of batches, exactly
    assert _skip_for_layout(3, {"dp": 2, "batch_size": 8}, 2, 8) == (3, None)
    assert _skip_for_layout(3, {"dp": 2, "batch_size": 8}, 1, 16) == (3, None)
    assert _skip_for_layout(3, {"dp": 2, "batch_size": 8}, 4, 4) == (3, None)
    # another global batch: rounded down to whole new batches, and said so
    skip, problem = _skip_for_layout(3, {"dp": 2, "batch_size": 8}, 1, 32)
    assert skip == 1 and "48 samples" in problem and "16 samples are seen again" in problem


def test_rng_source_rank_follows_coordinates() -> None:
    saved = {"dp": 2, "pp": 2, "tp": 2}
    same = Topology(8, tp=2, pp=2)
    assert [source_rank(saved, same, r) for r in range(8)] == list(range(8))
    # tp2 -> tp4: tensor-parallel peers take states of saved tp ranks (which were identical)
    wider = Topology(8, tp=4, pp=1)
    assert [source_rank(saved, wider, r) for r in range(8)] == [0, 1, 0, 1, 4, 5, 4, 5]
    assert source_rank(saved, Topology(1), 0) == 0


# --------------------------------------------------------------------------------------------- parts of layers
@pytest.mark.slow
def test_a_boundary_inside_a_layer_resumes_bitwise_and_loads_with_whole_layers(tmp_path: Path) -> None:
    """A checkpoint written with block 1 split between the stages (pieces.py): each rank saves the parameters its
    part holds, under the layer's own names. Resumed at the same split: bitwise. Resumed with whole layers (block 1
    on one stage): the state restored bitwise, the continuation within float32."""
    run_lightning("ckpt_parts.py", ["--out", tmp_path], timeout=300)
    rec = _load(tmp_path / "parts.pt")
    saving, same, whole = rec["parts_saving"], rec["parts_from3"], rec["whole_from3"]
    meta = torch.load(tmp_path / "parts" / "step=3.ckpt" / ckpt.META_FILE, weights_only=False)
    assert meta["lightning_3d"]["layout"]["stages"] == [["0", "1#0-1"], ["1#1-2", "2", "3"]]
    for resumed in (same, whole):
        assert not _differences(resumed["snap_start"]["params"], saving["snap_3"]["params"])
        assert not _differences(resumed["snap_start"]["opt"], saving["snap_3"]["opt"])
    assert same["losses"] == saving["losses"][3:]
    assert not _differences(same["snap_end"]["params"], saving["snap_end"]["params"])
    assert not _differences(same["snap_end"]["opt"], saving["snap_end"]["opt"])
    for got, want in zip(whole["losses"], saving["losses"][3:], strict=True):
        assert abs(got - want) <= REL * abs(want), (whole["losses"], saving["losses"][3:])
    assert _max_rel(whole["snap_end"]["params"], saving["snap_end"]["params"]) <= REL
