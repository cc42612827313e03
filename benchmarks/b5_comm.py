"""B5 communication audit of one training step of dp2 x pp2 x tp2 against the formulas of benchmarks.md.

Eight processes (counting only). ``Trainer.fit`` of the benchmark GPT with ``ThreeDStrategy(tp=2, pp=2)``,
4 micro-batches of 2 sequences per replica. The second step (the first exchanges shapes) runs under a
``TorchDispatchMode`` that sees every collective and point-to-point operation of the ``c10d`` and
``_c10d_functional`` namespaces: ``dist.send``/``recv`` of the pipeline, ``dist.all_reduce`` of data parallelism,
and the functional collectives DTensor issues for tensor parallelism, in forward and in backward. Each call is
attributed to its process group (resolved to the mesh dimension dp, pp or tp), to the body layer running at
the time (forward hooks and full backward hooks on the body's layers), to forward or backward, and to inside
or outside the pipeline schedule (seen by an observer of the strategy's pipeline runtime). Elements are counted
on the input tensors.

Formulas (b = sequences per micro-batch, s = sequence, h = hidden, m = micro-batches, per (dp, tp) slice):

* pipeline p2p per step and boundary: ``2 m b s h`` elements in ``2 m`` calls;
* TP per transformer layer per micro-batch: 2 all-reduces of ``b s h`` in forward and 2 in backward;
* DDP: one all-reduce per gradient bucket per step, together the stage's local gradient elements (an independent
  count). Buckets follow ``data_parallel.per_block_buckets``: on gloo (this benchmark) one per stage; on NCCL each
  layer the stage holds is a bucket (for the Llama, each decoder layer, plus the rest of the stage).

``--grad-reduce-dtype bf16`` (or ``fp16``, record ``B5_grad_bf16``): the same step with ``grad_reduce_dtype`` set,
once with ``data_parallel="replicate"`` and once with ``"fsdp"``, counting the data-parallel gradient reduction
in bytes: replicate's all-reduces and FSDP's reduce-scatters must carry exactly ``2 x`` the stage's local gradient
elements (the count the default run checks in elements, fp32: ``4 x``), i.e. half the default's bytes; FSDP's
parameter all-gathers stay fp32 (``4 x elements / dp``, one per unit per step under a pipeline).

Every measured/formula ratio is reported as it is. The embedding and LM head's TP collectives (outside the
transformer layers) get their own lines, and so does traffic outside the schedule (the log relay).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .common import Record
from .hf_llama import MODEL_NAMES

ID, TITLE = "B5", "communication audit of one dp2 x pp2 x tp2 step vs the formulas"
TP, PP, DEVICES = 2, 2, 8
MODELS: tuple[str, ...] = ("gpt", *MODEL_NAMES)
"""The models this benchmark runs on (``--model``)."""
_SKIP = {"wait_tensor", "_wrap_tensor_autograd"}


def _class_name(module: Any) -> str:
    """The module's own class name (``Block``), not the ``ReplicateBlock`` class ``replicate`` gives a bucket."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _counter_mode() -> Any:
    """A dispatch mode class that records communication ops (built lazily: torch imports inside)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_3d.core.torch_compat import TorchDispatchMode, in_backward, op_name

    class CommCounter(TorchDispatchMode):
        def __init__(self, group_dims: dict[str, str], rank_dims: dict[tuple[int, ...], str] | None = None) -> None:
            super().__init__()
            self.group_dims = group_dims
            self.rank_dims = rank_dims or {}  # groups outside the mesh, known by their ranks (embedding groups)
            self.records: list[dict[str, Any]] = []
            self.layer: str | None = None
            self.in_schedule = False

        def _group(self, args: tuple[Any, ...]) -> str:
            for a in args:
                if isinstance(a, str) and a in self.group_dims:
                    return self.group_dims[a]
                if isinstance(a, torch.ScriptObject):
                    try:
                        group = dist.ProcessGroup.unbox(a)
                    except Exception:
                        continue
                    if group.group_name in self.group_dims:
                        return self.group_dims[group.group_name]
                    try:
                        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
                    except Exception:
                        return "other"
                    return self.rank_dims.get(ranks, "other")
            return "other"

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run; its collectives come back here on plain tensors
            ns = func.namespace
            name = op_name(func)
            if ns in ("c10d", "_c10d_functional", "c10d_functional") and name not in _SKIP:
                tensors = _input_tensors(name, args)
                self.records.append(
                    {
                        "op": name.rstrip("_"),
                        "dim": self._group(args),
                        "elements": sum(t.numel() for t in tensors),
                        "bytes": sum(t.numel() * t.element_size() for t in tensors),
                        "shape": [list(t.shape) for t in tensors],
                        "layer": self.layer,
                        "phase": "bwd" if in_backward() else "fwd",
                        "in_schedule": self.in_schedule,
                    }
                )
            return func(*args, **kwargs)

    return CommCounter


class _InSchedule:
    """A runtime observer: marks the counter's records made while the pipeline schedule runs."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode

    def before_batch(self, schedule: Any, train: bool) -> None:
        self.mode.in_schedule = True

    def after_batch(self, schedule: Any, train: bool) -> None:
        self.mode.in_schedule = False


def _input_tensors(name: str, args: tuple[Any, ...]) -> list[Any]:
    """The tensors an op sends or reduces (for all-gathers: the input, not the gathered output)."""
    import torch

    if name.startswith("allgather") or name in ("_allgather_base_", "_reduce_scatter_base_"):
        # c10d.allgather_(output_lists, input_tensors, ...); FSDP's c10d._allgather_base_ / _reduce_scatter_base_
        # (output, input, ...): count the input
        candidates = args[1] if len(args) > 1 else []
    else:
        candidates = args[0] if args else []
    if isinstance(candidates, torch.Tensor):
        return [candidates]
    return [t for t in candidates if isinstance(t, torch.Tensor)]


def worker(
    tiny: bool, micro_batches: int, batch: int, data_parallel: str = "replicate", grad_reduce_dtype: str | None = None
) -> dict[str, Any]:
    """Runs on the 8 ranks: audits step 1; returns every rank's records and its local gradient counts
    (``data_parallel`` / ``grad_reduce_dtype``: the strategy's settings, for ``--grad-reduce-dtype``)."""
    import lightning as L
    import torch.distributed as dist

    from .common import fit_3d, gpt_local_numel, model_config, owned_parameters

    CommCounter = _counter_mode()
    InSchedule = _InSchedule

    class Audit(L.Callback):
        def __init__(self) -> None:
            self.mode: Any = None
            self.handles: list[Any] = []
            self.result: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != 1:
                return
            strategy = trainer.strategy
            mesh = strategy.device_mesh
            dims = {mesh[d].get_group().group_name: d for d in ("dp", "pp", "tp")}
            dims[dist.group.WORLD.group_name] = "world"
            mode = CommCounter(dims)
            for name, layer in strategy.body.module.named_children():
                label = f"{name}:{_class_name(layer)}"

                def enter(*_: Any, label: str = label) -> None:
                    mode.layer = label

                def leave(*_: Any) -> None:
                    mode.layer = None

                self.handles += [
                    layer.register_forward_pre_hook(enter),
                    layer.register_forward_hook(leave),
                    layer.register_full_backward_pre_hook(enter),
                    layer.register_full_backward_hook(leave),
                ]
            self.runtime = strategy.runner.runtime
            self.observer = InSchedule(mode)
            self.runtime.add_observer(self.observer)
            self.mode = mode
            mode.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.mode is None:
                return
            self.mode.__exit__(None, None, None)
            for h in self.handles:
                h.remove()
            self.runtime.remove_observer(self.observer)
            strategy = trainer.strategy
            mesh = strategy.device_mesh
            coords, keep, owned = owned_parameters(strategy)
            self.result = {
                "rank": trainer.global_rank,
                "coords": coords,
                "peers": {d: [int(r) for r in mesh[d].mesh.tolist()] for d in ("dp", "pp", "tp")},
                "records": self.mode.records,
                "grad_elements_exact": sum(gpt_local_numel(n, shape, TP) for n, shape in owned.items()),
                "layers": list(keep),
                # FSDP pads each gradient's dim 0 to a multiple of dp: none when every dim 0 is a multiple of dp x tp
                "fsdp_unpadded": all(shape[0] % (dp * TP) == 0 for shape in owned.values()),
            }
            self.mode = None

    audit = Audit()
    config = model_config(tiny)
    dp = DEVICES // (TP * PP)
    settings: dict[str, Any] = {}  # the default run passes none (unchanged)
    if grad_reduce_dtype is not None or data_parallel != "replicate":
        settings = {"data_parallel": data_parallel, "grad_reduce_dtype": grad_reduce_dtype}
    fit_3d(config, audit, tp=TP, pp=PP, micro_batches=micro_batches, batch=batch, steps=2, devices=DEVICES, **settings)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, audit.result)
    return {"ranks": gathered, "config": config}


REDUCE_BYTES = {None: 4, "bf16": 2, "fp16": 2}
"""Bytes per gradient element on the data-parallel wire, by ``grad_reduce_dtype`` (``None``: fp32)."""


def _bare(op: str) -> str:
    """An op name without underscores (``_reduce_scatter_base`` -> ``reducescatterbase``)."""
    return op.replace("_", "")


def _check_grad_reduction(
    ranks: list[dict[str, Any]], check: Any, data_parallel: str, grad_reduce_dtype: str | None
) -> None:
    """The data-parallel gradient reduction in bytes (``--grad-reduce-dtype``): replicate's all-reduces or FSDP's
    reduce-scatters (and its fp32 parameter all-gathers) against the exact local gradient elements."""
    size = REDUCE_BYTES[grad_reduce_dtype]
    name = grad_reduce_dtype or "fp32"
    dp = DEVICES // (TP * PP)
    op = "allreduce" if data_parallel == "replicate" else "reducescatter"  # c10d.allreduce_, _reduce_scatter_base_
    label = "DDP all-reduce" if data_parallel == "replicate" else "FSDP reduce-scatter"
    for r in ranks:
        recs = [x for x in r["records"] if x["dim"] == "dp" and x["in_schedule"]]
        reduce = [x for x in recs if _bare(x["op"]).startswith(op)]
        elements = r["grad_elements_exact"]
        if data_parallel == "fsdp":
            assert r["fsdp_unpadded"], "a dim 0 not a multiple of dp x tp: FSDP pads it, the formula would not hold"
        from lightning_3d.core.data_parallel import per_block_buckets

        # FSDP: one unit per layer held; replicate: its buckets (data_parallel.per_block_buckets: one per stage on gloo)
        calls = len(r["layers"]) if data_parallel == "fsdp" or per_block_buckets("gloo") else 1
        check(f"{label} calls per step", len(reduce), calls, "one per unit or bucket, per optimizer step")
        check(f"{label} elements per step", sum(x["elements"] for x in reduce), elements, "local gradients")
        measured = sum(x["bytes"] for x in reduce)
        check(f"{label} bytes per step ({name})", measured, size * elements, f"{size} B x local gradient elements")
        check(
            f"{label} bytes / the default's fp32 bytes",
            measured / (4 * elements),
            size / 4,
            "the default run reduces the same elements in fp32 (4 B each)",
        )
        if data_parallel == "fsdp":
            gathers = [x for x in recs if _bare(x["op"]).startswith("allgather")]
            check("FSDP all-gather calls per step", len(gathers), len(r["layers"]), "one per unit (no reshard, pp > 1)")
            check(
                "FSDP all-gather bytes per step (fp32 parameters)",
                sum(x["bytes"] for x in gathers),
                4 * elements // dp,
                "4 B x the rank's shard (local elements / dp); not compressed",
            )
        other = [x["op"] for x in recs if x not in reduce and not _bare(x["op"]).startswith("allgather")]
        check("other data-parallel collectives per step", len(other), 0, f"none expected: {other[:3]}")


def analyse(
    res: dict[str, Any], m: int, batch: int, data_parallel: str = "replicate", grad_reduce_dtype: str | None = None
) -> dict[str, Any]:
    """Compare the records with the formulas; returns the checks (measured, formula, ratio) and notes."""
    from .common import hidden, seq_len, vocab

    config = res["config"]
    b, s, h, v = batch // m, seq_len(config), hidden(config), vocab(config)
    bsh = b * s * h
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, measured: float, formula: float, note: str = "") -> None:
        prev = checks.get(name)
        ratio = _ratio(measured, formula)
        if prev is None or abs(ratio - 1) > abs(prev["ratio"] - 1):  # keep the worst case over ranks
            checks[name] = {"measured": measured, "formula": formula, "ratio": ratio, "note": note}

    # pipeline p2p per boundary and (dp, tp) slice: both directions
    sent = defaultdict(lambda: [0, 0])  # (dp, tp) -> [elements, calls]
    for r in ranks:
        for rec in r["records"]:
            if rec["dim"] == "pp" and rec["op"] == "send" and rec["in_schedule"]:
                key = (r["coords"]["dp"], r["coords"]["tp"])
                sent[key][0] += rec["elements"]
                sent[key][1] += 1
    for _, (elements, calls) in sorted(sent.items()):
        check("p2p elements per boundary", elements, 2 * m * bsh, "2 m b s h (activations forward, gradients back)")
        check("p2p calls per boundary", calls, 2 * m, "m sends each way")
    # tensor parallel, per transformer layer and micro-batch
    per_layer: dict[tuple[int, str, str], list[dict[str, Any]]] = defaultdict(list)
    other_tp: dict[tuple[int, str, str, str], list[int]] = defaultdict(list)
    for r in ranks:
        for rec in r["records"]:
            if rec["dim"] != "tp" or not rec["in_schedule"]:
                continue
            layer = rec["layer"] or "none"
            if layer.endswith(":Block"):
                per_layer[r["rank"], layer, rec["phase"]].append(rec)
            else:
                other_tp[r["rank"], layer.split(":")[-1], rec["phase"], rec["op"]].append(rec["elements"])
    for (_, _, phase), recs in sorted(per_layer.items()):
        ar = [x for x in recs if x["op"] == "all_reduce"]
        check(f"TP all-reduces per layer per micro-batch ({phase})", len(ar) / m, 2, "Megatron: 2 forward, 2 backward")
        check(f"TP all-reduce elements ({phase})", sum(x["elements"] for x in ar) / len(ar), bsh, "b s h each")
    for rank in sorted({key[0] for key in other_tp}):
        embed = [x for (rk, layer, _, _), xs in other_tp.items() if rk == rank and layer == "Embedding" for x in xs]
        if embed:
            check("TP embedding all-reduces per micro-batch (fwd)", len(embed) / m, 2, "wte and wpe vocab-parallel")
            check(
                "TP embedding all-reduce elements per micro-batch", sum(embed) / m, bsh + s * h, "wte b s h + wpe s h"
            )
        head_fwd = other_tp.get((rank, "Head", "fwd", "all_gather_into_tensor"), [])
        head_bwd = other_tp.get((rank, "Head", "bwd", "all_reduce"), [])
        if head_fwd or head_bwd:
            check("TP head all-gathers per micro-batch (fwd)", len(head_fwd) / m, 1, "lm_head colwise, output gathered")
            check(
                "TP head all-gather input elements", sum(head_fwd) / max(1, len(head_fwd)), b * s * v // TP, "b s V/tp"
            )
            check("TP head all-reduces per micro-batch (bwd)", len(head_bwd) / m, 1, "input gradient of lm_head")
    if grad_reduce_dtype is not None or data_parallel != "replicate":
        _check_grad_reduction(ranks, check, data_parallel, grad_reduce_dtype)
    else:
        # data parallel: one all-reduce per gradient bucket per step (data_parallel.per_block_buckets: a replicate group
        # per body layer held on NCCL, one per stage on gloo, which B5 runs on)
        from lightning_3d.core.data_parallel import per_block_buckets

        per_block = per_block_buckets("gloo")
        for r in ranks:
            ddp = [x for x in r["records"] if x["dim"] == "dp" and x["in_schedule"]]
            check(
                "DDP all-reduce calls per step",
                len(ddp),
                len(r["layers"]) if per_block else 1,
                "one per layer held (its own bucket) on NCCL, one per stage on gloo; per optimizer step, not per "
                "micro-batch",
            )
            check(
                "DDP all-reduce elements", sum(x["elements"] for x in ddp), r["grad_elements_exact"], "local gradients"
            )
    unexplained = [
        (r["rank"], x["dim"], x["op"], x["phase"], x["layer"])
        for r in ranks
        for x in r["records"]
        if x["in_schedule"]
        and not (x["dim"] in ("pp", "dp") or (x["dim"] == "tp" and x["op"] in ("all_reduce", "all_gather_into_tensor")))
    ]
    outside: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in ranks:
        for x in r["records"]:
            if not x["in_schedule"]:
                key = f"{x['dim']} {x['op']}"
                outside[key][0] += 1
                outside[key][1] += x["bytes"]
    return {
        "checks": checks,
        "unexplained_in_schedule": unexplained,
        "outside_schedule_all_ranks": {k: {"calls": c, "bytes": nb} for k, (c, nb) in outside.items()},
        "sizes": {"b": b, "s": s, "h": h, "vocab": v, "m": m},
    }


def _checks_record(record_id: str, title: str, checks: dict[str, Any], details: dict, lines: list[str]) -> Record:
    """A B5 record of exact checks: each check's measured value against its formula (ideal ratio 1.0)."""
    return Record(
        record_id,
        title,
        {k: c["measured"] for k, c in checks.items()},
        {k: c["formula"] for k, c in checks.items()},
        1.0,
        {k: round(c["ratio"], 4) for k, c in checks.items()},
        "",
        details,
        lines,
    )


def run(out: Path, tiny: bool = False, model: str = "gpt", grad_reduce_dtype: str | None = None) -> Record:
    """Launch the eight processes, check the formulas, build the record (``grad_reduce_dtype``: see the module
    text; record ``B5_grad_<dtype>``)."""
    from .common import launch

    if model != "gpt":
        return run_llama(out, tiny, model)
    if grad_reduce_dtype is not None:
        return run_grad_reduce(out, tiny, grad_reduce_dtype)

    m, batch = (2, 4) if tiny else (4, 8)
    res = launch("b5_comm:worker", DEVICES, {"tiny": tiny, "micro_batches": m, "batch": batch}, timeout=300)
    result = analyse(res, m, batch)
    checks = result["checks"]
    sz = result["sizes"]
    lines = [
        f"b={sz['b']} sequences per micro-batch, s={sz['s']}, h={sz['h']}, m={m}; worst rank shown per check",
        "check | measured | formula | ratio",
    ]
    for name, c in checks.items():
        flag = "" if abs(c["ratio"] - 1) < 5e-4 else "   <-- not 1.000"
        lines.append(f"{name}: {c['measured']:g} | {c['formula']:g} | {c['ratio']:.3f}{flag}  ({c['note']})")
    if result["unexplained_in_schedule"]:
        lines.append(f"unexplained collectives inside the schedule: {result['unexplained_in_schedule'][:5]}")
    lines.append(
        "outside the schedule, all 8 ranks together (the log relay of train_loss; a world all-reduce of a few "
        "flags when the strategy checks for NaN/inf): "
        + ", ".join(
            f"{k}: {v['calls']} calls / {v['bytes']} B" for k, v in result["outside_schedule_all_ranks"].items()
        )
    )
    formula_checks = {k: c for k, c in checks.items() if "one per column-parallel" not in k}
    off = {k: round(c["ratio"], 3) for k, c in formula_checks.items() if abs(c["ratio"] - 1) >= 5e-4}
    if off:
        lines.append(
            "why the backward TP count is twice Megatron's: the GPT keeps q_proj, k_proj and v_proj as three "
            "ColwiseParallel linears, and each one turns the replicated input into a DTensor on its own, so "
            "backward all-reduces three partial input gradients (plus fc's) instead of summing them first and "
            "all-reducing once (Megatron fuses qkv behind one 'f' operator). Fix in the plan: one "
            "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False) "
            "on attn so q/k/v share one DTensor input (saves 2 all-reduces of b s h per layer and micro-batch; "
            "checked on one Block at tp=2: 4 collectives per layer instead of 6, the same outputs and input "
            "gradients)."
        )
    details = {**result, "layout": "dp2 x pp2 x tp2 on 8 processes, step 1 (after the shape exchange)"}
    return _checks_record(ID, TITLE, checks, details, lines)


def run_grad_reduce(out: Path, tiny: bool, grad_reduce_dtype: str) -> Record:
    """B5 ``--grad-reduce-dtype``: the data-parallel gradient bytes of one step under ``replicate`` and under
    ``fsdp`` with that reduce dtype, against the exact formula (``B5_grad_<dtype>``)."""
    from .common import launch

    if grad_reduce_dtype not in REDUCE_BYTES or grad_reduce_dtype is None:
        raise ValueError(f"--grad-reduce-dtype: bf16 or fp16, got {grad_reduce_dtype!r}")
    m, batch = (2, 4) if tiny else (4, 8)
    checks: dict[str, dict[str, Any]] = {}
    details: dict[str, Any] = {
        "layout": "dp2 x pp2 x tp2 on 8 processes, step 1",
        "grad_reduce_dtype": grad_reduce_dtype,
    }
    lines = [f"grad_reduce_dtype={grad_reduce_dtype}: data-parallel gradient bytes of one step; worst rank per check"]
    for mode in ("replicate", "fsdp"):
        args = {"tiny": tiny, "micro_batches": m, "batch": batch, "data_parallel": mode}
        res = launch("b5_comm:worker", DEVICES, {**args, "grad_reduce_dtype": grad_reduce_dtype}, timeout=300)
        result = analyse(res, m, batch, mode, grad_reduce_dtype)
        details[mode] = result
        lines.append(f"-- data_parallel={mode}: check | measured | formula | ratio")
        for name, c in result["checks"].items():
            flag = "" if abs(c["ratio"] - 1) < 5e-4 else "   <-- not 1.000"
            lines.append(f"{name}: {c['measured']:g} | {c['formula']:g} | {c['ratio']:.4f}{flag}  ({c['note']})")
            checks[f"{mode}: {name}"] = c
    title = f"{TITLE}: gradient reduction in {grad_reduce_dtype} (replicate, fsdp)"
    return _checks_record(f"{ID}_grad_{grad_reduce_dtype}", title, checks, details, lines)


# ---------------------------------------------------------------------- the Hugging Face Llama (--model hf_llama)
LLAMA_OUTSIDE: tuple[str, ...] = ("model.model.embed_tokens", "model.model.norm", "model.lm_head")
"""The Llama's modules outside its block container, by their names in the LightningModule."""


def _label_hooks(mode: Any, modules: list[tuple[str, Any]], prepend: bool) -> list[Any]:
    """Hooks that set ``mode.layer`` to a module's label while its forward runs and when autograd reaches its
    output's gradient (its backward starts there).

    Full backward hooks cannot do the second part on a split model: the stage's last block ends its stage's
    forward by raising from a forward hook, before ``nn.Module`` would wrap the output for backward hooks; a
    tensor hook on the output, added by a forward hook that runs first (``prepend``), sees it.
    """
    import torch

    def enter_fn(label: str) -> Any:
        def enter(*_: Any) -> None:
            mode.layer = label

        return enter

    def mark_fn(label: str) -> Any:
        def mark(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: setattr(mode, "layer", label))

        return mark

    handles = []
    for label, module in modules:
        handles.append(module.register_forward_pre_hook(enter_fn(label)))
        handles.append(module.register_forward_hook(mark_fn(label), prepend=prepend))
    return handles


def worker_llama(model: str, tiny: bool, micro_batches: int, batch: int) -> dict[str, Any]:
    """Runs on the 8 ranks with the Hugging Face Llama: audits step 1; returns every rank's records and its
    independently counted local gradient and tied-weight elements."""
    import lightning as L
    import torch.distributed as dist

    from lightning_3d.core.stand_ins import Elsewhere, Skipped

    from .common import fit_3d
    from .hf_llama import (
        build_llama,
        llama_config,
        llama_local_numel,
        owned_llama,
        reference_parameters,
        tied_local_numel,
    )

    config = llama_config(model, tiny)
    reference = reference_parameters(config)
    n_layers = int(config["num_hidden_layers"])
    CommCounter = _counter_mode()

    class Audit(L.Callback):
        def __init__(self) -> None:
            self.mode: Any = None
            self.handles: list[Any] = []
            self.result: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != 1:
                return
            strategy = trainer.strategy
            mesh = strategy.device_mesh
            dims = {mesh[d].get_group().group_name: d for d in ("dp", "pp", "tp")}
            dims[dist.group.WORLD.group_name] = "world"
            grid = mesh.mesh  # (dp, pp, tp) global ranks; an embedding group: first and last stage of a pipeline
            emb = {
                tuple(sorted((int(grid[d, 0, t]), int(grid[d, PP - 1, t])))): "emb"
                for d in range(grid.shape[0])
                for t in range(grid.shape[2])
            }
            mode = CommCounter(dims, emb)
            real = lambda mod: not isinstance(mod, (Elsewhere, Skipped))  # noqa: E731
            blocks = [(f"{n}:{_class_name(b)}", b) for n, b in strategy.body.module.named_children() if real(b)]
            outside = [(n, pl_module.get_submodule(n)) for n in LLAMA_OUTSIDE]
            outside = [(f"{n.rpartition('.')[2]}:{_class_name(m)}", m) for n, m in outside if real(m)]
            self.handles = _label_hooks(mode, blocks, prepend=True) + _label_hooks(mode, outside, prepend=False)
            self.runtime = strategy.runner.runtime
            self.observer = _InSchedule(mode)
            self.runtime.add_observer(self.observer)
            self.mode = mode
            mode.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.mode is None:
                return
            self.mode.__exit__(None, None, None)
            for h in self.handles:
                h.remove()
            self.runtime.remove_observer(self.observer)
            mesh = trainer.strategy.device_mesh
            coords = {d: mesh[d].get_local_rank() for d in ("dp", "pp", "tp")}
            stage = coords["pp"]
            owned = owned_llama(reference, n_layers, PP, stage)
            self.result = {
                "rank": trainer.global_rank,
                "coords": coords,
                "records": self.mode.records,
                "grad_elements_exact": sum(llama_local_numel(n, shape, TP) for n, shape in owned.items()),
                "tied_elements_exact": tied_local_numel(reference, TP, stage, PP, config["tie_word_embeddings"]),
                "layers": sum(1 for n in owned if n.endswith("input_layernorm.weight")),
                "first": stage == 0,
                "last": stage == PP - 1,
            }
            self.mode = None

    audit = Audit()
    module = build_llama(config, build=False)
    fit_3d(
        config, audit, tp=TP, pp=PP, micro_batches=micro_batches, batch=batch, steps=2, devices=DEVICES, module=module
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, audit.result)
    return {"ranks": gathered, "config": config}


def _ratio(measured: float, formula: float) -> float:
    if measured == formula:
        return 1.0  # also 0 == 0: "none expected, none seen"
    return measured / formula if formula else float("inf")


def analyse_llama(res: dict[str, Any], m: int, batch: int) -> dict[str, Any]:
    """Compare the Llama records with :func:`benchmarks.hf_llama.llama_comm_formulas` and the p2p, DDP and
    tied-embedding formulas; returns the checks (measured, formula, ratio; the worst rank's), the unexplained
    collectives and the traffic outside the schedule."""
    from lightning_3d.core.data_parallel import per_block_buckets

    per_block = per_block_buckets("gloo")  # the gradient buckets on gloo, which B5 runs on
    from .hf_llama import llama_comm_formulas, llama_sizes

    config = res["config"]
    sz = llama_sizes(config)
    b, s, h, v = batch // m, sz["s"], sz["h"], sz["v"]
    bsh = b * s * h
    tied = bool(config.get("tie_word_embeddings"))
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, measured: float, formula: float, note: str = "") -> None:
        prev = checks.get(name)
        ratio = _ratio(measured, formula)
        if prev is None or abs(ratio - 1) > abs(prev["ratio"] - 1):  # keep the worst case over ranks
            checks[name] = {"measured": measured, "formula": formula, "ratio": ratio, "note": note}

    # pipeline p2p per boundary and (dp, tp) slice: both directions
    sent: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for r in ranks:
        for rec in r["records"]:
            if rec["dim"] == "pp" and rec["op"] == "send" and rec["in_schedule"]:
                key = (r["coords"]["dp"], r["coords"]["tp"])
                sent[key][0] += rec["elements"]
                sent[key][1] += 1
    for elements, calls in sent.values():
        check("p2p elements per boundary", elements, 2 * m * bsh, "2 m b s h (hidden states forward, gradients back)")
        check("p2p calls per boundary", calls, 2 * m, "m sends each way")
    for r in ranks:
        where = "first" if r["first"] else "last"
        f = llama_comm_formulas(b=b, s=s, h=h, v=v, tp=TP, m=m, layers=r["layers"], first=r["first"], last=r["last"])
        tp_recs = [x for x in r["records"] if x["dim"] == "tp" and x["in_schedule"]]

        def pick(recs: list[dict[str, Any]], op: str, phase: str) -> list[dict[str, Any]]:
            return [x for x in recs if x["op"] == op and x["phase"] == phase]

        # the whole stage's step (robust: needs no attribution to layers)
        for op, phase, key, note in (
            ("all_reduce", "fwd", "tp_fwd_all_reduce", "m (2 L_stage + 1 embedding on the first stage)"),
            ("all_reduce", "bwd", "tp_bwd_all_reduce", "m (2 L_stage + 1 LM head input gradient on the last stage)"),
            ("all_gather_into_tensor", "fwd", "tp_fwd_all_gather", "m on the last stage (LM head logits b s V/tp)"),
        ):
            recs = pick(tp_recs, op, phase)
            label = op.replace("_into_tensor", "").replace("_", "-")
            check(f"TP {label}s per step, {where} stage ({phase})", len(recs), f[f"{key}_calls"], note)
            check(
                f"TP {label} elements per step, {where} stage ({phase})",
                sum(x["elements"] for x in recs),
                f[f"{key}_elements"],
                "calls x (b s h, or b s V/tp for the head)",
            )
        known = {("all_reduce", "fwd"), ("all_reduce", "bwd"), ("all_gather_into_tensor", "fwd")}
        other = [x for x in tp_recs if (x["op"], x["phase"]) not in known]
        check(f"other TP collectives per step, {where} stage", len(other), 0, "none in the plan")
        # per transformer layer, per module outside the blocks
        by_label: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for x in tp_recs:
            by_label[x["layer"] or "none", x["phase"]].append(x)
        layers = sorted({lab for lab, _ in by_label if lab.endswith(":LlamaDecoderLayer")})
        for lab in layers:
            for phase in ("fwd", "bwd"):
                ar = pick(by_label[lab, phase], "all_reduce", phase)
                check(
                    f"TP all-reduces per layer per micro-batch ({phase})",
                    len(ar) / m,
                    f[f"layer_{phase}_all_reduces_per_micro_batch"],
                    "o_proj + down_proj / q|k|v + gate|up inputs",
                )
                check(
                    f"TP all-reduce elements per call, layers ({phase})",
                    sum(x["elements"] for x in ar) / max(1, len(ar)),
                    bsh,
                    "b s h each",
                )
        if r["first"]:
            fwd = by_label["embed_tokens:Embedding", "fwd"]
            check(
                "TP embedding all-reduces per micro-batch (fwd)",
                len(pick(fwd, "all_reduce", "fwd")) / m,
                1,
                "vocabulary-parallel embed_tokens",
            )
            check(
                "TP embedding all-reduce elements per call",
                sum(x["elements"] for x in fwd) / max(1, len(fwd)),
                bsh,
                "b s h",
            )
            check(
                "TP embedding collectives (bwd)",
                len(by_label["embed_tokens:Embedding", "bwd"]),
                0,
                "token ids have no gradient",
            )
        if r["last"]:
            fwd, bwd = by_label["lm_head:Linear", "fwd"], by_label["lm_head:Linear", "bwd"]
            gathers = pick(fwd, "all_gather_into_tensor", "fwd")
            check("TP head all-gathers per micro-batch (fwd)", len(gathers) / m, 1, "colwise_gather_output")
            check(
                "TP head all-gather input elements",
                sum(x["elements"] for x in gathers) / max(1, len(gathers)),
                b * s * v // TP,
                "b s V/tp",
            )
            check(
                "TP head all-reduces per micro-batch (bwd)",
                len(pick(bwd, "all_reduce", "bwd")) / m,
                1,
                "input gradient of lm_head",
            )
            norm = by_label["norm:LlamaRMSNorm", "fwd"] + by_label["norm:LlamaRMSNorm", "bwd"]
            check("TP final norm collectives", len(norm), 0, "RMSNorm replicated")
        # data parallel: one all-reduce per gradient bucket per step: each decoder layer held, and the stage root
        # (embedding on the first stage, final norm and head on the last) when it holds parameters
        ddp = [x for x in r["records"] if x["dim"] == "dp" and x["in_schedule"]]
        check(
            "DDP all-reduce calls per step",
            len(ddp),
            r["layers"] + int(r["first"] or r["last"]) if per_block else 1,
            "one per decoder layer held and one for the rest of the stage on NCCL, one per stage on gloo; per "
            "optimizer step, not per micro-batch",
        )
        check("DDP all-reduce elements", sum(x["elements"] for x in ddp), r["grad_elements_exact"], "local gradients")
        # the tied embedding / head: one all-reduce of the local shard per step over the embedding group
        embed = [x for x in r["records"] if x["dim"] == "emb"]
        check(
            "tied-weight all-reduces per step (embedding group)",
            len(embed),
            int(tied),
            "one per tied tensor per batch, in the strategy's backward (after the schedule)",
        )
        check(
            "tied-weight all-reduce elements per step",
            sum(x["elements"] for x in embed),
            r["tied_elements_exact"],
            "the local shard V/tp x h",
        )
        check(
            "tied-weight all-reduce bytes per step",
            sum(x["bytes"] for x in embed),
            4 * r["tied_elements_exact"],
            "fp32",
        )
    unexplained = [
        (r["rank"], x["dim"], x["op"], x["phase"], x["layer"])
        for r in ranks
        for x in r["records"]
        if x["in_schedule"]
        and not (
            x["dim"] in ("pp", "dp")
            or (x["dim"] == "tp" and x["op"] in ("all_reduce", "all_gather_into_tensor") and x["layer"] is not None)
        )
    ]
    outside: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in ranks:
        for x in r["records"]:
            if not x["in_schedule"]:
                key = f"{x['dim']} {x['op']}"
                outside[key][0] += 1
                outside[key][1] += x["bytes"]
    return {
        "checks": checks,
        "unexplained_in_schedule": unexplained,
        "outside_schedule_all_ranks": {k: {"calls": c, "bytes": nb} for k, (c, nb) in outside.items()},
        "sizes": {"b": b, "s": s, "h": h, "vocab": v, "m": m, "layers": sz["L"], "kv_heads": sz["kv_heads"]},
    }


def run_llama(out: Path, tiny: bool, model: str) -> Record:
    """B5 on the Hugging Face Llama: launch the eight processes, check the formulas, build ``B5_<model>``."""
    from .common import launch
    from .hf_llama import check_model

    m, batch = (2, 4) if tiny else (4, 8)
    args = {"model": check_model(model), "tiny": tiny, "micro_batches": m, "batch": batch}
    res = launch("b5_comm:worker_llama", DEVICES, args, timeout=300)
    result = analyse_llama(res, m, batch)
    checks, sz = result["checks"], result["sizes"]
    lines = [
        f"{model}: b={sz['b']} sequences per micro-batch, s={sz['s']}, h={sz['h']}, V={sz['vocab']}, m={m}, "
        f"{sz['layers']} layers ({sz['kv_heads']} kv heads); worst rank shown per check",
        "check | measured | formula | ratio",
    ]
    for name, c in checks.items():
        flag = "" if abs(c["ratio"] - 1) < 5e-4 else "   <-- not 1.000"
        lines.append(f"{name}: {c['measured']:g} | {c['formula']:g} | {c['ratio']:.3f}{flag}  ({c['note']})")
    if result["unexplained_in_schedule"]:
        lines.append(f"unexplained collectives inside the schedule: {result['unexplained_in_schedule'][:5]}")
    lines.append(
        "outside the schedule, all 8 ranks together (the log relay of train_loss: pp broadcast and dp all-gather; a "
        "world all-reduce of the NaN/inf flags; with tied weights the embedding-group all-reduce 'emb'): "
        + ", ".join(
            f"{k}: {v['calls']} calls / {v['bytes']} B" for k, v in result["outside_schedule_all_ranks"].items()
        )
    )
    details = {**result, "model": model, "layout": "dp2 x pp2 x tp2 on 8 processes, step 1 (after the shape exchange)"}
    return _checks_record(f"{ID}_{model}", f"{TITLE} ({model})", checks, details, lines)
