"""Structured configs (schemas) of the Hydra command line ``python -m lightning_3d.train``.

Each dataclass is registered in Hydra's ConfigStore under its config group (``strategy/schema_3d``,
``model/schema_gpt``, ...). The YAML options under ``conf/`` name their schema first in their defaults list,
so Hydra type-checks every value and refuses unknown keys: ``strategy.tpp=2`` or ``strategy.tp=two`` fail at
composition, before anything is built or any process starts.

The primary config types its groups as ``Any`` on purpose: a user's own model or data option (added with
``--config-dir``) need not follow one of these schemas; it only needs a ``_target_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class StrategyConfig:
    """Arguments of :class:`lightning_3d.ThreeDStrategy` (see its docstring for their meaning)."""

    _target_: str = "lightning_3d.ThreeDStrategy"
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None: world_size // (tp * pp)
    micro_batches: int | None = None  # None: pp
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    tp_plan: dict[str, str] | None = None
    tp_autoplan: bool = True
    partitioner: str = "uniform"
    body: str | None = None
    seed: int | None = None
    timeout: float | None = 1800.0  # seconds; process-group timeout
    process_group_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    print_layout: bool = True


@dataclass
class GPTModelConfig:
    """Arguments of :class:`lightning_3d_examples.GPT`: training hyperparameters and the ``GPTConfig`` shape.

    The shape fields are spelled out (not only ``preset``) so the printed config shows the model and any
    field can be overridden, e.g. ``model.n_layer=8``. ``tests/test_cli.py`` checks the preset YAML files
    against ``lightning_3d_examples.PRESETS``.
    """

    _target_: str = "lightning_3d_examples.GPT"
    preset: str = "small"
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0
    max_steps: int | None = None  # None: constant learning rate; else warm-up + cosine to this step
    min_lr_ratio: float = 0.1
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


@dataclass
class MLPModelConfig:
    """Arguments of :class:`lightning_3d_examples.MLPClassifier`."""

    _target_: str = "lightning_3d_examples.MLPClassifier"
    in_features: int = 16
    hidden: int = 64
    num_classes: int = 4
    depth: int = 2
    lr: float = 1e-2


@dataclass
class HFLlamaModelConfig:
    """Arguments of :class:`lightning_3d_examples.HFCausalLM`: a Hugging Face ``LlamaForCausalLM`` built from a config.

    The shape fields are Hugging Face ``LlamaConfig`` fields (the preset's values spelled out, so the printed
    config shows the model and any of them can be overridden, e.g. ``model.num_hidden_layers=8``).
    """

    _target_: str = "lightning_3d_examples.HFCausalLM"
    preset: str = "small"
    model_type: str = "llama"
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0
    max_steps: int | None = None  # None: constant learning rate; else warm-up + cosine to this step
    min_lr_ratio: float = 0.1
    block_size: int = 64  # context length of the data; the model's max_position_embeddings
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False


@dataclass
class TextDataConfig:
    """Arguments of :class:`lightning_3d_examples.ByteTextDataModule`. ``batch_size`` is per data-parallel replica."""

    _target_: str = "lightning_3d_examples.ByteTextDataModule"
    path: str | None = None  # None: the Python standard library's sources
    block_size: int = 64
    batch_size: int = 16
    val_fraction: float = 0.1
    max_bytes: int = 2_000_000
    num_workers: int = 0


@dataclass
class BlobsDataConfig:
    """Arguments of :class:`lightning_3d_examples.BlobsDataModule`."""

    _target_: str = "lightning_3d_examples.BlobsDataModule"
    num_samples: int = 2048
    in_features: int = 16
    num_classes: int = 4
    batch_size: int = 64
    seed: int = 0
    cluster_std: float = 1.0
    val_fraction: float = 0.1


@dataclass
class TrainerConfig:
    """The ``lightning.pytorch.Trainer`` arguments the command line exposes.

    ``strategy``, ``logger``, ``callbacks`` and ``default_root_dir`` are set by ``lightning_3d.train`` from
    the other groups. Fields typed ``Any`` take several types in Lightning (``devices=8`` or ``"auto"``).
    """

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 8
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = -1
    max_epochs: int | None = None
    max_time: str | None = None  # "DD:HH:MM:SS"
    val_check_interval: Any = None  # int: every N training batches; float: fraction of an epoch
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    num_sanity_val_steps: int | None = None
    log_every_n_steps: int = 50
    gradient_clip_val: float | None = None
    accumulate_grad_batches: int = 1
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_model_summary: bool = False  # it would describe rank 0's shard only
    fast_dev_run: Any = False
    deterministic: Any = None
    profiler: str | None = None
    detect_anomaly: bool = False


@dataclass
class CheckpointConfig:
    """``ModelCheckpoint`` settings; checkpoints go to ``<run_dir>/checkpoints`` when checkpointing is on."""

    monitor: str | None = "val_loss"
    mode: str = "min"
    save_top_k: int = 1
    save_last: bool = True
    every_n_train_steps: int | None = None  # None: at every validation


@dataclass
class SampleConfig:
    """Text sampled on rank 0 from the trained GPT at the end of training (ignored for other models)."""

    enabled: bool = True
    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = 40


@dataclass
class LoggingConfig:
    """Loggers writing under the run directory (TensorBoard only when the package is installed)."""

    csv: bool = True
    tensorboard: bool = True
    throughput_window: int = 10  # steps averaged for the tokens/s shown in the progress bar


@dataclass
class Config:
    """The primary config. Groups are chosen in ``conf/config.yaml``'s defaults list."""

    strategy: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    trainer: Any = MISSING
    seed: int = 1337
    # Where logs, checkpoints and the resolved config go. Resolved once by the launching process, so every
    # rank Lightning starts writes to the same place.
    run_dir: str = "${hydra:runtime.output_dir}"
    print_config: bool = True
    ckpt_path: str | None = None  # resume: a checkpoint (e.g. <old run_dir>/checkpoints/last.ckpt) for trainer.fit
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "config_schema"): Config,
    ("strategy", "schema_3d"): StrategyConfig,
    ("model", "schema_gpt"): GPTModelConfig,
    ("model", "schema_mlp"): MLPModelConfig,
    ("model", "schema_hf_llama"): HFLlamaModelConfig,
    ("data", "schema_text"): TextDataConfig,
    ("data", "schema_blobs"): BlobsDataConfig,
    ("trainer", "schema_trainer"): TrainerConfig,
}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent; call before composing ``conf/``)."""
    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)
