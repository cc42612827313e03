"""What the planner prints and writes: the ranked table, why the best few win, the first choice as
``ThreeDStrategy(...)`` arguments and as a training command, and the JSON list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .planner import Entry, Plan

PART_NAMES = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "tp_comm": "tensor-parallel all-reduces",
    "pp_comm": "pipeline sends",
    "dp_comm": "data-parallel gradient exchange",
    "optimizer": "optimizer step",
    "overhead": "step overhead",
    "shared_cores_wait": "waiting for a shared core",
}


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def table(plan: Plan, rows: int = 10) -> str:
    """The best ``rows`` entries as a text table."""
    shown = plan.entries[:rows]
    width = max([36, *(len(e.layout.short()) for e in shown)])  # the longest layout name keeps the columns aligned
    head = (
        f"{'#':>3}  {'layout':<{width}} {'mem GiB':>8} {'step':>10} {'tokens/s':>12} {'TFLOP/s/dev':>11} {'MFU':>6}"
        "  runs"
    )
    lines = [head, "-" * len(head)]
    for i, e in enumerate(shown, 1):
        lines.append(
            f"{i:>3}  {e.layout.short():<{width}} {e.memory.gib:>8.2f} {_fmt_s(e.step_s):>10} {e.tokens_per_s:>12,.0f} "
            f"{e.tflops_per_gpu:>11.3f} {e.mfu:>6.1%}  {'yes' if e.runnable else 'predicted only'}"
        )
    return "\n".join(lines)


def _differences(a: Entry, b: Entry) -> str:
    da, db = a.layout.as_dict(), b.layout.as_dict()
    # stages per rank follows the schedule, except for interleaved zero-bubble (one or two)
    same_schedule = da["schedule"] == db["schedule"]
    diffs = [f"{k} {da[k]} vs {db[k]}" for k in da if da[k] != db[k] and (k != "stages_per_rank" or same_schedule)]
    return ", ".join(diffs) or "same layout"


def reason(a: Entry, b: Entry) -> str:
    """Why ``a`` is predicted faster than ``b``: the layout differences and the parts of the step that differ most."""
    pa, pb = a.time.as_dict(), b.time.as_dict()
    deltas = sorted(((pb[k] - pa[k], k) for k in PART_NAMES), reverse=True)
    gains = [f"{PART_NAMES[k]} {_fmt_s(d)} less" for d, k in deltas if d > 0.01 * pb["total"]][:2]
    losses = [f"{PART_NAMES[k]} {_fmt_s(-d)} more" for d, k in reversed(deltas) if -d > 0.01 * pb["total"]][:1]
    gap = b.step_s / a.step_s - 1
    why = "; ".join(gains + losses) or "within noise of each other"
    return f"{gap:+.1%} faster than the next ({_differences(a, b)}): {why}"


def reasons(plan: Plan, count: int = 3) -> list[str]:
    """One line per entry among the best ``count``: why it beats the one after it."""
    return [
        f"#{i + 1} {plan.entries[i].layout.short()}: {reason(plan.entries[i], plan.entries[i + 1])}"
        for i in range(min(count, len(plan.entries) - 1))
    ]


def strategy_kwargs(entry: Entry) -> dict[str, Any]:
    """``ThreeDStrategy`` arguments of an entry (the settings it has; the others named in ``unsupported``)."""
    lay = entry.layout
    kwargs: dict[str, Any] = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batches": lay.micro_batches}
    if lay.pp > 1:
        kwargs["schedule"] = lay.schedule
        if lay.stages_per_rank > 1:
            kwargs["stages_per_rank"] = lay.stages_per_rank
    if lay.data_parallel != "replicate":
        kwargs["data_parallel"] = lay.data_parallel
    if lay.activation_checkpointing != "none":
        kwargs["activation_checkpointing"] = lay.activation_checkpointing
    return kwargs


def strategy_call(entry: Entry) -> str:
    return "ThreeDStrategy(" + ", ".join(f"{k}={v!r}" for k, v in strategy_kwargs(entry).items()) + ")"


def command_line(entry: Entry, model_overrides: list[str], accelerator: str, gpus_per_node: int, nodes: int) -> str:
    """The ``python -m lightning_3d.train`` command that trains with ``entry``'s layout."""
    args = [f"strategy.{k}={v}" for k, v in strategy_kwargs(entry).items()]
    args.append(f"data.batch_size={entry.layout.replica_batch}")
    if accelerator == "cpu":
        args.append(f"trainer.devices={gpus_per_node * nodes}")
    else:
        args += ["trainer=gpu", f"trainer.devices={gpus_per_node}", f"trainer.num_nodes={nodes}"]
    prefix = "torchrun --nproc-per-node " + str(gpus_per_node) + " -m" if accelerator != "cpu" else "python -m"
    return " ".join([prefix, "lightning_3d.train", *model_overrides, *args])


def write_json(plan: Plan, path: str | Path) -> Path:
    """The ranked list, best first, as JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([e.as_dict() for e in plan.entries], indent=1))
    return out


def summary(plan: Plan) -> str:
    """Header lines: the model, the cluster, how many layouts."""
    c = plan.cluster
    return "\n".join(
        [
            f"model   {plan.model.describe()}",
            f"cluster {c.name}: {c.nodes} x {c.gpus_per_node} devices, {c.peak_flops / 1e12:g} TFLOP/s peak, "
            f"{c.memory_gib:g} GiB, {c.intra_bw_gbs:g} GB/s in a node, {c.inter_bw_gbs:g} GB/s between nodes",
            f"global batch {plan.global_batch} samples x {plan.model.seq_len} tokens; {plan.considered} layouts "
            f"considered, {plan.too_big} do not fit in memory, {len(plan.entries)} ranked",
        ]
    )
