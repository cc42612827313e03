"""GPU check (issue 12): ThreeDStrategy on one GPU against plain Lightning and hand-written loops.

``python -m benchmarks.gpu_check --out DIR`` (or ``python -m benchmarks GPU --out DIR``) writes
``DIR/gpu_check.json``. On one GPU, at the example GPT's ``large`` (T=512, batch 32) and ``xl`` (T=1024, batch 8)
sizes, bf16-mixed, fused AdamW, the same random tokens, each run with and without ``torch.compile`` of every
block:

========================  ===========================================================================
``lightning_auto``        plain Lightning, ``strategy="auto"`` (blocks compiled by hand for ``+compile``)
``threed_tp1pp1``         ``ThreeDStrategy(tp=1, pp=1, compile=...)``
``threed_tp1pp1_nocheck`` the same with ``on_nonfinite="off"``: what the non-finite check costs
``threed_interleaved``    ``ThreeDStrategy(tp=1, pp=1, stages_per_rank=2, schedule="interleaved1f1b",
                          micro_batches=4)``: one rank holding two stages
``hand_full``             a hand-written loop: autocast forward, backward, fused AdamW step, full batch
``hand_accum4``           the same with gradient accumulation over 4 micro-batches (the pipeline's compute)
``hand_interleaved``      torch's ``ScheduleInterleaved1F1B`` over the same two stages on one rank, m=4
========================  ===========================================================================

Per run: the median step time after warm-up (and the mean between two synchronisations), tokens/s, TFLOP/s
(nanoGPT's count: ``6 N + 12 L d T`` per token), peak memory, host synchronisations per step
(``torch.cuda.set_sync_debug_mode("warn")``: one warning per synchronising call) and GPU idle time per step (a
``torch.profiler`` trace of a few steps: the profiled wall time minus the union of kernel and copy intervals).
Ratios: tp1 pp1 against plain Lightning (goal >= 0.97), one-rank interleaved against torch's schedule driven
by hand (goal >= 0.97), each with and without compile.

Without a CUDA device the script prints one skip line, writes ``{"skipped": "no CUDA device"}`` and exits 0.
``--dry-run-cpu`` runs every path on the CPU with a tiny GPT and a step or two per phase (the CUDA-only
measurements are ``null``; host synchronisations are counted with a dispatch mode instead), so the script is
known to run before a GPU is at hand. Only torch, Lightning and lightning_3d's non-Hydra modules are imported.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES: dict[str, dict[str, Any]] = {
    "large": {"preset": "large", "batch": 32},
    "xl": {"preset": "xl", "batch": 8},
}
DRY_SIZE: dict[str, Any] = {"preset": "tiny", "batch": 8, "n_layer": 4, "block_size": 16}
RUNS = (
    "lightning_auto",
    "threed_tp1pp1",
    "threed_tp1pp1_nocheck",
    "threed_interleaved",
    "hand_full",
    "hand_accum4",
    "hand_interleaved",
)
MICRO = 4


def _gpt_module() -> Any:
    """The example GPT's module: the installed ``lightning_3d_examples`` or, where it is not installed (a bare
    copy of the repository), ``examples/gpt.py`` loaded under that name."""
    try:
        import lightning_3d_examples.gpt as gpt

        return gpt
    except ImportError:
        pass
    pkg = importlib.util.module_from_spec(importlib.util.spec_from_loader("lightning_3d_examples", loader=None))
    pkg.__path__ = [str(ROOT / "examples")]
    sys.modules["lightning_3d_examples"] = pkg
    spec = importlib.util.spec_from_file_location("lightning_3d_examples.gpt", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_3d_examples.gpt"] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- phases of a run
@dataclass
class Phases:
    """How many steps each phase of a run takes: warm-up, timed, sync-counted, profiled."""

    warmup: int
    timed: int
    syncs: int
    profiled: int

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.syncs + self.profiled


class SyncCounter:
    """Host synchronisations: CUDA's sync debug mode (warnings) on a GPU; on the CPU a dispatch mode counting
    ``aten::_local_scalar_dense`` (``.item()``, ``bool(tensor)``) and copies to the CPU from another device."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.count = 0
        self._warnings: Any = None
        self._log: list[Any] = []
        self._mode: Any = None

    def start(self) -> None:
        if self.cuda:
            import torch

            self._warnings = warnings.catch_warnings(record=True)
            self._log = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _scalar_counter()
            self._mode.__enter__()

    def stop(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode(0)
            self._warnings.__exit__(None, None, None)
            self.count = sum("synchroniz" in str(w.message) for w in self._log)
        else:
            self._mode.__exit__(None, None, None)
            self.count = self._mode.count


def _scalar_counter() -> Any:
    from lightning_3d.core.torch_compat import TorchDispatchMode

    class ScalarCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "_local_scalar_dense" in name:
                self.count += 1
            elif name.startswith("aten._to_copy") or name.startswith("aten.copy_"):
                src = args[0] if name.startswith("aten._to_copy") else args[1]
                dst = (kwargs or {}).get("device") if name.startswith("aten._to_copy") else args[0].device
                if getattr(src, "device", None) is not None and dst is not None and str(dst) == "cpu":
                    self.count += src.device.type != "cpu"
            return func(*args, **(kwargs or {}))

    return ScalarCounter()


class Meter:
    """Measures one run: call ``begin(i)`` at the start of step ``i`` (and ``begin(phases.total)`` after the last
    step); the phases follow one another (see :class:`Phases`)."""

    def __init__(self, phases: Phases, device: Any, trace_dir: Path) -> None:
        self.phases, self.device, self.trace_dir = phases, device, trace_dir
        self.cuda = device.type == "cuda"
        self.starts: list[float] = []
        self.sync_window: tuple[float, float] | None = None
        self.syncs = SyncCounter(self.cuda)
        self.profiler: Any = None
        self.profile_window = 0.0
        self.gpu_busy_s: float | None = None
        self._t = 0.0

    def _sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def begin(self, i: int) -> None:
        p = self.phases
        t_syncs, t_prof = p.warmup + p.timed, p.warmup + p.timed + p.syncs
        if i == p.warmup:
            self._sync()
            self._reset_peak()
            self._t = time.perf_counter()
        if p.warmup <= i <= t_syncs:
            self.starts.append(time.perf_counter())
        if i == t_syncs:
            self._sync()
            self.sync_window = (self._t, time.perf_counter())
            self.syncs.start()
        if i == t_prof:
            self.syncs.stop()
            self._start_profiler()
        if i == p.total:
            self._stop_profiler()

    def _reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _start_profiler(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        self._t = time.perf_counter()
        del torch

    def _stop_profiler(self) -> None:
        self._sync()
        self.profile_window = time.perf_counter() - self._t
        self.profiler.__exit__(None, None, None)
        path = self.trace_dir / "trace.json"
        self.profiler.export_chrome_trace(str(path))
        self.gpu_busy_s = busy_seconds(json.loads(path.read_text()))
        path.unlink()

    def result(self, tokens_per_step: int, flops_per_token: float) -> dict[str, Any]:
        import torch

        p = self.phases
        deltas = [b - a for a, b in zip(self.starts, self.starts[1:])][: p.timed]
        step = statistics.median(deltas) if deltas else float("nan")
        assert self.sync_window is not None
        mean = (self.sync_window[1] - self.sync_window[0]) / max(1, p.timed)
        idle = None
        if self.cuda and self.gpu_busy_s is not None:
            idle = max(0.0, self.profile_window - self.gpu_busy_s) / max(1, p.profiled) * 1e3
        return {
            "step_ms": step * 1e3,
            "step_ms_mean": mean * 1e3,
            "tokens_per_s": tokens_per_step / step,
            "tflops": flops_per_token * tokens_per_step / step / 1e12,
            "peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None,
            "host_syncs_per_step": self.syncs.count / max(1, p.syncs),
            "host_syncs_counted_by": "cuda sync debug mode" if self.cuda else "dispatch mode (.item(), to cpu)",
            "gpu_idle_ms_per_step": idle,
            "gpu_busy_ms_per_step": None if not self.cuda else (self.gpu_busy_s or 0.0) / max(1, p.profiled) * 1e3,
        }


def busy_seconds(trace: dict[str, Any]) -> float:
    """Seconds covered by the union of the GPU's kernel, copy and set intervals in a chrome trace."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy / 1e6


# ---------------------------------------------------------------------------------------------- the model
def flops_per_token(model: Any, seq: int) -> float:
    """nanoGPT's training FLOPs per token: ``6 N + 12 L d T``."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * c.n_layer * c.n_embd * seq


def make_gpt(size: dict[str, Any], device: Any) -> Any:
    """The example GPT of a size, with fused AdamW (``configure_optimizers``), not yet built."""
    import torch

    gpt = _gpt_module()
    overrides = {k: v for k, v in size.items() if k not in ("preset", "batch")}

    class FusedGPT(gpt.GPT):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)

    torch.manual_seed(0)
    return FusedGPT(size["preset"], **overrides)


def block_list(model: Any) -> list[tuple[str, Any]]:
    """The GPT's blocks (``body[1:-1]``), named as the strategy names them."""
    return [(f"body.{i}", model.body[i]) for i in range(1, len(model.body) - 1)]


def data(size: dict[str, Any], steps: int, vocab: int, seq: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (size["batch"] * steps, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------- the runs
def lightning_run(name: str, size: dict[str, Any], phases: Phases, device: Any, compile_kwargs: Any, tmp: Path):
    """One Lightning fit (plain or ThreeDStrategy); returns (the meter, the model)."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_3d import ThreeDStrategy
    from lightning_3d.core.compile import compile_blocks

    model = make_gpt(size, device)
    meter = Meter(phases, device, tmp)

    class Hooks(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            meter.begin(batch_idx)

        def on_train_end(self, trainer, pl_module):
            meter.begin(phases.total)

    if name == "lightning_auto":
        strategy: Any = "auto"
        if compile_kwargs is not None:  # the same blocks compiled by hand, when Lightning builds them

            def configure_model(_orig=model.configure_model) -> None:
                built = hasattr(model, "body")
                _orig()
                if not built:
                    compile_blocks(block_list(model), compile_kwargs)

            model.configure_model = configure_model  # type: ignore[method-assign]
    else:
        extra = {"stages_per_rank": 2, "schedule": "interleaved1f1b"} if name == "threed_interleaved" else {}
        if name == "threed_tp1pp1_nocheck":
            extra = {"on_nonfinite": "off"}
        strategy = ThreeDStrategy(
            tp=1,
            pp=1,
            micro_batches=MICRO if "schedule" in extra else 1,
            print_layout=False,
            compile=compile_kwargs if compile_kwargs is not None else False,
            **extra,
        )
    c = _gpt_module().PRESETS[size["preset"]]
    seq = size.get("block_size", c.block_size)
    x, y = data(size, phases.total, c.vocab_size, seq)
    trainer = L.Trainer(
        accelerator=device.type if device.type == "cpu" else "gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=phases.total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Hooks()],
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=size["batch"]))
    return meter, model


def hand_run(name: str, size: dict[str, Any], phases: Phases, device: Any, compile_kwargs: Any, tmp: Path):
    """A hand-written loop over the same GPT; returns (the meter, the model)."""
    import torch
    import torch.nn.functional as F

    from lightning_3d.core.compile import compile_blocks

    model = make_gpt(size, device)
    with torch.device(device):
        model.configure_model()
    if compile_kwargs is not None:
        compile_blocks(block_list(model), compile_kwargs)
    optimizer = model.configure_optimizers()
    c = model.config
    x_all, y_all = data(size, phases.total, c.vocab_size, c.block_size)
    meter = Meter(phases, device, tmp)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))

    schedule = None
    if name == "hand_interleaved":
        schedule = _torch_schedule(model, device, loss_fn)
    b = size["batch"]
    for i in range(phases.total):
        meter.begin(i)
        x = x_all[i * b : (i + 1) * b].to(device, non_blocking=True)
        y = y_all[i * b : (i + 1) * b].to(device, non_blocking=True)
        if name == "hand_full":
            with autocast:
                loss = loss_fn(model(x), y)
            loss.backward()
        elif name == "hand_accum4":
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
                with autocast:
                    loss = loss_fn(model(xm), ym) / MICRO
                loss.backward()
        else:
            assert schedule is not None
            with autocast:
                schedule.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    meter.begin(phases.total)
    return meter, model


def _torch_schedule(model: Any, device: Any, loss_fn: Callable[..., Any]) -> Any:
    """torch's ``ScheduleInterleaved1F1B`` over the GPT's two halves (split as the strategy splits them), both
    on this rank (a process group of one)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from lightning_3d.core import partition
    from lightning_3d.core.torch_compat import PipelineStageWithShapeInferenceHook as Stage  # gloo before torch 2.13

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=_device_id(device))
    body = partition.find_body(model)
    plan = partition.plan_stages(body, 1, partition.get_partitioner("uniform"), 2)
    stages = [Stage(partition.stage_container(body, plan.layer_names[s]), s, 2, device) for s in range(2)]
    return ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn)


def _device_id(device: Any) -> Any:
    return device if device.type == "cuda" else None


def measure(
    size_name: str,
    size: dict[str, Any],
    phases: Phases,
    device: Any,
    compile_kwargs: Any,
    runs: tuple[str, ...],
    deadline: float = float("inf"),
) -> dict[str, Any]:
    """Every run of one size, without and with compile; each run's figures and the ratios. Runs that would start
    after ``deadline`` (``time.perf_counter()``) are recorded as skipped."""
    import torch

    from lightning_3d.core.compile import is_compiled

    out: dict[str, Any] = {"size": size_name, **size, "runs": {}}
    for compiled in (False, True) if compile_kwargs is not None else (False,):
        kwargs = compile_kwargs if compiled else None
        for name in runs:
            key = f"{name}+compile" if compiled else name
            start = time.perf_counter()
            before = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
            if start > deadline:
                out["runs"][key] = {"skipped": "time budget (--budget-s) spent"}
                print(f"  {size_name} {key}: skipped (time budget spent)", flush=True)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                fn = lightning_run if name.startswith(("lightning", "threed")) else hand_run
                try:
                    meter, model = fn(name, size, phases, device, kwargs, Path(tmp))
                except Exception as err:  # one failed run must not lose the others' figures
                    where = traceback.format_exc().strip().splitlines()[-12:]
                    out["runs"][key] = {"error": f"{type(err).__name__}: {err}", "traceback": where}
                    print(f"  {key}: FAILED {type(err).__name__}: {err}", *where, sep="\n    ", flush=True)
                    continue
                seq = model.config.block_size
                result = meter.result(size["batch"] * seq, flops_per_token(model, seq))
                result["compiled_blocks"] = sum(is_compiled(m) for m in model.modules())
                result["memory_before_gib"] = before  # what earlier runs left allocated (a leak shows here)
            result["wall_s"] = time.perf_counter() - start
            out["runs"][key] = result
            print(f"  {size_name} {key}: {_line(result)}", flush=True)
            del meter, model
            gc.collect()
            if kwargs is not None:  # each compiled run compiles its own blocks: another model's cache entries
                torch.compiler.reset()  # would count towards dynamo's recompile limit (then it runs eagerly)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["ratios"] = ratios(out["runs"])
    return out


def ratios(runs: dict[str, Any]) -> dict[str, Any]:
    """Throughput ratios (baseline step time / step time): the issue's goals are >= 0.97."""

    def ratio(a: str, b: str) -> float | None:
        ra, rb = runs.get(a, {}), runs.get(b, {})
        if "step_ms" not in ra or "step_ms" not in rb:
            return None
        return rb["step_ms"] / ra["step_ms"]

    out = {}
    for suffix in ("", "+compile"):
        out[f"tp1pp1_vs_lightning{suffix}"] = ratio(f"threed_tp1pp1{suffix}", f"lightning_auto{suffix}")
        out[f"tp1pp1_nocheck_vs_lightning{suffix}"] = ratio(f"threed_tp1pp1_nocheck{suffix}", f"lightning_auto{suffix}")
        out[f"interleaved_vs_torch_schedule{suffix}"] = ratio(
            f"threed_interleaved{suffix}", f"hand_interleaved{suffix}"
        )
    out["tp1pp1_compile_vs_hand_full_compile"] = ratio("threed_tp1pp1+compile", "hand_full+compile")
    return out


def _line(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    return (
        f"{f(r['step_ms'], '.1f')} ms/step, {f(r['tokens_per_s'], ',.0f')} tok/s, {f(r['tflops'], '.1f')} TFLOP/s, "
        f"peak {f(r['peak_memory_gib'], '.1f')} GiB, {f(r['host_syncs_per_step'], '.1f')} syncs/step, "
        f"idle {f(r['gpu_idle_ms_per_step'], '.1f')} ms/step"
    )


def _environment() -> dict[str, Any]:
    import platform

    import lightning
    import torch

    env = {"torch": torch.__version__, "lightning": lightning.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="folder for gpu_check.json")
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny GPT on the CPU, every path, nothing timed")
    parser.add_argument("--sizes", default="large,xl", help="comma-separated sizes (large, xl)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; dry run aot_eager)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled runs")
    parser.add_argument(
        "--budget-s", type=float, default=270.0, help="start no run after this many seconds (default 270)"
    )
    args = parser.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    record: dict[str, Any] = {"id": "GPU", "environment": _environment()}
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (--dry-run-cpu runs every path on the CPU)", flush=True)
        record["skipped"] = "no CUDA device"
        path.write_text(json.dumps(record, indent=2))
        return 0
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        import logging

        logging.getLogger(name).setLevel(logging.ERROR)
    runs = tuple(r for r in args.runs.split(",") if r)
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if args.dry_run_cpu:
        device, phases = torch.device("cpu"), Phases(1, 1, 1, 1)
        sizes = {"tiny": DRY_SIZE}
        backend = args.backend or "aot_eager"
    else:
        device, phases = torch.device("cuda", 0), Phases(5, 10, 2, 3)
        sizes = {s: SIZES[s] for s in args.sizes.split(",") if s}
        backend = args.backend or "inductor"
        torch.cuda.set_device(device)
    compile_kwargs = None if args.no_compile else {"backend": backend}
    record.update({"dry_run_cpu": args.dry_run_cpu, "phases": vars(phases), "compile": compile_kwargs, "results": []})
    start = time.perf_counter()
    for name, size in sizes.items():
        print(f"gpu_check: {name} ({size})", flush=True)
        result = measure(name, size, phases, device, compile_kwargs, runs, start + args.budget_s)
        record["results"].append(result)
        path.write_text(json.dumps(record, indent=2, default=str))  # partial results survive a time-out
    record["seconds"] = time.perf_counter() - start
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"gpu_check: wrote {path} ({record['seconds']:.0f} s)", flush=True)
    failed = [k for r in record["results"] for k, v in r["runs"].items() if "error" in v]
    if failed:
        print(f"gpu_check: failed runs: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
