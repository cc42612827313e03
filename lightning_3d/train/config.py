"""Structured configs (schemas) of the Hydra command line ``python -m lightning_3d.train``.

Each dataclass is registered in Hydra's ConfigStore under its config group (``strategy/schema_3d``,
``model/schema_gpt``, ...). The YAML options under ``conf/`` name their schema first in their defaults list,
so Hydra type-checks every value and refuses unknown keys: ``strategy.tpp=2`` or ``strategy.tp=two`` fail at
composition, before anything is built or any process starts.

``StrategyConfig`` is derived from :class:`lightning_3d.settings.ThreeDSettings`, one field per setting: a new
setting is on the command line without being written here (``tests/unit/test_settings.py`` checks that it is
also in ``conf/strategy/3d.yaml``).

The primary config types its groups as ``Any`` on purpose: a user's own model or data option (added with
``--config-dir``) need not follow one of these schemas; it only needs a ``_target_``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..settings import ThreeDSettings

# ---------------------------------------------------------------------------------------------- strategy
# Settings whose Python type Hydra cannot hold, and their command-line form: (type, default -> config value).
_CLI_FORMS: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    "timeout": (float | None, lambda v: None if v is None else v.total_seconds()),  # seconds
    "train_timeout": (float | None, lambda v: None if v is None else v.total_seconds()),
    "partitioner": (str, str),  # by name: a custom partitioner is a Python object
    # {"glob": "style name"}; {} for none, because Hydra can add entries to {} but not to null:
    # ++strategy.tp_plan={*.attn.q_proj:colwise,*.attn.o_proj:rowwise}
    "tp_plan": (dict[str, str], lambda v: dict(v or {})),
    # one list of module names per stage: '++strategy.stages=[[model.embed,model.layers.0],[model.layers.1,model.head]]'
    "stages": (list[list[str]] | None, lambda v: None if v is None else [list(names) for names in v]),
    # true / false, or torch.compile's arguments: ++strategy.compile={backend:aot_eager}
    "compile": (Any, lambda v: v),
    # null, full, selective or N: ++strategy.activation_checkpointing=2
    "activation_checkpointing": (Any, lambda v: v),
}
# Types Hydra holds as they are (alone or ``| None``).
_PLAIN_TYPES = (int, float, bool, str)


def _cli_type(name: str, hint: Any) -> Any:
    if name in _CLI_FORMS:
        return _CLI_FORMS[name][0]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint in _PLAIN_TYPES or (
        typing.get_origin(hint) in (Union, UnionType) and len(args) == 1 and args[0] in _PLAIN_TYPES
    ):
        return hint
    raise TypeError(f"ThreeDSettings.{name}: type {hint} has no command-line form; add it to _CLI_FORMS in {__name__}.")


def strategy_schema(settings: type[ThreeDSettings] = ThreeDSettings) -> type:
    """The Hydra schema of ``ThreeDStrategy``'s arguments, derived field by field from ``ThreeDSettings``.

    Every setting is reachable from the command line (``strategy.<name>=value``) with the setting's own
    default; the few whose Python type Hydra cannot hold take their command-line form (``_CLI_FORMS``).
    """
    hints = typing.get_type_hints(settings)
    specs: list[tuple[str, Any, Any]] = [("_target_", str, field(default="lightning_3d.ThreeDStrategy"))]
    for f in dataclasses.fields(settings):
        default = f.default
        if f.name in _CLI_FORMS:
            default = _CLI_FORMS[f.name][1](default)
        value = (
            field(default_factory=lambda d=default: d.copy()) if isinstance(default, dict) else field(default=default)
        )
        specs.append((f.name, _cli_type(f.name, hints[f.name]), value))
    schema = dataclasses.make_dataclass("StrategyConfig", specs)
    schema.__doc__ = "Arguments of :class:`lightning_3d.ThreeDStrategy`: the fields of ``ThreeDSettings``."
    schema.__module__ = __name__
    return schema


StrategyConfig = strategy_schema()

# strategy=auto (conf/strategy/auto.yaml): the same settings, the layout chosen by lightning_3d.plan.auto.
AutoStrategyConfig = dataclasses.make_dataclass(
    "AutoStrategyConfig",
    [("auto", bool, field(default=True)), ("cluster", str | None, field(default=None)), ("global_batch_size", int, 32)],
    bases=(StrategyConfig,),
)


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
    example_batch: int | None = None  # null: the job's micro-batch (data.batch_size // micro_batches), from the app


@dataclass
class MLPModelConfig:
    """Arguments of :class:`lightning_3d_examples.MLPClassifier`."""

    _target_: str = "lightning_3d_examples.MLPClassifier"
    in_features: int = 16
    hidden: int = 64
    num_classes: int = 4
    depth: int = 2
    lr: float = 1e-2
    example_batch: int | None = None  # null: the job's micro-batch (data.batch_size // micro_batches), from the app


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
    example_batch: int | None = None  # null: the job's micro-batch (data.batch_size // micro_batches), from the app


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
class TimelineConfig:
    """The pipeline's timeline of chosen training steps (``lightning_3d.tools.timeline.PipelineTimeline``): a Chrome
    trace and a Gantt chart per profiled step under ``<run_dir>/timeline``, with the measured bubble beside the
    schedule's theoretical one. Off by default; ``timeline.enabled=true`` profiles step ``first_step``."""

    enabled: bool = False
    first_step: int = 1  # step 0 exchanges shapes: the first representative step is 1
    every_n_steps: int | None = None  # None: once
    max_profiles: int | None = None
    gantt: bool | None = None  # the PNG; None: when matplotlib is installed (the trace needs nothing)


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
    timeline: TimelineConfig = field(default_factory=TimelineConfig)


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "config_schema"): Config,
    ("strategy", "schema_3d"): StrategyConfig,
    ("strategy", "schema_auto"): AutoStrategyConfig,
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
