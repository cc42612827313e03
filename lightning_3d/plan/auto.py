"""``strategy=auto`` in ``python -m lightning_3d.train``: the planner's first runnable choice for the job.

The training config's ``strategy`` node carries the usual ``ThreeDStrategy`` settings plus ``auto: true``,
``cluster`` (null: ``cpu8`` for CPU trainers, ``h100_80g`` for GPUs) and ``global_batch_size``; :func:`resolve_auto`
replaces the layout settings (tp, pp, dp, micro_batches, schedule, stages_per_rank) with the plan's, sets
``data.batch_size`` to the per-replica batch and drops the planner's keys, so the rest of the app sees a plain
``strategy=3d`` config.
"""

from __future__ import annotations

from typing import Any

from .cluster import load_cluster
from .layouts import Search
from .model import model_from_config
from .planner import plan
from .report import strategy_kwargs

AUTO_KEYS = ("auto", "cluster", "global_batch_size")


def resolve_auto(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The training config with ``strategy`` set to the planner's first runnable choice, and a line saying so.

    Args:
        cfg: the resolved training config as a plain dict (``strategy``, ``model``, ``data``, ``trainer``).

    Returns:
        ``(new config, message)``; the config unchanged (and ``""``) when ``strategy.auto`` is not set.

    Raises:
        ValueError: nothing the strategy can run fits (the planner's message).
    """
    strategy = dict(cfg["strategy"])
    if not strategy.get("auto"):
        return cfg, ""
    trainer = cfg["trainer"]
    devices = trainer.get("devices")
    if not isinstance(devices, int):
        raise ValueError("strategy=auto needs trainer.devices as a number (the planner lays out that many devices).")
    accelerator = str(trainer.get("accelerator", "cpu"))
    name = strategy.get("cluster") or ("cpu8" if accelerator == "cpu" else "h100_80g")
    cluster = load_cluster(name, gpus_per_node=devices, nodes=int(trainer.get("num_nodes") or 1))
    model_cfg = dict(cfg["model"])
    model_cfg.setdefault("seq_len", cfg.get("data", {}).get("block_size"))
    model = model_from_config(model_cfg)
    result = plan(model, cluster, int(strategy["global_batch_size"]), Search())
    best = result.best_runnable()
    if best is None:
        raise ValueError("strategy=auto: no layout the planner ranked runs under ThreeDStrategy today.")
    chosen = strategy_kwargs(best)
    for key in AUTO_KEYS:
        strategy.pop(key, None)
    strategy.update(chosen)
    strategy.setdefault("stages_per_rank", 1)
    if best.layout.pp == 1:
        strategy["schedule"] = "1f1b"
    data = dict(cfg["data"], batch_size=best.layout.replica_batch)
    message = (
        f"strategy=auto: {best.layout.short()} on {cluster.name} ({', '.join(f'{k}={v}' for k, v in chosen.items())}, "
        f"data.batch_size={best.layout.replica_batch}); predicted {best.step_s:.3g} s per step, "
        f"{best.memory.gib:.2f} GiB per device"
    )
    return {**cfg, "strategy": strategy, "data": data}, message
