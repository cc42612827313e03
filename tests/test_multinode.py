"""Beyond one launcher: two torchrun "nodes", the SLURM path, and torchrun's elastic restart.

All on this machine over gloo, with ``scripts/train_app.py`` (``python -m lightning_3d.train`` plus a callback
that prints every loss at full precision and each rank's view of the launch). Every launch goes through
``tests/launch.py`` (own sessions, killed on exit, hard time limit).

* Two torchrun launchers (``--nnodes 2 --node-rank 0|1``, c10d rendezvous on localhost, 4 processes each) train
  the tiny GPT at tp2 x pp2 x dp2 with the same per-step losses as one launcher of 8 processes (Lightning's own,
  ``trainer.devices=8``); the mesh puts each tensor-parallel pair inside one node.
* 4 processes started by hand with the variables ``srun`` sets (2 "nodes" x 2 tasks) train at pp2 x dp2 through
  Lightning's ``SLURMEnvironment`` with the same losses as Lightning's launcher of 4 processes.
* Under ``torchrun --max-restarts 1``, rank 3 SIGKILLed at step 5 of the first attempt: the group restarts,
  resumes from the last complete checkpoint (step 3, found as ``ckpt_path="last"``) and ends with the losses of
  the uninterrupted run.

torchrun starts fresh interpreters (its children cannot be forks of the test zygote); the references (Lightning's
launcher) and the SLURM tasks are forks of it, as ``tests/launch.py`` starts every other job.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from launch import base_env, free_port, run_commands, run_lightning

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "train_app.py")
pytestmark = pytest.mark.slow

COMMON = [
    "model=gpt_tiny",
    "seed=7",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "sample.enabled=false",
    "logging.tensorboard=false",
    "print_config=false",
]
TOL = 1e-6


def _torchrun(nproc: int, args: list[str], *, nnodes: int = 1, node_rank: int = 0, rdzv: str, restarts: int = 0):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.2",
        SCRIPT,
        *args,
    ]


def _losses(output: str, kind: str = "train_loss", attempt: int | None = None) -> dict[int, float]:
    found = {}
    for a, step, value in re.findall(rf"L3D_LOSS attempt=(\d+) step=(\d+) {kind}=(\S+)", output):
        if attempt is None or int(a) == attempt:
            found[int(step)] = float(value)  # a later attempt overwrites the steps it repeats
    return found


def _ranks(output: str) -> list[dict[str, str]]:
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in re.findall(r"^.*L3D_RANK .*$", output, re.M)]


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b), (a, b)
    bad = {s: (a[s], b[s]) for s in a if abs(a[s] - b[s]) > TOL}
    assert not bad, bad


def _torchrun_job(tmp: Path, nproc: int, args: list[str], *, timeout: float, env: dict | None = None, restarts=0):
    cmd = _torchrun(nproc, [*COMMON, *args, f"hydra.run.dir={tmp}"], rdzv=f"127.0.0.1:{free_port()}", restarts=restarts)
    return run_commands([cmd], [base_env(env)], timeout=timeout)


def _launcher_job(tmp: Path, args: list[str], *, timeout: float):
    """The same training under Lightning's own launcher (``trainer.devices=N`` from one process)."""
    return run_lightning(SCRIPT, [*COMMON, *args, f"hydra.run.dir={tmp}"], timeout=timeout)


# ------------------------------------------------------------------------------------------------ two nodes


def test_two_torchrun_nodes_train_like_one_launcher(tmp_path):
    layout = ["strategy.tp=2", "strategy.pp=2", "strategy.dp=2", "trainer.max_steps=6"]
    layout.append("trainer.enable_checkpointing=false")
    one = _launcher_job(tmp_path / "one", [*layout, "trainer.devices=8"], timeout=300)

    rdzv = f"127.0.0.1:{free_port()}"
    args = [*COMMON, *layout, "trainer.devices=4", "trainer.num_nodes=2", f"hydra.run.dir={tmp_path / 'two'}"]
    cmds = [_torchrun(4, args, nnodes=2, node_rank=n, rdzv=rdzv) for n in (0, 1)]
    two = run_commands(cmds, [base_env(), base_env()], timeout=400)

    ref, got = _losses(one.output), _losses(two.output)
    assert sorted(ref) == list(range(6)), one.tail()
    _close(got, ref)
    _close(_losses(two.output, "val_loss"), _losses(one.output, "val_loss"))
    assert sorted(_losses(one.output, "val_loss")) == [3, 6]

    # Each launcher is one node: 4 ranks with local ranks 0-3 and one node rank, read by TorchElasticEnvironment.
    logs = two.output.split("----- rank 1 -----")
    nodes = []
    for log in logs:
        seen = _ranks(log)
        assert sorted(int(r["local"]) for r in seen) == [0, 1, 2, 3], seen
        assert {r["env"] for r in seen} == {"TorchElasticEnvironment"} and {r["world"] for r in seen} == {"8"}
        assert len({r["node"] for r in seen}) == 1, seen
        nodes.append({int(r["rank"]) for r in seen})
    assert sorted(map(sorted, nodes)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The mesh as documented (tp fastest, then pp, then dp): every tp pair lies within one node.
    table = re.findall(r"dp (\d) \| stage (\d) \| tp ranks \[(\d+), (\d+)\]", two.output)
    assert [tuple(map(int, row)) for row in table] == [(0, 0, 0, 1), (0, 1, 2, 3), (1, 0, 4, 5), (1, 1, 6, 7)]
    for *_, a, b in table:
        assert any({int(a), int(b)} <= node for node in nodes)


# ------------------------------------------------------------------------------------------------ SLURM and elastic

# pp2 x dp2 on 4 processes, 9 steps, validation (and a checkpoint: ModelCheckpoint saves at validation) every 3.
LAYOUT_4 = ["strategy.tp=1", "strategy.pp=2", "strategy.dp=2", "trainer.max_steps=9"]


@pytest.fixture(scope="module")
def launcher_reference(tmp_path_factory):
    """The uninterrupted run under Lightning's launcher: 4 processes on one node."""
    return _launcher_job(tmp_path_factory.mktemp("reference"), [*LAYOUT_4, "trainer.devices=4"], timeout=300)


def test_slurm_tasks_train_like_one_launcher(tmp_path, launcher_reference):
    """4 processes with what ``srun --nodes 2 --ntasks-per-node 2`` sets, read by Lightning's SLURMEnvironment."""
    args = [SCRIPT, *COMMON, *LAYOUT_4, "trainer.devices=2", "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}"]
    port = str(free_port())
    envs = []
    for rank in range(4):
        slurm = {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "l3d-test",  # not "bash"/"interactive": those turn SLURM detection off
            "SLURM_NTASKS": "4",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
            "SLURM_NODELIST": "localhost,localhost",  # MASTER_ADDR <- the first host
            "MASTER_PORT": port,  # else 15000 + the job id's last 4 digits
        }
        env = base_env(slurm)
        env.pop("MASTER_ADDR", None)
        envs.append(env)
    job = run_commands([[sys.executable, *args]] * 4, envs, timeout=300, fork=True)
    seen = sorted(_ranks(job.output), key=lambda r: int(r["rank"]))
    assert [(int(r["rank"]), int(r["node"]), int(r["local"])) for r in seen] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert {r["env"] for r in seen} == {"SLURMEnvironment"} and {r["world"] for r in seen} == {"4"}
    assert job.output.count("lightning_3d layout: world=4 = dp 2 x pp 2 x tp 1") == 1, job.tail()
    ref = launcher_reference.output
    assert sorted(_losses(ref)) == list(range(9)), launcher_reference.tail()
    _close(_losses(job.output), _losses(ref))
    _close(_losses(job.output, "val_loss"), _losses(ref, "val_loss"))


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path, launcher_reference):
    """Rank 3 SIGKILLed at step 5 of the first attempt; torchrun restarts the group, which resumes from step 3."""
    # torchrun's shared rendezvous store keeps the first attempt's addresses (README, GPUs and clusters).
    kill = {"L3D_TEST_KILL_AT_STEP": "5", "L3D_TEST_KILL_RANK": "3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    job = _torchrun_job(tmp_path, 4, [*LAYOUT_4, "trainer.devices=4"], timeout=450, env=kill, restarts=1)
    out, ref = job.output, launcher_reference.output
    assert "L3D_KILL rank=3 step=5" in out, job.tail()
    first, second = _losses(out, attempt=0), _losses(out, attempt=1)
    assert sorted(first) == list(range(5)), job.tail()
    # The second attempt starts at the last complete checkpoint (step 3, written at validation): steps 3 and 4
    # are trained again, nothing before them.
    assert sorted(second) == list(range(3, 9)), job.tail()
    assert f"Restoring states from the checkpoint path at {tmp_path}/checkpoints/last.ckpt" in out, job.tail()
    full = _losses(ref)
    _close(first, {s: full[s] for s in first})
    _close(second, {s: full[s] for s in second})
    val_ref = _losses(ref, "val_loss")
    assert sorted(val_ref) == [3, 6, 9]
    _close(_losses(out, "val_loss", attempt=1), {6: val_ref[6], 9: val_ref[9]})
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()
