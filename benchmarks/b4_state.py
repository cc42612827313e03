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
"""

from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import Any

from .common import Record

ID, TITLE = "B4", "state bytes per rank (params + grads + AdamW) at dp2 x pp2 x tp2, and peak RSS"
TP, PP, DEVICES = 2, 2, 8


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(tiny: bool = False, steps: int = 1, n_embd: int | None = None) -> dict[str, Any]:
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
    fit_3d(config, counter, tp=TP, pp=PP, micro_batches=2, batch=2, steps=steps, devices=DEVICES)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counter.record)
    return {"ranks": gathered}


def run(out: Path, tiny: bool = False) -> Record:
    """Launch the eight processes and build the record."""
    from .common import launch

    res = launch("b4_state:worker", DEVICES, {"tiny": tiny}, timeout=240)
    # RSS of a model big enough to see: hidden 1024 (4x the benchmark GPT's width), built, not trained; once with
    # glibc's default (dynamic) mmap threshold, once with a fixed one, which returns freed buffers to the system
    big_hidden = 1024
    probes: dict[str, list[dict[str, Any]]] = {}
    if not tiny:
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
    probe: dict[str, Any] = {"skipped": "--tiny"} if tiny else {"n_embd": big_hidden}
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
    }
    return Record(
        ID,
        TITLE,
        worst["total_bytes"] / 2**20,
        full_state / 2**20,
        worst["exact_bytes"] / 2**20,
        worst_ratio,
        "MB (worst rank)",
        details,
        lines,
        "MB (full model state)",
    )
