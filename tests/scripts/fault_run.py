"""One ThreeDStrategy job with one injected fault, for tests/test_reliability.py.

Usage: ``python fault_run.py --tp T --pp P --dp D --fault KIND --rank R --step K --out DIR [...]``, under Lightning's
launcher (one process; ``--launcher lightning``) or started once per rank with the torchrun environment
(``--launcher external``).

Faults (on global rank R when the global step is K, inside the step: in the forward of this rank's first layer):

=========  ===========================================================================================
raise      ``RuntimeError("injected fault ...")``
kill       SIGKILL to itself
sleep      ``time.sleep(10**6)``: stuck forever (the others must fail on the process-group timeout)
nan_grad   the gradient flowing into that layer's output becomes NaN (its stage's gradients only)
nan_loss   the loss of every last-stage rank becomes NaN at step K
diverge    after step K, rank R adds 1e-3 to its first parameter (DPConsistencyCheck must name it)
mismatch   rank R is built with micro_batches=4 (others 2) and a wider first hidden layer (ConsistencyError)
partition  rank R asks for partitioner="compute" (others "uniform"), whose layer timing is a collective; the
           model has an ``example_input_array`` so that it times (ConsistencyError, before that collective)
none       no fault
=========  ===========================================================================================

``--on-exception-checkpoint`` adds Lightning's ``OnExceptionCheckpoint`` (its save runs on the failing rank before
``Strategy.on_exception``).

Each rank writes ``DIR/pid.<rank>`` at start and ``DIR/rank<r>.json`` at the end (or when the step fails):
per-step losses (exact, as float.hex), bitwise parameter checksums before and after each step, the global
steps, the optimizer's step counts, the learning rate and the strategy's skipped steps. Just before a fault
that ends a process, the rank prints ``FAULT_AT <unix time>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import DPConsistencyCheck, ThreeDStrategy
from lightning_3d.core.partition import OnAnotherStage
from lightning_3d.reliability import group_timeout
from lightning_3d.tools.dp_check import bit_checksum

from models import TinyMLP, loader


def launch_rank() -> int:
    """The global rank before any process group exists (Lightning's children get LOCAL_RANK, torchrun RANK)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class FaultMLP(TinyMLP):
    """TinyMLP whose loss can be made NaN, and whose first hidden layer can be wider (for ``mismatch``)."""

    def __init__(self, hidden: int = 32, **kwargs) -> None:
        self.hidden = hidden
        self.nan_loss_step = -1
        super().__init__(**kwargs)

    def configure_model(self) -> None:
        if hasattr(self, "body"):
            return
        h = self.hidden
        self.body = nn.Sequential(
            nn.Linear(16, h), nn.ReLU(), nn.Linear(h, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.trainer.global_step == self.nan_loss_step:
            loss = loss * float("nan")
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def params_checksum(module: nn.Module) -> str:
    sums = [bit_checksum(_local(p)).tolist() for _, p in sorted(module.named_parameters())]
    return json.dumps(sums)


class Fault(L.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = launch_rank()
        self.record: dict = {"rank": self.rank, "loss": [], "steps": [], "before": [], "after": [], "adam_steps": []}
        self.record["lr"] = []

    def _write(self, trainer: L.Trainer) -> None:
        strategy = trainer.strategy
        self.record["skipped"] = list(getattr(strategy._reliability, "skipped_steps", []))
        self.record["final_step"] = trainer.global_step
        Path(self.args.out, f"rank{self.rank}.json").write_text(json.dumps(self.record))

    def _timeouts(self, trainer) -> dict[str, float]:
        mesh = trainer.strategy.device_mesh
        groups = {"default": None, **{dim: mesh[dim].get_group() for dim in ("dp", "pp", "tp")}}
        return {name: group_timeout(group).total_seconds() for name, group in groups.items()}

    def on_train_start(self, trainer, pl_module):
        self.record["timeouts_setup"] = self._timeouts(trainer)
        # the first layer this rank holds (layers of other stages are OnAnotherStage placeholders in the body)
        first = next(m for m in pl_module.body if not isinstance(m, OnAnotherStage))
        first.register_forward_hook(self._hook)
        if self.args.fault == "nan_loss":
            pl_module.nan_loss_step = self.args.step

    def _armed(self) -> bool:
        return self.rank == self.args.rank and self.trainer.global_step == self.args.step

    def _hook(self, module, inputs, output):
        kind = self.args.fault
        if not self._armed() or kind not in ("raise", "kill", "sleep", "nan_grad"):
            return None
        if kind == "nan_grad":
            return _NaNGrad.apply(output)
        print(f"FAULT_AT {time.time():.3f} rank {self.rank} {kind}", flush=True)
        if kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {self.args.step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10**6)
        return None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trainer = trainer
        self.record["before"].append(params_checksum(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["loss"].append(float(outputs["loss"]).hex())
        self.record["steps"].append(trainer.global_step)
        self.record["after"].append(params_checksum(pl_module))
        opt = trainer.optimizers[0]
        self.record["adam_steps"].append(sorted({float(s["step"]) for s in opt.state.values() if "step" in s}))
        self.record["lr"].append(opt.param_groups[0]["lr"])
        if len(self.record["steps"]) == 1:
            self.record["timeouts_train"] = self._timeouts(trainer)
        if self.args.fault == "diverge" and self.rank == self.args.rank and trainer.global_step == self.args.step:
            name, param = next(iter(pl_module.named_parameters()))
            with torch.no_grad():
                _local(param).add_(1e-3)
            print(f"DIVERGED {name} on rank {self.rank}", flush=True)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self.record["exception"] = f"{type(exception).__name__}: {exception}"
        try:
            self.record["after_exception"] = params_checksum(pl_module)
        except Exception as err:  # e.g. still on the meta device when setup failed
            self.record["after_exception"] = repr(err)
        self._write(trainer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="per data-parallel replica")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--on-nonfinite", default="raise")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--train-timeout", type=float, default=600.0)
    parser.add_argument("--dp-check", type=int, default=0)
    parser.add_argument("--on-exception-checkpoint", action="store_true", help="OnExceptionCheckpoint in OUT/exc")
    parser.add_argument("--launcher", choices=("lightning", "external"), default="lightning")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = launch_rank()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"pid.{rank}").write_text(str(os.getpid()))
    odd = args.fault == "mismatch" and rank == args.rank
    timed = args.fault == "partition" and rank == args.rank
    L.seed_everything(1234, verbose=False)
    strategy = ThreeDStrategy(
        tp=args.tp,
        pp=args.pp,
        micro_batches=4 if odd else 2,
        timeout=args.timeout,
        train_timeout=args.train_timeout,
        on_nonfinite=args.on_nonfinite,
        print_layout=False,
        partitioner="compute" if timed else "uniform",
    )
    callbacks: list[L.Callback] = [Fault(args)]
    if args.dp_check:
        callbacks.append(DPConsistencyCheck(every_n_steps=args.dp_check))
    if args.on_exception_checkpoint:
        callbacks.append(OnExceptionCheckpoint(dirpath=Path(args.out, "exc")))
    world = args.tp * args.pp * args.dp
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=args.on_exception_checkpoint,
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    model = FaultMLP(hidden=40 if odd else 32, optimizer="adam", lr=0.01)
    if args.fault == "partition":
        model.example_input_array = torch.zeros(args.batch // 2, 16)  # one micro-batch: what the timing runs on
    trainer.fit(model, loader("mlp", args.batch, n=args.batch * args.dp * args.steps * args.accumulate))


if __name__ == "__main__":
    main()
