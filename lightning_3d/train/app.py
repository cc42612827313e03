r"""The main job: ``python -m lightning_3d.train`` (or ``lightning-3d-train``), a Hydra app over ``conf/``.

    python -m lightning_3d.train            # GPT small on the stdlib sources, 8 CPU processes: tp 2 x pp 2 x dp 2
    python -m lightning_3d.train model=gpt_tiny trainer.max_steps=6 trainer.val_check_interval=3 \
        trainer.devices=4 strategy.tp=2 strategy.pp=2
    python -m lightning_3d.train --multirun model=mlp strategy.tp=1 strategy.pp=1,2 trainer.devices=2 \
        trainer.max_steps=4 trainer.val_check_interval=2

How the processes are made. The command runs once; Lightning's launcher then starts ``trainer.devices - 1``
copies of it. Those copies do NOT compose the config again from the command line (Lightning's Hydra support
would re-run ``--multirun`` sweeps in every child): the launching process writes the fully resolved config
of the current job to ``<run_dir>/job.yaml`` and points the children at it through an environment variable,
so every rank trains exactly the same job, sweeps included. Under torchrun or SLURM (processes created
externally) each process composes the config itself from the same command line.

Elastic restart: when torchrun (``--max-restarts N``) restarts the group (``TORCHELASTIC_RESTART_COUNT > 0``)
and no ``ckpt_path`` is given, the job resumes with ``ckpt_path="last"``, the newest complete checkpoint in
``<run_dir>/checkpoints`` (``lightning_3d.checkpoint.resume.elastic_ckpt_path``); give a fixed ``hydra.run.dir``.

Between the jobs of a sweep the launching process destroys its process group and restores its environment
(``MASTER_PORT``, ``LOCAL_RANK``... that the launcher sets), so the next job starts its own processes on a
fresh port instead of joining the previous job's group.

Where the YAML lives: ``conf/`` at the repository's top level, found relative to this file. That is where a
reader looks for a Hydra app's configs and what a source checkout or ``pip install -e .`` (the supported
installs) provide. A non-editable wheel does not ship it; pass ``--config-dir`` (or ``--config-path``) there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..checkpoint.resume import elastic_ckpt_path, elastic_store_problem
from ..core.agreed import is_agreed
from ..core.runner import micro_batch_mismatch
from ..settings import ThreeDSettings
from .config import register_configs

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Set by the launching process while a job runs; the processes Lightning starts read their config from it.
JOB_CONFIG_ENV = "LIGHTNING_3D_JOB_CONFIG"


# Jobs this process has launched processes for (a --multirun sweep runs several in one process).
_jobs_launched = 0


class ConfigurationError(Exception):
    """A job that cannot be built from its config; reported as one line before any process starts."""


def _lr_schedule_steps(max_steps: Any) -> int | None:
    """``trainer.max_steps`` for the model's LR schedule: ``None`` (constant LR) when it is -1 (unlimited)."""
    steps = int(max_steps)
    return steps if steps > 0 else None


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("lr_schedule_steps"):
        OmegaConf.register_new_resolver("lr_schedule_steps", _lr_schedule_steps)


# ---------------------------------------------------------------------------------------------- building a job


def _loggers(cfg: DictConfig) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list[Any] = []
    if cfg.logging.csv:
        # version="": Hydra's run directory is already unique; no version_N level below it.
        loggers.append(CSVLogger(save_dir=cfg.run_dir, name="csv", version=""))
    if cfg.logging.tensorboard:
        from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

        if _TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE:
            loggers.append(TensorBoardLogger(save_dir=cfg.run_dir, name="tensorboard", version=""))
    return loggers


def _callbacks(cfg: DictConfig, model: Any) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_3d_examples.gpt import GPT
    from lightning_3d_examples.hf_llama import HFCausalLM

    from .callbacks import SampleText, Throughput, ValidationPrinter

    callbacks: list[Any] = [ValidationPrinter(), Throughput(window=cfg.logging.throughput_window)]
    if cfg.trainer.enable_checkpointing:
        ck = cfg.checkpoint
        callbacks.append(
            ModelCheckpoint(
                # Rank 0's path is broadcast to every rank by ModelCheckpoint.setup.
                dirpath=str(Path(cfg.run_dir) / "checkpoints"),
                monitor=ck.monitor,
                mode=ck.mode,
                save_top_k=ck.save_top_k,
                save_last=ck.save_last,
                every_n_train_steps=ck.every_n_train_steps,
            )
        )
    if cfg.timeline.enabled:
        from lightning_3d.tools.timeline import PipelineTimeline, matplotlib_available

        t = cfg.timeline
        callbacks.append(
            PipelineTimeline(
                out_dir=Path(cfg.run_dir) / "timeline",
                first_step=t.first_step,
                every_n_steps=t.every_n_steps,
                max_profiles=t.max_profiles,
                gantt=matplotlib_available() if t.gantt is None else t.gantt,
            )
        )
    if cfg.sample.enabled and isinstance(model, (GPT, HFCausalLM)):
        s = cfg.sample
        callbacks.append(SampleText(s.prompt, s.max_new_tokens, s.temperature, s.top_k, seed=cfg.seed))
    return callbacks


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Instantiate ``(trainer, model, datamodule)`` from a resolved config. Starts no process.

    Raises:
        ConfigurationError: with a one-line reason, for anything the config gets wrong (a layout that does
            not fit the devices, an unknown preset, an accelerator that is not there...).
    """
    from hydra.utils import instantiate

    try:
        strategy = instantiate(cfg.strategy, _convert_="all")
        model = instantiate(cfg.model, _convert_="all", **_example_batch(cfg, strategy))
        data = instantiate(cfg.data, _convert_="all")
        # _partial_: the strategy, loggers and callbacks are objects, not config values.
        make_trainer = instantiate(cfg.trainer, _partial_=True, _convert_="all")
        trainer = make_trainer(
            strategy=strategy,
            logger=_loggers(cfg) or False,
            callbacks=_callbacks(cfg, model),
            default_root_dir=cfg.run_dir,
        )
        _check_batch(cfg, strategy)
    except Exception as err:  # everything here is a config problem: report it without a traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise ConfigurationError(_one_line(err)) from err
    return trainer, model, data


def _example_batch(cfg: DictConfig, strategy: Any) -> dict[str, int]:
    """``{"example_batch": data.batch_size // micro_batches}`` when the model takes ``example_batch`` and its
    config leaves it null, else ``{}``. The example models then carry an ``example_input_array`` of the job's
    real micro-batch, so ``strategy.partitioner=compute`` / ``memory`` run from the command line and the stage
    boundaries are checked at setup. Nothing when the batch or the micro-batch count is not known here."""
    settings = getattr(strategy, "settings", None)
    if "example_batch" not in cfg.model or cfg.model.example_batch is not None:
        return {}
    batch = cfg.data.get("batch_size") if "data" in cfg else None
    micro = settings.micro_batches if isinstance(settings, ThreeDSettings) else None
    if not isinstance(batch, int) or not micro or batch % micro:
        return {}  # _check_batch refuses a batch the count does not divide
    return {"example_batch": batch // micro}


def _check_batch(cfg: DictConfig, strategy: Any) -> None:
    """Refuse a per-replica batch that the micro-batch count does not divide, before any process starts.

    The strategy would refuse it at the first training step, on every rank; the message is the same.
    """
    settings = getattr(strategy, "settings", None)
    batch = cfg.data.get("batch_size")
    if not isinstance(settings, ThreeDSettings) or not isinstance(batch, int) or batch < 1:
        return
    assert settings.micro_batches is not None  # resolved by ThreeDSettings
    if batch % settings.micro_batches:
        raise ValueError(micro_batch_mismatch(batch, settings.micro_batches, settings.min_micro_batches))


def _one_line(err: BaseException) -> str:
    """The innermost reason (Hydra wraps instantiation errors in an InstantiationException), on one line."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ---------------------------------------------------------------------------------------------- running a job


def run(cfg: DictConfig) -> float | None:
    """Train once with a composed config (called by Hydra, once per job of a sweep, and by every child rank).

    Returns:
        The last validation loss seen by rank 0 (``None`` elsewhere, or without validation): the value a
        Hydra sweeper minimises.
    """
    import lightning as L

    started = time.monotonic()
    _register_resolvers()
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates, once per rank and batch shape:
    # noise for a newcomer, nothing they can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    try:
        # Resolve now (${hydra:...}, ${model.block_size}...): children and loggers get plain values.
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
        if cfg.strategy.get("auto"):  # strategy=auto: the planner's first choice (lightning_3d.plan)
            from ..plan.auto import resolve_auto

            resolved, message = resolve_auto(OmegaConf.to_container(cfg))  # type: ignore[arg-type]
            cfg = OmegaConf.create(resolved)
            log.info("%s", message)
    except Exception as err:
        raise ConfigurationError(_one_line(err)) from err
    is_child = JOB_CONFIG_ENV in os.environ
    environ = dict(os.environ)
    store_problem = elastic_store_problem()
    if store_problem and _external_rank() == 0:
        log.warning("%s", store_problem)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        trainer, model, data = build(cfg)
        if trainer.is_global_zero:
            if cfg.print_config:
                print(OmegaConf.to_yaml(cfg), flush=True)
            log.info("%s", _describe_job(cfg, trainer))
        # False under torchrun / SLURM (they created the processes) and in the ranks Lightning started.
        launches = not getattr(trainer.strategy.cluster_environment, "creates_processes_externally", True)
        global _jobs_launched
        if launches and _jobs_launched:
            # A previous job's TCPStore can outlive its process group, and torch lets a new store bind the same
            # port: the new ranks could then meet the old store's keys. Each later job gets a port of its own.
            from lightning.fabric.plugins.environments.lightning import find_free_network_port

            os.environ["MASTER_PORT"] = str(find_free_network_port())
        _jobs_launched += launches
        if launches or trainer.is_global_zero:
            job_file = Path(cfg.run_dir) / "job.yaml"
            job_file.parent.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(cfg, job_file)
            if launches:
                os.environ[JOB_CONFIG_ENV] = str(job_file)
        try:
            # After a torchrun restart: resume from the run's last complete checkpoint (checkpoint/resume.py).
            trainer.fit(model, datamodule=data, ckpt_path=elastic_ckpt_path(cfg.ckpt_path))
        except Exception as err:
            if is_agreed(err) and not trainer.is_global_zero:
                # Every rank raised this same error at the same point: rank 0 prints its traceback, the other
                # ranks exit without repeating it (the fail-fast watch has printed one line naming each rank).
                sys.stderr.flush()
                sys.exit(1)
            raise
        if launches:
            _wait_for_children(trainer)
    finally:
        if not is_child:
            _reset_process_state(environ)
    val_loss = trainer.callback_metrics.get("val_loss")
    result = float(val_loss) if val_loss is not None and trainer.is_global_zero else None
    if trainer.is_global_zero:
        _summary(trainer, cfg, time.monotonic() - started)
    return result


def _describe_job(cfg: DictConfig, trainer: Any) -> str:
    """One line: the model's size (counted on the meta device: free even for the 1B preset) and the batch."""
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        shadow = instantiate(cfg.model, _convert_="all")
        if callable(getattr(shadow, "configure_model", None)):
            shadow.configure_model()
    params = sum(p.numel() for p in shadow.parameters())
    text = f"model {type(shadow).__name__}: {params:,} parameters"
    topology = getattr(trainer.strategy, "topology", None)
    batch = cfg.data.get("batch_size")
    if topology is not None and batch is not None:
        text += f"; global batch {batch * topology.dp} samples (data.batch_size {batch} per replica x dp {topology.dp})"
    return text


def _summary(trainer: Any, cfg: DictConfig, seconds: float) -> None:
    from .callbacks import Throughput, ValidationPrinter

    parts = [f"{trainer.global_step} steps in {seconds:.0f} s"]
    for cb in trainer.callbacks:
        if isinstance(cb, ValidationPrinter) and cb.history:
            first, last = cb.history[0], cb.history[-1]
            if "val_loss" in first[1]:
                parts.append(
                    f"val_loss {first[1]['val_loss']:.4f} (step {first[0]}) -> {last[1]['val_loss']:.4f} "
                    f"(step {last[0]})"
                )
        if isinstance(cb, Throughput) and cb.rate:
            parts.append(f"{cb.rate:.0f} {cb.unit}/s")
    log.info("done: %s; outputs in %s", "; ".join(parts), cfg.run_dir)


def _wait_for_children(trainer: Any, timeout: float = 120.0) -> None:
    """Wait for the processes Lightning started, so a sweep's next job does not race them for the CPU."""
    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or []
    failed = []
    for proc in procs:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # a child that does not finish: do not leave it behind
            proc.kill()
            code = proc.wait()
        if code != 0:
            failed.append(code)
    if failed:
        raise RuntimeError(f"{len(failed)} of the job's child processes exited with codes {failed}.")


def _reset_process_state(environ: dict[str, str]) -> None:
    """Undo what a job left in this process: the default process group and the launcher's variables.

    Without it a second job in the same process (``--multirun``) would find ``LOCAL_RANK`` set (Lightning
    would then believe its processes were created externally and start none) and an initialised process
    group of the previous job's world (Lightning would reuse it).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


# ---------------------------------------------------------------------------------------------- entry points


def _hydra_task(cfg: DictConfig) -> float | None:
    try:
        return run(cfg)
    except ConfigurationError as err:
        # One line and a non-zero exit, like Hydra's own config errors (SystemExit passes through Hydra).
        print(f"lightning_3d.train: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


def _run_child(job_file: str) -> None:
    """A rank started by Lightning's launcher: train the launching process's resolved job."""
    run(OmegaConf.load(job_file))


def _external_rank() -> int | None:
    """The global rank given by torchrun (``RANK``) or SLURM (``SLURM_PROCID``); None when started by hand."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def main() -> None:
    """Console entry point of ``lightning-3d-train`` and ``python -m lightning_3d.train``."""
    job_file = os.environ.get(JOB_CONFIG_ENV)
    if job_file and os.environ.get("LOCAL_RANK", "0") != "0":
        _run_child(job_file)
        return
    own_configs = any(a.startswith(("--config-path", "-cp", "--config-dir", "-cd")) for a in sys.argv[1:])
    if not (CONF_DIR / "config.yaml").is_file() and not own_configs:
        print(
            f"lightning_3d.train: error: no Hydra configs at {CONF_DIR} (a non-editable install does not ship "
            "conf/); run from a source checkout installed with `pip install -e .`, or pass --config-dir.",
            file=sys.stderr,
        )
        sys.exit(1)
    import hydra

    if _external_rank() not in (None, 0):
        # torchrun / srun start every rank with this command line: let rank 0 alone write the run directory's
        # .hydra/ record (the ranks would otherwise write the same files at once).
        sys.argv.append("hydra.output_subdir=null")
    register_configs()
    _register_resolvers()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_hydra_task)()


if __name__ == "__main__":
    main()
