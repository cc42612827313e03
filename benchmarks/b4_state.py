"""B4 state memory per rank: parameters + gradients + optimizer state at dp2 x pp2 x tp2, and peak RSS.

Eight processes (counting only, nothing timed): ``Trainer.fit`` of the benchmark GPT with
``ThreeDStrategy(tp=2, pp=2)`` (dp=2), the model built in ``configure_model`` (meta device, materialised one
layer at a time), AdamW. After the first optimizer step every rank adds up the bytes it holds locally
(``to_local()`` of DTensors): parameters, their gradients and every tensor of the optimizer state
(``exp_avg``, ``exp_avg_sq``, ``step``). The exact share of a rank is computed independently of the strategy's
plan: its stage's parameters (same uniform split), the Megatron-sharded ones divided by tp
(:data:`benchmarks.common.GPT_SHARDED`), LayerNorms and row-parallel biases whole, times
(parameter + gradient + 2 Adam moments) x 4 bytes, plus one 4-byte ``step`` per parameter tensor.

Also reported: the naive share ``full / (tp * pp)`` of benchmarks.md (the worst rank's excess over it is the
replicated norms/biases and the stage imbalance), and each rank's peak-RSS growth from just before
``configure_model`` to the start of training, next to the full model's parameter bytes.
Ratio = max over ranks of measured / exact share (ideal 1.00).

``--model hf_llama`` / ``hf_llama_tied`` (record ``B4_<model>``): the same count for the Hugging Face Llama of
``hf_llama.py`` (GQA) under its own tensor-parallel plan, split at its block container. The exact share comes
from a meta-device copy of the model (every parameter name, tied aliases included), the stage rule
:func:`benchmarks.hf_llama.llama_stage` and the shard rule :func:`benchmarks.hf_llama.llama_local_numel`; a tied
LM head counts on both the first stage (as the embedding) and the last (as the head), each with its own AdamW
state. No RSS probe.

``--data-parallel fsdp`` (record ``B4_fsdp``): the same GPT count under ``ThreeDStrategy(data_parallel="fsdp")``;
the exact share is then 1 / (dp x pp x tp): the stage's tensor-parallel share of parameters, gradients and Adam
moments divided by dp (FSDP2 pads a tensor whose first dimension dp does not divide, so the worst rank may hold
a few rows more), plus the unsharded 4-byte ``step`` per tensor. No RSS probe.

``--data-parallel fsdp --model xl-shallow`` (record ``B4_fsdp_xl-shallow``): the issue's goal "every rank's peak
memory <= its share + one layer's full weights" at tp2 x pp2 x dp2 under FSDP, measured with a CPU tracker of live
tensor bytes (:mod:`benchmarks.mem_tracker`, not RSS). The model: the xl GPT's 16 heads at half its width (1024;
the full xl, 19 GB of weights and Adam states over 8 ranks, does not fit the shared CPU machine) and 4 layers
(two blocks per stage, so that "one layer" and "the stage" differ), sequence 32, vocabulary 256; ``--tiny``:
width 64, 4 heads. Per rank: the peak during setup (``configure_model`` on meta to the start of training)
against its parameter share + the largest block's full (unsharded) weights, and the peak of each training step
after the first against its whole share (parameters + gradients + AdamW moments, counted as in B4) + that block,
with what that peak is made of (shards, AdamW, gathered parameters, unsharded gradients, FSDP2's communication
buffers, the rest); also FSDP's all-gathers and reduce-scatters per step and the step time, once per row of
:data:`MEMORY_ROWS` (``fsdp_reshard_after_forward`` False, the default under a pipeline, and True;
``fsdp_reshard_after_backward=True``, also with FSDP2's backward prefetch left on, and with each reduce-scatter's
input freed at once, a CPU-only diagnostic; ``fsdp_unit="submodule"`` alone, with ``fsdp_reshard_after_backward=True``
and with activation checkpointing as well; ``--tiny``: the default only), with the rank's FSDP units and the largest
one's gathered bytes (:func:`fsdp_unit_bytes`, from the full model's shapes), so that a peak reads as the share plus
so many blocks and so many largest units. The record's value is the worst rank's step peak under
``fsdp_unit="submodule"`` with ``fsdp_reshard_after_backward=True`` (:data:`HEADLINE_ROW`). The initial parameters
are checked against one process materialising the whole model with the same seed (gathered to rank 0, max abs
difference).
"""

from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import Any

from .common import Record
from .hf_llama import MODEL_NAMES

ID, TITLE = "B4", "state bytes per rank (params + grads + AdamW) at dp2 x pp2 x tp2, and peak RSS"
TP, PP, DEVICES = 2, 2, 8
XL_SHALLOW = "xl-shallow"
SLACK = 4096
"""Bytes of non-model tensors (device-mesh rank tables) the FSDP memory goal allows beside share + one layer."""
MODELS: tuple[str, ...] = ("gpt", *MODEL_NAMES)
"""The models this benchmark runs on (``--model``); ``xl-shallow`` too, with ``--data-parallel fsdp`` only."""


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(
    tiny: bool = False, steps: int = 1, n_embd: int | None = None, data_parallel: str = "replicate"
) -> dict[str, Any]:
    """Runs on the 8 ranks; returns every rank's counts."""
    import lightning as L
    import torch.distributed as dist

    from .common import fit_3d, gpt_local_numel, local_tensor, model_config, owned_parameters

    class Count(L.Callback):
        def __init__(self) -> None:
            self.record: dict[str, Any] = {}
            self.before = 0

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.before = _peak_rss()

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            strategy = trainer.strategy
            # the exact share, from the full model's shapes and this rank's stage (independent of the plan)
            coords, keep, owned = owned_parameters(strategy)
            prefix = strategy.stage_plan.body_fqn
            layer_full = {
                k: sum(4 * math.prod(shape) for n, shape in owned.items() if n.startswith(f"{prefix}.{k}."))
                for k in keep
            }
            exact_params = sum(gpt_local_numel(n, shape, TP) for n, shape in owned.items()) * 4
            if data_parallel == "fsdp":  # parameters, gradients and Adam moments split over dp
                exact_params /= trainer.strategy.device_mesh["dp"].size()
            self.record.update(
                rank=trainer.global_rank,
                coords=coords,
                rss_growth=_peak_rss() - self.before,
                rss_before=self.before,
                exact_bytes=exact_params * 4 + 4 * len(owned),
                exact_param_bytes=exact_params,
                largest_layer_full_bytes=max(layer_full.values()),
                owned_tensors=len(owned),
                full_param_bytes=sum(4 * math.prod(s.shape) for s in strategy.full_spec.values() if s.is_parameter),
                full_param_tensors=sum(1 for s in strategy.full_spec.values() if s.is_parameter),
            )

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != 0:
                return
            params = list(pl_module.parameters())

            def nbytes(t: Any) -> int:
                t = local_tensor(t)
                return t.numel() * t.element_size()

            opt_bytes = sum(
                nbytes(v)
                for opt in trainer.optimizers
                for st in opt.state.values()
                for v in st.values()
                if hasattr(v, "numel")
            )
            self.record.update(
                param_bytes=sum(nbytes(p) for p in params),
                grad_bytes=sum(nbytes(p.grad) for p in params if p.grad is not None),
                optimizer_bytes=opt_bytes,
                param_tensors=len(params),
            )

    counter = Count()
    config = model_config(tiny)
    if n_embd is not None:
        config["n_embd"] = n_embd
    kwargs = {"data_parallel": data_parallel} if data_parallel != "replicate" else {}
    fit_3d(config, counter, tp=TP, pp=PP, micro_batches=2, batch=2, steps=steps, devices=DEVICES, **kwargs)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counter.record)
    return {"ranks": gathered}


def _state_bytes(trainer: Any, pl_module: Any) -> dict[str, int]:
    """Bytes this rank holds: its parameters, their gradients and the optimizers' state (local shards)."""
    from .common import local_tensor

    params = list(pl_module.parameters())

    def nbytes(t: Any) -> int:
        t = local_tensor(t)
        return t.numel() * t.element_size()

    opt_bytes = sum(
        nbytes(v) for opt in trainer.optimizers for st in opt.state.values() for v in st.values() if hasattr(v, "numel")
    )
    return {
        "param_bytes": sum(nbytes(p) for p in params),
        "grad_bytes": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt_bytes,
        "param_tensors": len(params),
    }


def worker_llama(model: str, tiny: bool = False) -> dict[str, Any]:
    """Runs on the 8 ranks with the Hugging Face Llama; returns every rank's counts."""
    import lightning as L
    import torch.distributed as dist

    from .common import fit_3d
    from .hf_llama import build_llama, llama_config, llama_local_numel, owned_llama, reference_parameters

    config = llama_config(model, tiny)
    reference = reference_parameters(config)  # every name, tied aliases included (independent of the strategy)
    unique = reference_parameters(config, with_aliases=False)  # the unsplit model's parameters, each once
    n_layers = int(config["num_hidden_layers"])

    class Count(L.Callback):
        def __init__(self) -> None:
            self.record: dict[str, Any] = {}
            self.before = 0

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.before = _peak_rss()

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            mesh = trainer.strategy.device_mesh
            coords = {d: mesh[d].get_local_rank() for d in ("dp", "pp", "tp")}
            owned = owned_llama(reference, n_layers, PP, coords["pp"])
            exact_params = sum(llama_local_numel(n, shape, TP) for n, shape in owned.items()) * 4
            self.record.update(
                rank=trainer.global_rank,
                coords=coords,
                rss_growth=_peak_rss() - self.before,
                exact_bytes=exact_params * 4 + 4 * len(owned),
                exact_param_bytes=exact_params,
                owned_tensors=len(owned),
                owned_outside_blocks=sorted(n for n in owned if ".layers." not in n),
                full_param_bytes=sum(4 * math.prod(s) for s in unique.values()),
                full_param_tensors=len(unique),
            )

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.record.update(_state_bytes(trainer, pl_module))

    counter = Count()
    fit_3d(
        config,
        counter,
        tp=TP,
        pp=PP,
        micro_batches=2,
        batch=2,
        steps=1,
        devices=DEVICES,
        module=build_llama(config, build=False),
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counter.record)
    return {"ranks": gathered, "config": config}


def xl_shallow_config(tiny: bool) -> dict[str, Any]:
    """The GPT of the FSDP memory record: the xl's 16 heads at half its width, 4 layers (``tiny``: width 64)."""
    if tiny:
        return {"preset": "tiny", "n_embd": 64, "n_head": 4, "n_layer": 4, "block_size": 16}
    return {"preset": "xl", "n_embd": 1024, "n_head": 16, "n_layer": 4, "block_size": 32, "vocab_size": 256}


#: The FSDP choices B4/FSDP measures, by row name: the strategy's settings, plus two measurement-only switches:
#: ``backward_prefetch`` keeps FSDP2's implicit backward prefetch on under ``fsdp_reshard_after_backward`` (which
#: turns it off), ``free_reduce_scatter_input`` (a diagnostic, CPU only) frees each reduce-scatter's input as soon as
#: gloo's synchronous collective returns, instead of FSDP2 keeping it in flight until the next unit's.
MEMORY_ROWS: dict[str, dict[str, Any]] = {
    "False": {"fsdp_reshard_after_forward": False},
    "True": {"fsdp_reshard_after_forward": True},
    "rab": {"fsdp_reshard_after_backward": True},
    "rab+prefetch": {"fsdp_reshard_after_backward": True, "backward_prefetch": True},
    "rab-rs-freed": {"fsdp_reshard_after_backward": True, "free_reduce_scatter_input": True},
    "sub": {"fsdp_unit": "submodule"},
    "sub-rab": {"fsdp_unit": "submodule", "fsdp_reshard_after_backward": True},
    "sub-rab-ac": {"fsdp_unit": "submodule", "fsdp_reshard_after_backward": True, "activation_checkpointing": "full"},
}
ROW_TITLES = {
    "False": "fsdp_reshard_after_forward=False (default under a pipeline)",
    "True": "fsdp_reshard_after_forward=True",
    "rab": "fsdp_reshard_after_backward=True",
    "rab+prefetch": "fsdp_reshard_after_backward=True with FSDP2's backward prefetch left on",
    "rab-rs-freed": "fsdp_reshard_after_backward=True, each reduce-scatter's input freed at once (diagnostic, CPU)",
    "sub": "fsdp_unit='submodule'",
    "sub-rab": "fsdp_unit='submodule', fsdp_reshard_after_backward=True",
    "sub-rab-ac": "fsdp_unit='submodule', fsdp_reshard_after_backward=True, activation_checkpointing='full'",
}
HEADLINE_ROW = "sub-rab"
"""The row whose worst rank is the record's value: the choice that meets the goal."""


class FreeingReduceScatter:
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``) that frees its input as soon as the collective has
    returned: a CPU-only diagnostic (gloo's collective is synchronous there; on a GPU the reduce-scatter runs on
    its own stream and FSDP2 keeps the input so that the compute stream cannot reuse it too early)."""

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> None:
        import torch.distributed as dist

        from lightning_3d.core.torch_compat import fsdp_collective_names

        reduce_scatter = getattr(dist, fsdp_collective_names()[0])
        work = reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        input_tensor.untyped_storage().resize_(0)


def worker_memory(tiny: bool = False, row: str = "False", steps: int = 3) -> dict[str, Any]:
    """Runs on the 8 ranks under FSDP (``row``: a :data:`MEMORY_ROWS` choice): peak live tensor bytes in setup and
    per step (with what the step's peak is made of), shares, all-gathers and reduce-scatters, step time."""
    import time

    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_3d.core.fsdp as fsdp_module
    from lightning_3d.core import torch_compat
    from lightning_3d.core.materialize import materialize

    from .common import build_gpt, fit_3d, gpt_local_numel, owned_parameters
    from .mem_tracker import peak_tracker

    rs_name, ag_name = torch_compat.fsdp_collective_names()
    counts = {ag_name: 0, rs_name: 0}
    for name in counts:  # FSDP2's collectives (tensor parallelism's go through other functions)
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    config = xl_shallow_config(tiny)
    import lightning_3d.strategy as strategy_module

    build = strategy_module.build_stages
    phases: dict[str, int] = {}

    def build_measured(*args: Any, **kwargs: Any) -> Any:  # the peak of building the stages alone
        tracker = probe.tracker
        before = tracker.peak
        tracker.reset_peak()
        phases["live_before_build"] = tracker.live()
        built = build(*args, **kwargs)
        phases["build_peak"], phases["live_after_build"] = tracker.peak, tracker.live()
        phases["at_peak"] = getattr(tracker, "at_peak", None)
        tracker.peak = max(before, tracker.peak)
        return built

    strategy_module.build_stages = build_measured
    settings = dict(MEMORY_ROWS[row])
    if settings.pop("backward_prefetch", False):  # measure the mode with FSDP2's implicit prefetch kept
        fsdp_module.no_backward_prefetch = lambda module: None
    free_reduce_scatter_input = settings.pop("free_reduce_scatter_input", False)

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.tracker = peak_tracker()
            self.record: dict[str, Any] = {"steps": []}
            self.seed = 0
            self.start = 0.0
            self.live_at_start = 0
            self.shards: list[Any] = []
            self.module: Any = None
            self.optimizers: list[Any] = []

        def breakdown(self, op: str, storages: list[tuple[int, int]]) -> dict[str, Any]:
            """What the live storages at a new peak are: this rank's parameter shards, their (sharded) gradients,
            AdamW's states, parameters gathered by FSDP (registered on the modules while a unit is unsharded),
            their unsharded gradients, FSDP2's communication buffers (``torch_compat.fsdp_comm_buffers``); the rest
            (activations, autograd's temporaries) with its largest sizes."""

            def ptr(t: Any) -> int:
                return local_tensor(t).untyped_storage().data_ptr()

            labels: dict[int, str] = {}
            for label, buffer in torch_compat.fsdp_comm_buffers(self.module):
                labels.setdefault(buffer.untyped_storage().data_ptr(), f"FSDP {label}")
            for p in self.shards:
                labels.setdefault(ptr(p), "param shards")
                if p.grad is not None:
                    labels.setdefault(ptr(p.grad), "grad shards")
            for opt in self.optimizers:
                for state in opt.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor) and v.numel() > 1:
                            labels.setdefault(ptr(v), "AdamW states")
            for p in self.module.parameters():
                labels.setdefault(ptr(p), "gathered params")
                if p.grad is not None:
                    labels.setdefault(ptr(p.grad), "unsharded grads")
            totals: dict[str, int] = {}
            other: list[int] = []
            for nbytes, data_ptr in storages:
                label = labels.get(data_ptr, "other")
                totals[label] = totals.get(label, 0) + nbytes
                if label == "other":
                    other.append(nbytes)
            return {"op": op, "bytes": totals, "other_largest": other[:8], "live": sum(n for n, _ in storages)}

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.seed = torch.initial_seed() % (2**62)  # what the strategy broadcasts from rank 0 (seed=None)
            self.tracker.__enter__()

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            strategy = trainer.strategy
            setup_peak, self.live_at_start = self.tracker.peak, self.tracker.live()
            coords, keep, owned = owned_parameters(strategy)
            prefix = strategy.stage_plan.body_fqn
            block_full = max(
                sum(4 * math.prod(shape) for n, shape in owned.items() if n.startswith(f"{prefix}.{k}."))
                for k in keep
                if k not in ("0", str(config["n_layer"] + 1))  # the embedding and the head are not blocks
            )
            exact_params = sum(gpt_local_numel(n, shape, TP) for n, shape in owned.items()) * 4
            exact_params /= strategy.device_mesh["dp"].size()
            self.tracker.__exit__(None, None, None)  # the check below gathers the whole model on rank 0
            full = strategy.full_state_dict()
            init_diff = None
            if full is not None:
                with torch.device("meta"):
                    ref = build_gpt(config, build=False)
                    ref.configure_model()
                materialize(ref.body, torch.device("cpu"), self.seed, prefix="body")  # one device, whole model
                want = ref.state_dict()
                init_diff = max(float((full[k] - want[k]).abs().max()) for k in want)
                if set(full) != set(want):
                    init_diff = float("inf")
            del full
            self.shards, self.module, self.optimizers = list(pl_module.parameters()), pl_module, trainer.optimizers
            units = fsdp_unit_bytes(pl_module, strategy.full_spec)
            if free_reduce_scatter_input:
                from torch.distributed.fsdp import FSDPModule

                for sub in pl_module.modules():
                    if isinstance(sub, FSDPModule):
                        sub.set_custom_reduce_scatter(FreeingReduceScatter())
            self.record.update(
                rank=trainer.global_rank,
                coords=coords,
                setup_peak=setup_peak,
                exact_param_bytes=exact_params,
                exact_bytes=exact_params * 4 + 4 * len(owned),
                block_full_bytes=block_full,
                fsdp_units=len(units),
                largest_unit_bytes=max(units.values()),
                init_max_abs_diff=init_diff,
                live_at_fit_start=self.live_at_start,
                **phases,
            )
            self.tracker.__enter__()
            self.tracker.reset_peak()
            self.tracker.on_peak = self.breakdown

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            for name in counts:
                counts[name] = 0
            self.optimizers = trainer.optimizers
            self.tracker.reset_peak()
            self.tracker.at_peak = None
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seconds = time.perf_counter() - self.start
            self.record["steps"].append(
                {
                    "peak": self.tracker.peak,
                    "seconds": seconds,
                    "all_gathers": counts[ag_name],
                    "reduce_scatters": counts[rs_name],
                    "at_peak": self.tracker.at_peak,
                }
            )
            if batch_idx == 0:
                self.record.update(_state_bytes(trainer, pl_module))

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self.tracker.__exit__(None, None, None)

    from .common import local_tensor

    probe = Probe()
    fit_3d(
        config, probe, tp=TP, pp=PP, micro_batches=2, batch=2, steps=steps, devices=DEVICES, data_parallel="fsdp",
        **settings,
    )  # fmt: skip
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, probe.record)
    return {"ranks": gathered, "config": config}


def fsdp_unit_bytes(module: Any, full_spec: dict[str, Any]) -> dict[str, int]:
    """Each FSDP unit under ``module`` that gathers parameters of its own (not a nested unit's), by module name: the
    bytes of those parameters gathered over dp (their tensor-parallel share, from the full model's shapes and
    :data:`benchmarks.common.GPT_SHARDED`, not from the strategy's plan)."""
    from torch.distributed.fsdp import FSDPModule

    from .common import gpt_local_numel

    units = {n: m for n, m in module.named_modules() if isinstance(m, FSDPModule)}
    out: dict[str, int] = {}
    for name, unit in units.items():
        nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}  # fmt: skip
        own = [f"{name}.{n}" if name else n for n, p in unit.named_parameters() if id(p) not in nested]
        if own:
            out[name] = sum(4 * gpt_local_numel(n, full_spec[n].shape, TP) for n in own)
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def describe_peak(at_peak: dict[str, Any] | None, share: int) -> str:
    """One line: what a step's peak held beyond the rank's share (from :func:`worker_memory`'s breakdown)."""
    if not at_peak:
        return "no breakdown"
    parts = ", ".join(f"{label} {_mb(n)}" for label, n in sorted(at_peak["bytes"].items(), key=lambda kv: -kv[1]))
    largest = ", ".join(_mb(n) for n in at_peak["other_largest"][:5])
    return (
        f"at {at_peak['op']}: live {_mb(at_peak['live'])} MB = {parts} MB (share {_mb(share)} MB); "
        f"largest 'other' storages {largest} MB"
    )


def run_memory(out: Path, tiny: bool) -> Record:
    """FSDP memory against the goal (share + one layer), per FSDP choice (:data:`MEMORY_ROWS`; ``--tiny``: the
    default under a pipeline only). The record's value and ratio are those of :data:`HEADLINE_ROW`
    (``fsdp_unit="submodule"`` with ``fsdp_reshard_after_backward=True``, the choice made for the goal), the
    default's with ``--tiny``."""
    from .common import launch

    choices = ["False"] if tiny else list(MEMORY_ROWS)
    runs: dict[str, Any] = {}
    lines = []
    config = xl_shallow_config(tiny)
    lines.append(
        f"GPT n_embd {config['n_embd']}, {config['n_head']} heads, {config['n_layer']} layers, sequence "
        f"{config['block_size']}, tp2 x pp2 x dp2, data_parallel='fsdp', 1F1B, 2 micro-batches of 1, AdamW; live "
        "tensor bytes (benchmarks/mem_tracker.py); 8 processes on this machine's cores: step times are for "
        "comparing rows of one run, not speeds"
    )
    for choice in choices:
        res = launch("b4_state:worker_memory", DEVICES, {"tiny": tiny, "row": choice}, timeout=900)
        ranks = sorted(res["ranks"], key=lambda r: r["rank"])
        per_rank = []
        lines.append(f"{ROW_TITLES[choice]}:")
        lines.append(
            "rank (dp,pp,tp) | setup peak MB | params share + block MB | step peak MB | share + block MB | "
            "step/goal | all-gathers/step | reduce-scatters/step | step s | setup ok | step ok"
        )
        for r in ranks:
            later = r["steps"][1:] or r["steps"]  # the first step also infers shapes and creates Adam's state
            share = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
            # + a few bytes of bookkeeping tensors (device-mesh rank tables: 32 bytes measured)
            setup_goal = r["exact_param_bytes"] + r["block_full_bytes"] + SLACK
            step_goal = share + r["block_full_bytes"] + SLACK
            peak_step = max(later, key=lambda st: st["peak"])
            step_peak = peak_step["peak"]
            row = {
                **r,
                "share_bytes": share,
                "setup_goal_bytes": setup_goal,
                "setup_ok": r["setup_peak"] <= setup_goal,
                "step_peak": step_peak,
                "step_goal_bytes": step_goal,
                "step_ok": step_peak <= step_goal,
                "step_over_goal": step_peak / step_goal,
                "over_share_in_blocks": (step_peak - share) / r["block_full_bytes"],
                "over_share_in_largest_units": (step_peak - share) / r["largest_unit_bytes"],
                "all_gathers_per_step": [st["all_gathers"] for st in later],
                "reduce_scatters_per_step": [st["reduce_scatters"] for st in later],
                "step_seconds": [st["seconds"] for st in later],
                "peak_breakdown": peak_step.get("at_peak"),
            }
            per_rank.append(row)
            c = r["coords"]
            lines.append(
                f"{r['rank']:4d} ({c['dp']},{c['pp']},{c['tp']})     | {_mb(r['setup_peak']):>13} | "
                f"{_mb(setup_goal):>23} | {_mb(step_peak):>12} | {_mb(step_goal):>16} | "
                f"{step_peak / step_goal:9.3f} | {max(row['all_gathers_per_step']):16d} | "
                f"{max(row['reduce_scatters_per_step']):20d} | {min(row['step_seconds']):6.2f} | "
                f"{'yes' if row['setup_ok'] else 'NO':>8} | {'yes' if row['step_ok'] else 'NO':>7}"
            )
        worst = max(per_rank, key=lambda r: r["step_over_goal"])
        lines.append(
            f"  worst rank {worst['rank']}: step peak = share + {worst['over_share_in_blocks']:.2f} blocks = share + "
            f"{worst['over_share_in_largest_units']:.2f} x its largest FSDP unit gathered "
            f"({_mb(worst['largest_unit_bytes'])} MB; {worst['fsdp_units']} units on the rank); "
            + describe_peak(worst["peak_breakdown"], worst["share_bytes"])
        )
        diffs = [r["init_max_abs_diff"] for r in ranks if r["init_max_abs_diff"] is not None]
        lines.append(f"  initial parameters vs one process materialising the whole model: max abs diff {diffs}")
        runs[choice] = {"ranks": per_rank, "init_max_abs_diff": diffs, "settings": MEMORY_ROWS[choice]}
    details = {
        "config": config,
        "layout": "tp2 x pp2 x dp2, data_parallel='fsdp', 8 CPU processes, 1F1B, 2 micro-batches, AdamW",
        "runs": runs,
        "goal": f"every rank's peak <= its share + one layer's (block's) full weights + {SLACK} bytes",
    }
    headline = runs[HEADLINE_ROW if HEADLINE_ROW in runs else "False"]["ranks"]
    worst = max(headline, key=lambda r: r["step_over_goal"])
    ratio = max(max(r["step_over_goal"], r["setup_peak"] / r["setup_goal_bytes"]) for r in headline)
    return Record(
        f"{ID}_fsdp_{XL_SHALLOW}",
        f"{TITLE} (data_parallel='fsdp', peak live bytes vs share + one layer)",
        worst["step_peak"] / 2**20,
        worst["step_goal_bytes"] / 2**20,
        worst["step_goal_bytes"] / 2**20,
        ratio,
        "MB (worst rank's step peak)",
        details,
        lines,
        "MB (its share + one block)",
    )


def run(out: Path, tiny: bool = False, model: str = "gpt", data_parallel: str = "replicate") -> Record:
    """Launch the eight processes and build the record (``B4``, or ``B4_fsdp`` under ``data_parallel="fsdp"``)."""
    from .common import launch

    if model == XL_SHALLOW:
        if data_parallel != "fsdp":
            raise ValueError("B4 --model xl-shallow measures FSDP memory: add --data-parallel fsdp")
        return run_memory(out, tiny)
    if model != "gpt":
        return run_llama(out, tiny, model)

    fsdp = data_parallel == "fsdp"
    res = launch("b4_state:worker", DEVICES, {"tiny": tiny, "data_parallel": data_parallel}, timeout=300)
    # RSS of a model big enough to see: hidden 1024 (4x the benchmark GPT's width), built, not trained; once with
    # glibc's default (dynamic) mmap threshold, once with a fixed one, which returns freed buffers to the system
    big_hidden = 1024
    probes: dict[str, list[dict[str, Any]]] = {}
    if not tiny and not fsdp:
        for name, env in (
            ("default malloc", None),
            ("MALLOC_MMAP_THRESHOLD_=131072", {"MALLOC_MMAP_THRESHOLD_": "131072"}),
        ):
            args = {"steps": 0, "n_embd": big_hidden}
            probes[name] = launch("b4_state:worker", DEVICES, args, timeout=240, env=env)["ranks"]
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    full_params = ranks[0]["full_param_bytes"]
    full_state = full_params * 4 + 4 * ranks[0]["full_param_tensors"]
    naive = full_state / (TP * PP)
    lines = ["rank (dp,pp,tp) | params MB | grads MB | AdamW MB | total MB | exact MB | total/exact | RSS growth MB"]
    per_rank = []
    for r in ranks:
        total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        ratio = total / r["exact_bytes"]
        per_rank.append({**r, "total_bytes": total, "ratio_exact": ratio, "ratio_naive": total / naive})
        c = r["coords"]
        lines.append(
            f"{r['rank']:4d} ({c['dp']},{c['pp']},{c['tp']})     | {r['param_bytes'] / 2**20:9.3f} | "
            f"{r['grad_bytes'] / 2**20:8.3f} | {r['optimizer_bytes'] / 2**20:8.3f} | {total / 2**20:8.3f} | "
            f"{r['exact_bytes'] / 2**20:8.3f} | {ratio:11.4f} | {r['rss_growth'] / 2**20:8.1f}"
        )
    worst = max(per_rank, key=lambda r: r["total_bytes"])
    worst_ratio = max(r["ratio_exact"] for r in per_rank)
    lines.append(
        f"full model state {full_state / 2**20:.2f} MB (parameters {full_params / 2**20:.2f} MB); naive share "
        f"full/(tp*pp) = {naive / 2**20:.2f} MB; worst rank {worst['total_bytes'] / 2**20:.2f} MB = "
        f"{worst['total_bytes'] / naive:.3f} x naive share, {worst['ratio_exact']:.4f} x its exact share"
    )
    rss = [r["rss_growth"] for r in per_rank]
    lines.append(
        f"peak RSS growth while building (configure_model on meta + per-layer materialisation): "
        f"{min(rss) / 2**20:.1f}..{max(rss) / 2**20:.1f} MB per rank, vs {full_params / 2**20:.1f} MB for the whole "
        f"model's parameters"
    )
    probe: dict[str, Any] = {"skipped": "--tiny or fsdp"} if tiny or fsdp else {"n_embd": big_hidden}
    for name, big in probes.items():
        full = big[0]["full_param_bytes"]
        growth = [r["rss_growth"] for r in big]
        expected = [r["exact_param_bytes"] + r["largest_layer_full_bytes"] for r in big]
        w = max(range(len(big)), key=lambda i: growth[i] / expected[i])
        probe[name] = {"full_param_bytes": full, "rss_growth": growth, "share_plus_one_full_layer": expected}
        lines.append(
            f"hidden {big_hidden}, built not trained, {name}: peak RSS growth {min(growth) / 2**20:.0f}.."
            f"{max(growth) / 2**20:.0f} MB per rank; worst = {growth[w] / expected[w]:.2f} x (its share + one "
            f"full layer = {expected[w] / 2**20:.0f} MB), {max(growth) / full:.2f} x the whole model's "
            f"{full / 2**20:.0f} MB"
        )
    details = {
        "rss_probe": probe,
        "ranks": per_rank,
        "full_state_bytes": full_state,
        "full_param_bytes": full_params,
        "naive_share_bytes": naive,
        "worst_rank_over_naive": worst["total_bytes"] / naive,
        "layout": "dp2 x pp2 x tp2 on 8 processes (counting only), AdamW, after the first optimizer step",
        "data_parallel": data_parallel,
    }
    return Record(
        f"{ID}_fsdp" if fsdp else ID,
        f"{TITLE} (data_parallel='fsdp')" if fsdp else TITLE,
        worst["total_bytes"] / 2**20,
        full_state / 2**20,
        worst["exact_bytes"] / 2**20,
        worst_ratio,
        "MB (worst rank)",
        details,
        lines,
        "MB (full model state)",
    )


def run_llama(out: Path, tiny: bool, model: str) -> Record:
    """B4 on the Hugging Face Llama: launch the eight processes and build the record ``B4_<model>``."""
    from .common import launch
    from .hf_llama import check_model

    res = launch("b4_state:worker_llama", DEVICES, {"model": check_model(model), "tiny": tiny}, timeout=300)
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    full_params = ranks[0]["full_param_bytes"]
    full_state = full_params * 4 + 4 * ranks[0]["full_param_tensors"]
    naive = full_state / (TP * PP)
    lines = [
        f"{model}: LlamaForCausalLM hidden {res['config']['hidden_size']}, {res['config']['num_attention_heads']} "
        f"heads / {res['config']['num_key_value_heads']} kv heads, intermediate {res['config']['intermediate_size']}, "
        f"vocab {res['config']['vocab_size']}, {res['config']['num_hidden_layers']} layers, tied embeddings: "
        f"{res['config']['tie_word_embeddings']}; Hugging Face tp plan, tp2 x pp2 x dp2",
        "rank (dp,pp,tp) | params MB | grads MB | AdamW MB | total MB | exact MB | total/exact | outside the blocks",
    ]
    per_rank = []
    for r in ranks:
        total = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        ratio = total / r["exact_bytes"]
        per_rank.append({**r, "total_bytes": total, "ratio_exact": ratio, "ratio_naive": total / naive})
        c = r["coords"]
        outside = ", ".join(n.removeprefix("model.") for n in r["owned_outside_blocks"]) or "-"
        lines.append(
            f"{r['rank']:4d} ({c['dp']},{c['pp']},{c['tp']})     | {r['param_bytes'] / 2**20:9.3f} | "
            f"{r['grad_bytes'] / 2**20:8.3f} | {r['optimizer_bytes'] / 2**20:8.3f} | {total / 2**20:8.3f} | "
            f"{r['exact_bytes'] / 2**20:8.3f} | {ratio:11.4f} | {outside}"
        )
    worst = max(per_rank, key=lambda r: r["total_bytes"])
    worst_ratio = max(r["ratio_exact"] for r in per_rank)
    lines.append(
        f"full model state {full_state / 2**20:.2f} MB (parameters {full_params / 2**20:.2f} MB, each once); naive "
        f"share full/(tp*pp) = {naive / 2**20:.2f} MB; worst rank {worst['total_bytes'] / 2**20:.2f} MB = "
        f"{worst['total_bytes'] / naive:.3f} x naive share, {worst['ratio_exact']:.4f} x its exact share"
    )
    details = {
        "model": model,
        "config": res["config"],
        "ranks": per_rank,
        "full_state_bytes": full_state,
        "full_param_bytes": full_params,
        "naive_share_bytes": naive,
        "worst_rank_over_naive": worst["total_bytes"] / naive,
        "layout": "dp2 x pp2 x tp2 on 8 processes (counting only), AdamW, after the first optimizer step",
    }
    return Record(
        f"{ID}_{model}",
        f"{TITLE} ({model})",
        worst["total_bytes"] / 2**20,
        full_state / 2**20,
        worst["exact_bytes"] / 2**20,
        worst_ratio,
        "MB (worst rank)",
        details,
        lines,
        "MB (full model state)",
    )
