"""``python -m lightning_3d.plan``: the planner's Hydra app over ``conf/plan.yaml``.

    python -m lightning_3d.plan                                      # GPT small on this machine's 8 processes
    python -m lightning_3d.plan model=gpt_xl cluster=h100_80g cluster.nodes=2 global_batch_size=256
    python -m lightning_3d.plan model=hf_llama model.num_hidden_layers=32 model.hidden_size=4096 \\
        model.intermediate_size=14336 model.num_attention_heads=32 model.num_key_value_heads=8 \\
        model.vocab_size=128256 seq_len=8192 cluster=h100_80g cluster.nodes=8 global_batch_size=512
    python -m lightning_3d.plan calibrate=true                       # measure this machine: conf/cluster/cpu8.yaml

Prints the ranked table, why the best few beat the next, the first choice as ``ThreeDStrategy(...)`` arguments and
as a training command; ``output=FILE`` writes the ranked list as JSON. Exit status 1 with one line when no layout
is left (what would help is in the line).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from .cluster import CLUSTER_DIR, cluster_from_config
from .layouts import Search
from .model import model_from_config
from .planner import NoLayout, Plan, plan
from .report import command_line, reasons, strategy_call, summary, table, write_json


@dataclass
class SearchConfig:
    """Pins of the search (``None``: every value)."""

    tp: list[int] | None = None
    pp: list[int] | None = None
    dp: list[int] | None = None
    micro_batches: list[int] | None = None
    micro_batch_size: list[int] | None = None
    schedule: list[str] | None = None
    data_parallel: list[str] | None = None
    activation_checkpointing: list[str] | None = None


@dataclass
class PlanConfig:
    """``conf/plan.yaml``'s schema (``model`` and ``cluster`` are groups: any mapping)."""

    model: Any = MISSING
    cluster: Any = MISSING
    global_batch_size: int = 32
    seq_len: int | None = None
    top: int = 10
    reasons: int = 3
    output: str | None = None
    calibrate: bool = False
    calibrate_name: str = "cpu8"
    calibrate_processes: int = 8
    search: SearchConfig = field(default_factory=SearchConfig)


def _model_overrides() -> tuple[str, list[str]]:
    """The ``model=...`` choice and ``model.*`` overrides of this command line (for the training command)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    choice = hc.runtime.choices.get("model", "gpt_small")
    overrides = [o for o in hc.overrides.task if o.startswith("model.")]
    return choice, [f"model={choice}", *overrides]


def make_plan(cfg: DictConfig) -> Plan:
    """The plan of a composed ``plan.yaml`` config."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=False)
    assert isinstance(model_cfg, dict)
    if cfg.seq_len:
        model_cfg["seq_len"] = cfg.seq_len
    cluster_cfg = OmegaConf.to_container(cfg.cluster, resolve=True)
    assert isinstance(cluster_cfg, dict)
    search = Search(**{k: (list(v) if v is not None else None) for k, v in cfg.search.items()})
    return plan(model_from_config(model_cfg), cluster_from_config(cluster_cfg), int(cfg.global_batch_size), search)


def _task(cfg: DictConfig) -> None:
    if cfg.calibrate:
        from .calibrate import calibrate

        path = calibrate(cfg.calibrate_name, cfg.calibrate_processes, CLUSTER_DIR)
        print(f"calibrated: wrote {path}")
        import yaml

        cfg = OmegaConf.merge(cfg, {"cluster": yaml.safe_load(path.read_text())})
    try:
        result = make_plan(cfg)
    except (NoLayout, ValueError) as err:
        print(f"lightning_3d.plan: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(summary(result))
    print()
    print(table(result, cfg.top))
    print()
    lines = reasons(result, cfg.reasons)
    if lines:
        print("why:")
        print("\n".join(f"  {line}" for line in lines))
        print()
    best = result.best_runnable()
    if best is not result.best:
        print(f"the first choice is predicted only: {result.best.unsupported}.")
    if best is None:
        print("no ranked layout runs under ThreeDStrategy today.")
    else:
        rank = result.entries.index(best) + 1
        c = result.cluster
        _, model_args = _model_overrides()
        accelerator = "cpu" if c.cores is not None else "gpu"
        print(f"first choice ThreeDStrategy can run (#{rank}): {strategy_call(best)}")
        print(
            f"  memory {best.memory.gib:.2f} GiB per device, step {best.step_s:.4g} s, {best.tflops_per_gpu:.3g} "
            f"TFLOP/s per device"
        )
        print(f"  {command_line(best, model_args, accelerator, c.gpus_per_node, c.nodes)}")
        print("  (or: python -m lightning_3d.train strategy=auto ..., which runs the planner's first choice)")
    if cfg.output:
        path = write_json(result, cfg.output)
        print(f"wrote {len(result.entries)} layouts to {path}")


def main() -> None:
    """Entry point of ``python -m lightning_3d.plan``."""
    import hydra
    from hydra.core.config_store import ConfigStore

    from ..train.app import CONF_DIR, _register_resolvers
    from ..train.config import register_configs

    register_configs()  # the model options name the training schemas
    _register_resolvers()
    ConfigStore.instance().store(name="plan_schema", node=PlanConfig)
    hydra.main(config_path=str(CONF_DIR), config_name="plan", version_base="1.3")(_task)()
