"""The planner's command line ``python -m lightning_3d.plan`` and ``strategy=auto`` of the training app.

One process runs the planner (through tests/launch.py, with a time limit); the rest composes ``conf/`` in process.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lightning_3d.plan import NoLayout
from lightning_3d.plan.app import PlanConfig, make_plan
from lightning_3d.settings import ThreeDSettings
from lightning_3d.train.app import CONF_DIR, _register_resolvers
from lightning_3d.train.config import register_configs

from launch import run_lightning


def _compose(name: str, overrides: list[str]):
    from hydra.core.config_store import ConfigStore

    register_configs()
    _register_resolvers()
    ConfigStore.instance().store(name="plan_schema", node=PlanConfig)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=overrides)


def test_plan_command_prints_the_table_and_writes_the_ranked_json(tmp_path):
    out = tmp_path / "plan.json"
    args = ["model=gpt_medium", "cluster=h100_80g", "global_batch_size=16", "search.tp=[2]", f"output={out}"]
    result = run_lightning("plan_main.py", args, timeout=180)
    entries = json.loads(out.read_text())
    assert entries and all(e["tp"] == 2 and e["tp"] * e["pp"] * e["dp"] == 8 for e in entries)
    steps = [e["step_s"] for e in entries]
    assert steps == sorted(steps)
    for e in entries:
        assert e["dp"] * e["micro_batches"] * e["micro_batch_size"] == 16
        assert 0 < e["memory_gib"] <= 80 and e["tflops_per_gpu"] > 0
        assert e["schedule"] and e["data_parallel"] in ("replicate", "fsdp")
        assert e["activation_checkpointing"] in ("none", "full")
    text = result.output
    assert "why:" in text and "ThreeDStrategy(tp=2" in text
    assert "lightning_3d.train model=gpt_medium strategy.tp=2" in text


def test_unknown_cluster_lists_the_clusters():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("plan", ["cluster=tpu_v5"])
    assert all(name in str(err.value) for name in ("a100_80g", "cpu8", "h100_80g", "h200"))


def test_a_batch_no_layout_divides_names_the_nearest():
    # 2 heads and 2 layers: tp * pp <= 4 leaves dp >= 2 of 8 devices, which an odd batch does not divide.
    cfg = _compose("plan", ["model=gpt_tiny", "model.n_head=2", "cluster=cpu8", "global_batch_size=7"])
    with pytest.raises(NoLayout, match="the nearest that work: 6 and 8"):
        make_plan(cfg)


def test_strategy_auto_takes_the_planners_first_runnable_choice():
    from lightning_3d.plan.auto import resolve_auto

    cfg = _compose("config", ["strategy=auto", "model=gpt_tiny", "trainer.devices=4", "strategy.global_batch_size=16"])
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("strategy", "model", "data", "trainer")}
    resolved, message = resolve_auto(plain)
    strategy = resolved["strategy"]
    assert not {"auto", "cluster", "global_batch_size"} & set(strategy)
    settings = ThreeDSettings(
        **{k: v for k, v in strategy.items() if k not in ("_target_", "timeout", "train_timeout", "tp_plan")}
    )
    assert settings.tp * settings.pp * settings.dp == 4
    assert resolved["data"]["batch_size"] * settings.dp == 16
    assert resolved["data"]["batch_size"] % settings.micro_batches == 0
    assert message.startswith("strategy=auto: ")
    plan_cfg = _compose("plan", ["model=gpt_tiny", "cluster=cpu8", "cluster.gpus_per_node=4", "global_batch_size=16"])
    best = make_plan(plan_cfg).best_runnable()
    assert (best.layout.tp, best.layout.pp, best.layout.dp) == (settings.tp, settings.pp, settings.dp)
