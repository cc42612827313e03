"""What every benchmark shares: the model, the records, timing helpers and the process launcher.

Rules (``shared/notes/benchmarks.md``): a benchmark prints its measured value, the baseline measured in the
same run, the ideal and the ratio, and writes ``OUT/<ID>.json``; timings are medians after warm-up steps; each
timed process uses one thread and no more processes than cores are timed together (8-process layouts only
count bytes and calls). Multi-process parts run in fresh processes with a hard time limit
(:func:`launch`), started with the torchrun environment, and hand their result back through a JSON file.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

BENCH_MODEL: dict[str, Any] = {
    "preset": "medium",
    "n_embd": 256,
    "n_head": 4,
    "n_layer": 8,
    "block_size": 128,
    "vocab_size": 2048,
}
"""The benchmark model: a small GPT, hidden 256, 4 heads, 8 layers, sequence 128, vocabulary 2048, fp32."""

TINY_MODEL: dict[str, Any] = {"preset": "tiny", "n_embd": 32, "n_head": 4, "n_layer": 2, "block_size": 16}
"""A tiny GPT for the plumbing tests (``--tiny``): nothing is timed with it."""


def model_config(tiny: bool) -> dict[str, Any]:
    """The GPT keyword arguments of the benchmark (or tiny) model."""
    return dict(TINY_MODEL if tiny else BENCH_MODEL)


def build_gpt(config: dict[str, Any], seed: int = 0, build: bool = True) -> Any:
    """``GPT(**config)`` with its layers built (``configure_model``), initialised from ``seed``."""
    import torch

    from lightning_3d_examples.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(**config)
    if build:
        model.configure_model()
    return model


def seq_len(config: dict[str, Any]) -> int:
    """The sequence length a config trains on (its ``block_size``)."""
    from lightning_3d_examples.gpt import PRESETS

    return int(config.get("block_size", PRESETS[config["preset"]].block_size))


def vocab(config: dict[str, Any]) -> int:
    """The vocabulary size of a config."""
    from lightning_3d_examples.gpt import PRESETS

    return int(config.get("vocab_size", PRESETS[config["preset"]].vocab_size))


def hidden(config: dict[str, Any]) -> int:
    """The hidden size of a config."""
    from lightning_3d_examples.gpt import PRESETS

    return int(config.get("n_embd", PRESETS[config["preset"]].n_embd))


def token_batch(config: dict[str, Any], batch: int, seed: int = 0) -> tuple[Any, Any]:
    """A random ``(inputs, targets)`` batch of token ids, ``(batch, seq)`` each."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab(config), (batch, seq_len(config) + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_loss(logits: Any, targets: Any) -> Any:
    """Mean cross-entropy over every token (what the example GPT's ``training_step`` computes)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# ---------------------------------------------------------------------- environment and records
def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (``[]`` where unavailable)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        try:
            return list(os.getloadavg())
        except OSError:
            return []


def environment() -> dict[str, Any]:
    """What makes a figure reproducible: versions, cores, load at the start."""
    import lightning
    import torch

    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "host": socket.gethostname(),
        "loadavg_start": loadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass
class Record:
    """One benchmark's result: the four numbers every benchmark reports, and the details behind them."""

    id: str
    title: str
    measured: Any
    baseline: Any
    ideal: Any
    ratio: Any
    unit: str = ""
    details: dict[str, Any] | None = None
    lines: Sequence[str] = ()
    baseline_unit: str | None = None
    extra: dict[str, Any] | None = None  # more top-level keys of the JSON record (e.g. B8's per_micro_batch)

    def to_json(self, env: dict[str, Any], seconds: float) -> dict[str, Any]:
        return {
            **(self.extra or {}),
            "id": self.id,
            "title": self.title,
            "measured": self.measured,
            "baseline": self.baseline,
            "ideal": self.ideal,
            "ratio": self.ratio,
            "unit": self.unit,
            "baseline_unit": self.unit if self.baseline_unit is None else self.baseline_unit,
            "details": self.details or {},
            "environment": env,
            "loadavg_end": loadavg(),
            "seconds": round(seconds, 1),
        }


def fmt(value: Any, digits: int = 3) -> str:
    """Short text for a number (or a dict / None)."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v, digits) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, dict):
        if len(value) > 4:
            return f"({len(value)} values, listed above)"
        return ", ".join(f"{k}={fmt(v, digits)}" for k, v in value.items())
    return str(value)


def report(record: Record, out: Path, env: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Print the record and write ``out/<id>.json``; returns the JSON object."""
    data = record.to_json(env, seconds)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{record.id}.json").write_text(json.dumps(data, indent=2, default=str))
    unit = f" {record.unit}" if record.unit else ""
    base_unit = unit if record.baseline_unit is None else f" {record.baseline_unit}"
    load = f"load {fmt(env.get('loadavg_start'), 2)} -> {fmt(data['loadavg_end'], 2)}"
    print(f"== {record.id}: {record.title}  ({seconds:.0f} s, {load})")
    for line in record.lines:
        print(f"   {line}")
    print(
        f"   measured {fmt(record.measured)}{unit} | baseline {fmt(record.baseline)}{base_unit} | "
        f"ideal {fmt(record.ideal)} | ratio {fmt(record.ratio)}",
        flush=True,
    )
    return data


# ---------------------------------------------------------------------- timing
def median(values: Sequence[float]) -> float:
    """The median (``nan`` when empty)."""
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchError(RuntimeError):
    """A benchmark job failed or ran past its time limit (the message ends with the output's tail)."""


def _start_session(cmd: list[str], env: dict[str, str], log: Any) -> Any:
    """Start one worker: a fresh interpreter in a session of its own, its output in the open file ``log``."""
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


start_process: Callable[[list[str], dict[str, str], Any], Any] = _start_session
"""How :func:`launch` starts each worker (``cmd``, its environment, its open log file); returns an object with
``pid``, ``wait()`` and ``kill()``. The test harness replaces it with forks of its pre-imported server
(``tests/scripts/bench_run.py``)."""


def launch(
    target: str,
    nprocs: int,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 180,
    threads: int = 1,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``benchmarks.<module>:<function>(**kwargs)`` in ``nprocs`` fresh processes; return rank 0's result.

    The processes get the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so a
    worker may call ``init_process_group`` or build a Lightning ``Trainer`` (which then uses these processes).
    Each runs in its own session; at the time limit every process is killed and :class:`LaunchError` raised.

    Args:
        target: ``"module:function"`` inside the ``benchmarks`` package (e.g. ``"b1_pipeline:worker"``).
        nprocs: processes to start.
        kwargs: JSON-serialisable keyword arguments of the function.
        timeout: seconds before the whole job is killed.
        threads: OMP/MKL threads of each process (the worker may still change torch's count).
        env: extra environment variables of the processes.
    """
    port = str(_free_port())
    extra_env = dict(env or {})
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks._worker", target, json.dumps(kwargs or {})]
        logs, procs = [], []
        for rank in range(nprocs):
            proc_env = dict(os.environ)
            for key in ("GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "NODE_RANK"):
                proc_env.pop(key, None)
            proc_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs),
                NODE_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS=str(threads),
                MKL_NUM_THREADS=str(threads),
                PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), proc_env.get("PYTHONPATH", "")) if p),
                BENCH_RESULT=str(result_path),
            )
            proc_env.update(extra_env)
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(start_process(cmd, proc_env, log))
        timed_out = False
        try:
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, start + timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker's session: it and whatever it started
                except (ProcessLookupError, PermissionError):
                    proc.kill()  # not a session leader (a process ``start_process`` was replaced to start)
            for proc in procs:
                proc.wait()
        outputs = []
        for rank, log in enumerate(logs):
            log.seek(0)
            outputs.append(f"----- rank {rank} -----\n{log.read()}")
            log.close()
        codes = [p.returncode for p in procs]
        text = "\n".join(outputs)
        if timed_out:
            raise LaunchError(f"{target} on {nprocs} processes timed out after {timeout:.0f} s:\n{text[-6000:]}")
        if any(codes) or not result_path.exists():
            raise LaunchError(f"{target} on {nprocs} processes failed (exit codes {codes}):\n{text[-8000:]}")
        return json.loads(result_path.read_text())


def init_distributed(backend: str = "gloo") -> tuple[int, int]:
    """Initialise the default process group from the torchrun environment; returns ``(rank, world_size)``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def quiet_lightning() -> None:
    """Silence Lightning's banner lines and the warnings a benchmark does not act on."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------- pipeline pieces
def stage_modules(model: Any, pp: int, pp_rank: int, stages_per_rank: int = 1) -> list[tuple[int, Any]]:
    """This pipeline rank's stages of ``model``'s body, split exactly as ``ThreeDStrategy`` splits it.

    Returns ``[(stage_index, nn.Sequential of that stage's layers, under their body names)]``; the layers are
    shared with ``model`` (deep-copy the model first to keep a whole copy).
    """
    from lightning_3d.core import partition

    body = partition.find_body(model)
    plan = partition.plan_stages(body, pp, partition.get_partitioner("uniform"), stages_per_rank)
    return [
        (s, partition.stage_container(body, plan.layer_names[s]))
        for s in range(plan.num_stages)
        if plan.stage_to_rank[s] == pp_rank
    ]


def cpu_stages(
    stages: Sequence[tuple[int, Any]], num_stages: int, group: Any = None, defer_linear: bool = False
) -> list[Any]:
    """Fresh ``PipelineStage``s on the CPU for ``(stage index, module)`` pairs, as the strategy builds them: through
    ``torch_compat``'s subclass, whose first-step warm-up skips a neighbour on the same rank (gloo cannot send to
    itself before torch 2.13). ``defer_linear``: as the strategy's stages under a split backward with
    ``split_backward="linear"`` (``weight_grad_store.py``: the linear layers routed, ``W`` from their kept
    products); other stages over the same modules still run plain ``F.linear``."""
    import torch

    from lightning_3d.core import weight_grad_store
    from lightning_3d.core.torch_compat import PipelineStageWithShapeInferenceHook as Stage

    if defer_linear:
        weight_grad_store.defer_linear_weight_grads([mod for _, mod in stages])
        cls = weight_grad_store.WeightGradStage
    else:
        cls = Stage
    return [cls(mod, s, num_stages, torch.device("cpu"), group=group) for s, mod in stages]


def schedule_spec(spec: str) -> tuple[str, int | None]:
    """A benchmark's schedule argument, ``NAME`` or ``NAME:STAGES_PER_RANK`` (``interleavedzerobubble:1``: torch's
    interleaved zero-bubble schedule over one stage per rank), as ``(name, stages per rank or None)``."""
    head, sep, tail = spec.rpartition(":")
    return (head, int(tail)) if sep and tail.isdigit() else (spec, None)


def checked_stages_per_rank(spec: str, pp: int = 2) -> int:
    """Refuse a benchmark's schedule (a name, ``NAME:STAGES_PER_RANK`` or a CSV action list) as ``ThreeDStrategy``
    would at this ``pp``, before any process starts; return its stages per rank (the given count, a CSV list's
    own, else 2 for the multi-stage schedules and 1 for the others)."""
    from lightning_3d.core.csv_schedule import is_csv_schedule, read_csv_schedule
    from lightning_3d.core.pipeline import check_schedule_name, is_multi_stage
    from lightning_3d.settings import ThreeDSettings

    if is_csv_schedule(spec):
        name, spr = spec, read_csv_schedule(spec).stages_per_rank
    else:
        name, given = schedule_spec(spec)
        check_schedule_name(name)  # an unknown name: the list of runnable ones, before asking its class
        spr = given or (2 if is_multi_stage(name) else 1)
    ThreeDSettings(pp=pp, schedule=name, stages_per_rank=spr)
    return spr


def defers_linear(name: str, split_backward: str) -> bool:
    """Whether the strategy's stages would defer the linear layers' weight gradients under schedule ``name`` (a
    name or a CSV action list) and ``split_backward``."""
    from lightning_3d.core.pipeline import splits_backward

    return split_backward == "linear" and splits_backward(name)


def build_schedule(
    name: str,
    stages: Sequence[tuple[int, Any]],
    num_stages: int,
    n_micro: int,
    group: Any = None,
    split_backward: str = "linear",
) -> Any:
    """A torch schedule (``"gpipe"``, ``"1f1b"``, ``"interleaved1f1b"``..., or ``NAME:STAGES_PER_RANK``,
    :func:`schedule_spec`) over fresh ``PipelineStage``s with the GPT's mean cross-entropy as loss (gradients scaled
    by ``1 / n_micro``, torch's default); a schedule that splits the backward does it as the strategy's
    ``split_backward`` setting says."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from lightning_3d.core import torch_compat
    from lightning_3d.core.csv_schedule import is_csv_schedule
    from lightning_3d.core.pipeline import schedule_class

    name = schedule_spec(name)[0]
    cls = schedule_class(name)
    built = cpu_stages(stages, num_stages, group, defers_linear(name, split_backward))
    if is_csv_schedule(name):  # torch's action runtime over the file's list
        return torch_compat.csv_schedule(built, n_micro, name, loss_fn=gpt_loss)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(built[0], n_micro, loss_fn=gpt_loss)
    return cls(built, n_micro, loss_fn=gpt_loss)


def pipeline_step(schedule: Any, first: bool, last: bool, x: Any, y: Any) -> None:
    """One training step of a schedule: inputs on the first stage, targets on the last."""
    args = (x,) if first else ()
    if last:
        schedule.step(*args, target=y)
    else:
        schedule.step(*args)


# ---------------------------------------------------------------------- 3D runs through Lightning
GPT_SHARDED: tuple[str, ...] = (
    "wte.weight",
    "wpe.weight",
    "q_proj.",
    "k_proj.",
    "v_proj.",
    "fc.",
    "out_proj.weight",
    "proj.weight",
    "lm_head.weight",
)
"""The example GPT's parameters that Megatron-style tensor parallelism splits in ``tp`` (an independent count,
not the strategy's plan): vocabulary-parallel embeddings, column-parallel q/k/v/fc (weight and bias), row-parallel
out_proj/proj weights (their biases stay whole), the column-parallel LM head. LayerNorms stay whole."""


def gpt_local_numel(name: str, shape: Sequence[int], tp: int) -> int:
    """Elements one tensor-parallel rank holds of the example GPT's parameter ``name``."""
    import math

    full = math.prod(shape)
    if tp > 1 and any(key in name for key in GPT_SHARDED):
        assert full % tp == 0, (name, shape, tp)
        return full // tp
    return full


def owned_parameters(strategy: Any) -> tuple[dict[str, int], list[str], dict[str, Any]]:
    """This rank's mesh coordinates, its stage's layer names and the full shapes of the parameters it owns.

    Taken from the full model's shapes and the stage plan, independently of the tensor-parallel plan, so that
    the benchmarks compare what a rank holds with an exact share computed another way.
    """
    mesh = strategy.device_mesh
    coords = {d: mesh[d].get_local_rank() for d in ("dp", "pp", "tp")}
    keep = list(strategy.stage_plan.layer_names[coords["pp"]])
    prefix = strategy.stage_plan.body_fqn
    owned = {
        n: s.shape
        for n, s in strategy.full_spec.items()
        if s.is_parameter and any(n.startswith(f"{prefix}.{k}.") for k in keep)
    }
    return coords, keep, owned


def local_tensor(t: Any) -> Any:
    """The rank's local part of a tensor (``to_local()`` of a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fit_3d(
    config: dict[str, Any],
    callback: Any,
    *,
    tp: int,
    pp: int,
    micro_batches: int,
    batch: int,
    steps: int,
    devices: int,
    module: Any = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **strategy_kwargs: Any,
) -> Any:
    """``Trainer.fit`` of the example GPT with ``ThreeDStrategy`` in the processes of this job (built in
    ``configure_model``, i.e. on the meta device and materialised shard by shard); returns the trainer.
    ``module`` replaces the GPT (e.g. the Hugging Face Llama of ``hf_llama.py``; ``config`` then only gives the
    data's vocabulary and sequence length). ``trainer_kwargs`` go to the ``Trainer`` (e.g.
    ``use_distributed_sampler=False``: batches in order), ``strategy_kwargs`` to ``ThreeDStrategy`` (e.g.
    ``on_nonfinite="off"``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_3d import ThreeDStrategy

    quiet_lightning()
    L.seed_everything(0, verbose=False)
    model = build_gpt(config, build=False) if module is None else module
    dp = devices // (tp * pp)
    x, y = token_batch(config, batch * dp * steps, seed=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ThreeDStrategy(tp=tp, pp=pp, micro_batches=micro_batches, print_layout=False, **strategy_kwargs),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **(trainer_kwargs or {}),
    )
    torch.manual_seed(0)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch))
    return trainer


# ---------------------------------------------------------------------- where a step's time goes
PROFILE_CATEGORIES: dict[str, tuple[str, ...]] = {
    "collectives (incl. waiting)": ("wait_tensor", "allreduce", "all_reduce", "all_gather", "allgather", "broadcast"),
    "replicate/FSDP2 hooks (incl. its all-reduce wait)": ("FSDP::",),
    "DTensor dispatch": ("PythonSubclass", "FromTorchTensor", "ToTorchTensor", "Redistribute", "_wrap_tensor_autograd"),
    "copies (copy_, cat)": ("aten::copy_", "aten::cat", "foreach_copy", "chunk_cat"),
    "matmul + attention": ("aten::mm", "aten::addmm", "aten::bmm", "scaled_dot_product", "aten::_flash"),
}
"""Substrings of profiler op names, by category (self CPU time is summed; the rest is "other")."""


def profile_breakdown(step: Callable[[], Any]) -> dict[str, float]:
    """Run ``step`` once under ``torch.profiler`` (CPU) and split its self CPU time (ms) by category.

    Also reports ``optimizer step (total)``: the inclusive time of ``Optimizer.step`` (it overlaps the others).
    The profiler slows small ops down, so the shares matter more than the absolute numbers.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    out["other"] = 0.0
    optimizer = 0.0
    for avg in prof.key_averages():
        self_ms = avg.self_cpu_time_total / 1e3
        if avg.key.startswith("Optimizer.step"):
            optimizer = max(optimizer, avg.cpu_time_total / 1e3)
        for cat, keys in PROFILE_CATEGORIES.items():
            if any(k in avg.key for k in keys):
                out[cat] += self_ms
                break
        else:
            out["other"] += self_ms
    out["total (profiled)"] = sum(out.values())
    out["optimizer step (total)"] = optimizer
    return out


def breakdown_text(parts: dict[str, float]) -> str:
    """One line for a :func:`profile_breakdown` result."""
    total = parts.get("total (profiled)", 0.0) or 1.0
    keys = [k for k in parts if k not in ("total (profiled)", "optimizer step (total)")]
    text = ", ".join(f"{k} {parts[k]:.0f} ms ({parts[k] / total:.0%})" for k in keys if parts[k] >= 0.5)
    return f"{text}; AdamW step {parts.get('optimizer step (total)', 0.0):.0f} ms (inclusive)"
