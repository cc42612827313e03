"""B0 calibration: gloo send/recv and all-reduce bandwidth between two processes, one-core matmul GFLOP/s.

Two processes with one thread each. Rank 0 alone times matrix products (square 1024 and the GPT's shapes:
a micro-batch of 128 tokens through a 256 -> 1024 projection) while rank 1 waits in a barrier; then both time
a send/recv ping-pong (one-way time = round trip / 2) and all-reduces over several message sizes. The derived
line is what B1 needs: the time to send one micro-batch's activations (1 x 128 x 256 fp32 = 128 KiB) next to
the time one pipeline stage computes that micro-batch (the whole GPT's forward + backward on one micro-batch
is timed too). A last measurement times 128 KiB to a receiver already waiting and in the send + receive exchange
1F1B makes between its two stages at pp 2 (:func:`_exchange_latency`).
No baseline: the numbers are inputs to the others.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "B0", "calibration: gloo p2p and all-reduce bandwidth, one-core matmul GFLOP/s"
SIZES = (4, 128 * 1024, 1 << 20, 16 << 20)


def _matmul_gflops(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    flops, reps, start = 2.0 * m * k * n, 0, time.perf_counter()
    samples = []
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        samples.append(time.perf_counter() - t)
        reps += 1
    return flops / median(samples) / 1e9


def _model_microbatch_ms(tiny: bool, reps: int) -> float:
    """Median time of forward + backward of the whole benchmark GPT on one micro-batch (1 sample)."""
    from .common import build_gpt, gpt_loss, model_config, token_batch

    config = model_config(tiny)
    model = build_gpt(config)
    x, y = token_batch(config, 1)
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        gpt_loss(model(x), y).backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return median(times) * 1e3


def worker(reps: int = 20, seconds: float = 1.0, tiny: bool = False) -> dict[str, Any]:
    """Runs on both ranks; returns rank 0's measurements."""
    import torch
    import torch.distributed as dist

    from .common import init_distributed

    rank, _ = init_distributed()
    out: dict[str, Any] = {"matmul_gflops": {}, "p2p": {}, "allreduce": {}}
    dist.barrier()
    if rank == 0:
        out["matmul_gflops"] = {
            "1024x1024x1024": _matmul_gflops(1024, 1024, 1024, seconds),
            "128x256x1024 (one micro-batch, fc)": _matmul_gflops(128, 256, 1024, seconds),
            "128x256x2048 (one micro-batch, lm_head)": _matmul_gflops(128, 256, 2048, seconds),
        }
        out["model_microbatch_ms"] = _model_microbatch_ms(tiny, max(3, reps // 2))
    dist.barrier()

    def timed_median(op: Any) -> float:
        """Median seconds of ``op()`` over ``reps`` calls after 3 warm-up calls, each started after a barrier."""
        times = []
        for i in range(reps + 3):
            dist.barrier()
            start = time.perf_counter()
            op()
            if i >= 3:
                times.append(time.perf_counter() - start)
        return median(times)

    def ping_pong(t: Any) -> None:
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    for size in SIZES:
        t = torch.ones(max(1, size // 4))
        one_way = timed_median(lambda t=t: ping_pong(t)) / 2
        out["p2p"][str(size)] = {"bytes": size, "one_way_ms": one_way * 1e3, "GB_per_s": size / one_way / 1e9}
    for size in SIZES:
        t = torch.ones(max(1, size // 4))
        tm = timed_median(lambda t=t: dist.all_reduce(t))
        out["allreduce"][str(size)] = {"bytes": size, "ms": tm * 1e3, "algo_GB_per_s": size / tm / 1e9}
    out["exchange_ms"] = _exchange_latency(rank, reps, 2.0 if tiny else 8.0)
    return out


def _busy(ms: float) -> None:
    """Keep this process's one core busy with matrix products for ``ms`` milliseconds."""
    import torch

    a = torch.randn(256, 256)
    start = time.perf_counter()
    while time.perf_counter() - start < ms / 1e3:
        a @ a


def _exchange_latency(rank: int, reps: int, compute_ms: float) -> dict[str, float]:
    """One micro-batch's activations (128 KiB) from rank 0 to rank 1: to a receiver already waiting, and in the
    exchange 1F1B's steady state makes at pp 2.

    ``early``: rank 1 waits in its receive while rank 0 computes for ``compute_ms``, then sends; the figure is the
    time from rank 0's send to rank 1 holding the tensor (both read the host's monotonic clock). ``exchange``: as
    torch's ``Schedule1F1B`` does between its two stages in the steady state, each rank posts its send and its
    receive together (``batch_isend_irecv``) when it needs the receive and waits for both: rank 0 at once (sending
    an activation, receiving a gradient: stage 0 after a forward); rank 1 computes for ``compute_ms``, then posts
    its own (sending the gradient, receiving the activation offered long before: stage 1 after a backward); the
    figure is rank 1's wait. gloo moves the bytes once the receiver has posted its receive, so the exchange is a
    round trip between the two processes' transport threads, each woken from a wait. Rounds alternate the two;
    medians (ms) over the rounds after 3 warm-up rounds, and the 90th percentiles (``early_p90``,
    ``exchange_p90``)."""
    import torch
    import torch.distributed as dist

    activation, gradient = torch.ones(128 * 1024 // 4), torch.ones(128 * 1024 // 4)
    times: dict[str, list[float]] = {"early": [], "exchange": []}
    for i in range(reps + 3):
        for mode in ("early", "exchange"):  # alternated, so that load drifts hit both alike
            dist.barrier()
            start = end = 0.0
            if mode == "early":
                if rank == 0:
                    _busy(compute_ms)
                    start = time.perf_counter()
                    dist.send(activation, 1)
                else:
                    dist.recv(activation, 0)
                    end = time.perf_counter()
            elif rank == 0:
                ops = [dist.P2POp(dist.isend, activation, 1), dist.P2POp(dist.irecv, gradient, 1)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            else:
                _busy(compute_ms)
                ops = [dist.P2POp(dist.isend, gradient, 0), dist.P2POp(dist.irecv, activation, 0)]
                start = time.perf_counter()
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
                end = time.perf_counter()
            stamps: list[Any] = [None, None]
            dist.all_gather_object(stamps, (start, end))
            if i >= 3:
                begin = stamps[0][0] if mode == "early" else stamps[1][0]
                times[mode].append((stamps[1][1] - begin) * 1e3)
    result = {mode: median(values) for mode, values in times.items()}
    for mode, values in times.items():  # the spread: on a busy host a share of the exchanges takes far longer
        result[f"{mode}_p90"] = sorted(values)[int(0.9 * (len(values) - 1))] if values else float("nan")
    return result


def run(out: Path, tiny: bool = False) -> Record:
    """Measure (two processes) and build the record."""
    from .common import launch

    res = launch("b0_calibration:worker", 2, {"reps": 5 if tiny else 20, "seconds": 0.2 if tiny else 1.5, "tiny": tiny})
    gf = res["matmul_gflops"]
    p2p, ar = res["p2p"], res["allreduce"]
    mb = p2p[str(128 * 1024)]
    stage_ms = res["model_microbatch_ms"] / 2
    lines = [f"matmul {k}: {v:.1f} GFLOP/s" for k, v in gf.items()]
    lines += [
        f"p2p {int(v['bytes']):>9} B: one-way {v['one_way_ms']:.3f} ms, {v['GB_per_s']:.2f} GB/s" for v in p2p.values()
    ]
    lines += [
        f"all-reduce (2 ranks) {int(v['bytes']):>9} B: {v['ms']:.3f} ms, {v['algo_GB_per_s']:.2f} GB/s"
        for v in ar.values()
    ]
    lines.append(
        f"benchmark GPT, one micro-batch (1 x 128 tokens), forward + backward on one core: "
        f"{res['model_microbatch_ms']:.1f} ms"
    )
    lines.append(
        f"one micro-batch's activations (128 KiB) take {mb['one_way_ms']:.3f} ms one way, "
        f"{mb['one_way_ms'] / stage_ms:.1%} of the ~{stage_ms:.1f} ms a half-model pipeline stage computes it"
    )
    exchange = res["exchange_ms"]
    lines.append(
        f"128 KiB to a receive already waiting: {exchange['early']:.3f} ms from send to received (90th percentile "
        f"{exchange['early_p90']:.3f}); in 1F1B's exchange at pp 2 (send + receive posted together when needed): "
        f"{exchange['exchange']:.3f} ms (90th percentile {exchange['exchange_p90']:.3f})"
    )
    measured = {
        "matmul_gflops_1024": gf["1024x1024x1024"],
        "p2p_GBps_16MiB": p2p[str(16 << 20)]["GB_per_s"],
        "p2p_ms_128KiB": mb["one_way_ms"],
        "gpt_microbatch_ms": res["model_microbatch_ms"],
        "allreduce_GBps_16MiB": ar[str(16 << 20)]["algo_GB_per_s"],
        "p2p_ms_128KiB_to_waiting_receiver": exchange["early"],
        "p2p_ms_128KiB_1f1b_exchange": exchange["exchange"],
    }
    details = {**res, "processes": 2, "threads_per_process": 1, "model": "tiny" if tiny else "benchmark GPT"}
    return Record(ID, TITLE, measured, None, None, None, "", details, lines)
