"""``calibrate=true``: measure this machine and write a cluster file (``conf/cluster/<name>.yaml``).

Measured: one process's matmul FLOP/s at sizes from 16 to 512 (fitted to ``peak * d / (d + half)``), the fixed
cost of a block's forward and backward (a tiny GPT-like block, so only launch and dispatch remain: the per-operator
overhead), memory bandwidth (a large element-wise add), and between two processes over gloo the one-way send/recv
latency and bandwidth and the all-reduce bandwidth (as in benchmark B0). The devices are ``processes`` CPU
processes sharing this machine's cores and memory.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cluster import CLUSTER_DIR

SIZES = (16, 32, 64, 128, 256, 512)


def _median_time(fn: Callable[[], Any], seconds: float, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(samples) < 5:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def matmul_flops(seconds: float = 0.3) -> dict[int, float]:
    """FLOP/s of ``(d x d) @ (d x d)`` products (fp32, this process's threads)."""
    import torch

    out = {}
    for d in SIZES:
        a, b = torch.randn(d, d), torch.randn(d, d)
        out[d] = 2.0 * d**3 / _median_time(lambda a=a, b=b: a @ b, seconds)
    return out


def fit_efficiency(flops: dict[int, float]) -> tuple[float, float]:
    """(peak, half) of ``peak * d / (d + half)``: the best measured rate, and the median ``half`` the smaller
    sizes imply (robust to one size slowed by another process on a shared machine)."""
    peak = max(flops.values())
    halves = sorted(d * (peak / f - 1) for d, f in flops.items() if f < peak)
    return peak, (halves[len(halves) // 2] if halves else 0.0)


def block_overhead_s(seconds: float = 0.5) -> float:
    """Forward + backward time of a tiny pre-norm transformer block (hidden 8, 2 tokens): its fixed cost."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
            self.fc, self.proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            y = self.ln_1(x)
            q, k, v = (p(y).view(b, t, -1, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + self.o(a)
            return x + self.proj(F.gelu(self.fc(self.ln_2(x))))

    block = Block(8)
    x = torch.randn(1, 2, 8, requires_grad=True)
    return _median_time(lambda: block(x).sum().backward(), seconds)


def memory_bandwidth_gbs(seconds: float = 0.3) -> float:
    """GB/s of ``c = a + b`` on 16 MiB tensors (3 x 16 MiB moved)."""
    import torch

    a, b = torch.ones(4 << 20), torch.ones(4 << 20)
    c = torch.empty_like(a)
    return 3 * a.numel() * 4 / _median_time(lambda: torch.add(a, b, out=c), seconds) / 1e9


def _framework_worker(out: str, steps: int) -> None:
    """One process, ``ThreeDStrategy`` on one CPU device: step times of a tiny model at 1 and 4 micro-batches."""
    import warnings

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_3d import ThreeDStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self.body(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    result = {}
    for m in (1, 4):
        clock = Clock()
        data = DataLoader(TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1)), batch_size=4)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ThreeDStrategy(micro_batches=m, print_layout=False),
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[clock],
        )
        trainer.fit(Tiny(), data)
        gaps = [b - a for a, b in zip(clock.starts, clock.starts[1:])][3:]
        result[m] = statistics.median(gaps)
    Path(out).write_text(json.dumps(result))


def framework_overhead(steps: int = 25, timeout: float = 180.0) -> tuple[float, float]:
    """(seconds per step, seconds per micro-batch) that Lightning and ``ThreeDStrategy`` add, measured on a model
    too small to compute anything (one process, one device, 1 and 4 micro-batches)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "framework.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        code = (
            "import sys; from lightning_3d.plan.calibrate import _framework_worker as w; "
            "w(sys.argv[1], int(sys.argv[2]))"
        )
        subprocess.run([sys.executable, "-c", code, out, str(steps)], env=env, timeout=timeout, check=True)
        r = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    per_micro = max(0.0, (r[4] - r[1]) / 3)
    return max(0.0, r[1] - per_micro), per_micro


def _comm_worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result: dict[str, Any] = {}

    def timed(op: Callable[[], Any], reps: int = 20) -> float:
        samples = []
        for i in range(reps + 3):
            dist.barrier()
            t = time.perf_counter()
            op()
            if i >= 3:
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    for size in (4, 1 << 20, 16 << 20):
        t = torch.ones(max(1, size // 4))

        def ping(t: Any = t) -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        result[f"p2p_{size}"] = timed(ping) / 2
        result[f"allreduce_{size}"] = timed(lambda t=t: dist.all_reduce(t))
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _run_workers(
    worker: str, processes: int, timeout: float, argv: Callable[[int, int, str], list[Any]]
) -> dict[str, Any]:
    """Start ``processes`` fresh Python processes running ``calibrate.<worker>(*argv(rank, port, out))`` (one
    thread each, a free localhost port for their process group) and return the JSON rank 0 wrote to ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / f"{worker}.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        code = f"import sys, json; from lightning_3d.plan.calibrate import {worker} as w; w(*json.loads(sys.argv[1]))"
        procs = [
            subprocess.Popen([sys.executable, "-c", code, json.dumps(argv(rank, port, out))], env=env)
            for rank in range(processes)
        ]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return json.loads(Path(out).read_text())


def comm(timeout: float = 120.0) -> dict[str, float]:
    """Latency (s) and bandwidth (GB/s) of gloo send/recv and all-reduce between two fresh processes."""
    r = _run_workers("_comm_worker", 2, timeout, lambda rank, port, out: [rank, port, out])
    big = 16 << 20
    latency = r["p2p_4"]
    ar_latency = r["allreduce_4"] / 2  # ring of 2: 2 (n - 1) = 2 messages
    return {
        "latency_s": latency,
        "p2p_gbs": big / max(1e-9, r[f"p2p_{big}"] - latency) / 1e9,
        # A ring all-reduce over 2 ranks moves 2 (n - 1) / n = 1 x the bytes per rank.
        "allreduce_gbs": big / max(1e-9, r[f"allreduce_{big}"] - 2 * ar_latency) / 1e9,
    }


def background_load(seconds: float = 2.0, samples: int = 40) -> float:
    """Other jobs' runnable processes on this machine now: the kernel's count of running tasks
    (``/proc/loadavg``'s fourth field) sampled over ``seconds``, averaged, less the sampling process itself.

    Instantaneous, unlike the load average, which lags by a minute and would still count processes that just
    ended (a calibration's or an earlier run's own workers). Falls back to the 1-minute load average where
    ``/proc`` is missing.
    """
    path = Path("/proc/loadavg")
    if not path.exists():
        return max(0.0, os.getloadavg()[0] - 1.0)
    counts = []
    for _ in range(samples):
        counts.append(int(path.read_text().split()[3].split("/")[0]))
        time.sleep(seconds / samples)
    return max(0.0, statistics.fmean(counts) - 1.0)


def _shared_latency_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # The whole job only: smaller groups all-reducing at once after a barrier measured noisier than this (0.9-1.8 ms
    # per message for pairs among 8 processes on 2 cores) and over-predicted tensor-parallel layouts; the table
    # format keeps room for per-size entries (``ClusterSpec.latency`` takes the next size up, or the largest).
    sizes = [world]
    t = torch.ones(1024)  # 4 KiB: latency-bound, and enough elements for every rank's chunk of the ring
    result: dict[int, float] = {}
    for g in sizes:
        groups = [dist.new_group(list(range(s, s + g))) for s in range(0, world, g)]  # every rank creates each
        mine = groups[rank // g]
        samples = []
        for i in range(23):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t, group=mine)  # every group at once, as tensor/data-parallel groups run in a job
            if i >= 3:
                samples.append(time.perf_counter() - start)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, statistics.median(samples))
        result[g] = max(gathered) / (2 * (g - 1))  # a ring's 2 (g - 1) messages
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def shared_latency(processes: int, timeout: float = 120.0) -> dict[int, float]:
    """Per-message latency (s) among ``processes`` fresh processes on this machine's cores, as ``{processes:
    seconds}``: all of them all-reduce 4 KiB and the ring's ``2 (n - 1)`` messages are divided out. When the
    processes outnumber the cores this is mostly the time a message waits for its receiver to be scheduled
    (milliseconds, against microseconds between two processes on cores of their own)."""
    table = _run_workers(
        "_shared_latency_worker", processes, timeout, lambda rank, port, out: [rank, processes, port, out]
    )
    return {int(k): v for k, v in table.items()}


def calibrate(name: str = "cpu8", processes: int = 8, directory: Path = CLUSTER_DIR, quick: bool = False) -> Path:
    """Measure this machine and write ``directory/name.yaml`` for ``processes`` CPU processes.

    Args:
        name: the cluster name (file stem).
        processes: CPU processes the training job starts (the "devices").
        directory: where to write.
        quick: shorter measurements (tests).

    Returns:
        The file written.
    """
    import torch

    torch.set_num_threads(1)
    seconds = 0.05 if quick else 0.3
    flops = matmul_flops(seconds)
    peak, half = fit_efficiency(flops)
    block = block_overhead_s(seconds)
    # timing.OPS_PER_LAYER operators forward, twice as many backward: the block's fixed cost spread over them.
    from .timing import OPS_PER_LAYER

    op_overhead = block / (3 * OPS_PER_LAYER)
    mem_bw = memory_bandwidth_gbs(seconds)
    links = comm()
    shared = shared_latency(processes) if processes > 1 else None
    step_overhead, micro_overhead = framework_overhead(10 if quick else 25)
    background = background_load()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    bw = min(links["p2p_gbs"], links["allreduce_gbs"])
    lines = [
        "# This machine, measured by `python -m lightning_3d.plan calibrate=true` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}:",
        f"# {processes} CPU processes (gloo) sharing {cores} cores and {total_gib:.0f} GiB. Matmul GFLOP/s by size: "
        + ", ".join(f"{d}: {f / 1e9:.1f}" for d, f in flops.items())
        + ".",
        f"# Tiny block forward + backward {block * 1e6:.0f} us; gloo one-way latency "
        f"{links['latency_s'] * 1e6:.0f} us, "
        f"send/recv {links['p2p_gbs']:.2f} GB/s, all-reduce {links['allreduce_gbs']:.2f} GB/s; add {mem_bw:.1f} GB/s.",
        f"name: {name}",
        f"gpus_per_node: {processes}",
        "nodes: 1",
        f"peak_flops: {peak:.4e}",
        f"memory_gib: {0.8 * total_gib / processes:.2f}",
        "reserved_gib: 0.4          # the Python process with torch and Lightning loaded",
        f"intra_bw_gbs: {bw:.3f}",
        f"inter_bw_gbs: {bw:.3f}",
        f"intra_latency_s: {links['latency_s']:.3e}",
        f"inter_latency_s: {links['latency_s']:.3e}",
        f"mem_bw_gbs: {mem_bw:.2f}",
        "matmul_eff_max: 1.0",
        f"matmul_half_size: {half:.1f}",
        f"op_overhead_s: {op_overhead:.3e}",
        f"tp_op_overhead_s: {3 * op_overhead:.3e}   # DTensor dispatch: about 3x a plain operator (not measured)",
        f"step_overhead_s: {step_overhead:.3e}   # Lightning's loop and ThreeDStrategy's per-step work, measured",
        f"micro_batch_overhead_s: {micro_overhead:.3e}   # ThreeDStrategy per micro-batch, measured",
        "dp_overlap: 0.0           # replicate's all-reduce runs after the schedule on gloo",
        "precision: 32-true",
        f"cores: {cores}",
        f"background_load: {background:.1f}   # other jobs' runnable processes at calibration (sampled);"
        " set 0 on a quiet machine",
    ]
    if shared is not None:
        table = ", ".join(f"{g}: {v:.3e}" for g, v in sorted(shared.items()))
        lines.append(
            f"shared_latency_s: {{{table}}}   # per message by group size, {processes} processes on {cores} cores "
            "(waiting for the receiver to be scheduled), measured"
        )
    path = Path(directory) / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
