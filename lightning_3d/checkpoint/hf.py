"""Hugging Face model folders <-> single-device state dicts of a LightningModule holding a Hugging Face model.

Export: a full state dict (``export`` / ``load_consolidated`` of a checkpoint folder, or ``module.state_dict()``),
keyed like the LightningModule (``model.model.layers.0...`` for ``self.model = LlamaForCausalLM(...)``), becomes
a folder ``AutoModelForCausalLM.from_pretrained(folder)`` loads: ``config.json`` + ``model.safetensors``
(+ ``generation_config.json``), written by the model class's own ``save_pretrained``. The attribute prefix
(``model.``) is stripped; tied weights (``lm_head.weight`` = the input embedding) are stored once, as
Hugging Face stores them. The model is built on the meta device and takes the state dict's tensors as they are
(no initialisation, no copy).

Import: :func:`read_hf_folder` reads a Hugging Face checkpoint folder with ``from_pretrained`` (so every key
conversion transformers knows applies) and returns its state dict keyed like the LightningModule (prefix added,
tied weights under both names), for :class:`lightning_3d.checkpoint.LoadWeights` or
``strategy.load_full_state_dict``.

The config: a ThreeDStrategy checkpoint folder holds tensors and Lightning's metadata, not the Hugging Face
config. :func:`hf_configs` gives the configs of the Hugging Face models in a module; a LightningModule stores
them in its checkpoint with ``checkpoint[HF_CONFIG_KEY] = hf_configs(self)`` in ``on_save_checkpoint`` (the
example ``HFCausalLM`` does), and ``export-hf`` finds them there; otherwise pass ``--config`` (a
``config.json`` or a folder holding one).

Command line::

    python -m lightning_3d.checkpoint export-hf CKPT_DIR OUT_DIR [--module-attr model] [--config CONFIG]
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

HF_CONFIG_KEY = "hf_config"
"""Key of the Hugging Face configs in a checkpoint dict (``meta.pt``): ``{module attribute: config dict}``."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise ImportError(
            "lightning_3d: Hugging Face export/import needs transformers and safetensors: "
            "pip install 'lightning-3d[hf]'"
        ) from exc
    return transformers


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model folder: a directory with ``config.json`` and safetensors weights."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def hf_models(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost ``PreTrainedModel`` modules in ``module``, by attribute path (``""``: the module itself)."""
    from lightning_3d.core.tensor_parallel.hf_plan import find_hf_models

    return dict(find_hf_models(module))


def peft_models(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost PEFT models in ``module`` (a ``PeftModel``: ``peft_config`` and ``save_pretrained``, which
    writes the adapters), by attribute path (``""``: the module itself)."""
    found: dict[str, nn.Module] = {}
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer in found):
            continue
        if isinstance(getattr(sub, "peft_config", None), Mapping) and callable(getattr(sub, "save_pretrained", None)):
            found[name] = sub
    return found


@dataclass(frozen=True)
class ModelToSave:
    """What ``ThreeDStrategy.save_hf`` writes: a Hugging Face model as a ``from_pretrained`` folder, or a PEFT
    model's adapters as its ``save_pretrained`` writes them (``adapter_config.json`` and the adapters' weights)."""

    attr: str  # its attribute path in the LightningModule
    model: nn.Module
    peft: bool

    def write(self, state: Mapping[str, Any], path: str | os.PathLike) -> Path:
        """Write it from the LightningModule's full state dict ``state`` (rank 0)."""
        if not self.peft:
            return export_hf(state, path, self.model.config, module_attr=self.attr)
        prefix = f"{self.attr}." if self.attr else ""
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        # PEFT picks the adapters' entries by visiting the model's LoRA layers: this rank's model holds its stage's
        # only (pp2 wrote half of them), so a whole stand-in on the meta device is visited instead
        _peft_on_meta(self.model).save_pretrained(str(path), state_dict=own)
        return Path(path)


def _peft_on_meta(peft_model: nn.Module) -> nn.Module:
    """A structure-only copy of a PEFT model, whole (its base model rebuilt from its config on the meta device, the
    same adapters added), for PEFT's ``save_pretrained`` to visit."""
    from peft import get_peft_model

    base = peft_model.get_base_model()  # type: ignore[operator]
    configs = {name: copy.deepcopy(config) for name, config in peft_model.peft_config.items()}  # type: ignore[union-attr]
    names = list(configs)
    with torch.device("meta"):
        skeleton = type(base)(copy.deepcopy(base.config))
        whole = get_peft_model(skeleton, configs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            whole.add_adapter(name, configs[name])
    return whole


def model_to_save(module: nn.Module, module_attr: str | None = None) -> ModelToSave:
    """The model ``save_hf`` writes: the PEFT model ``module_attr`` names, or the only one; else the Hugging Face
    model (:func:`hf_model_attr`, which raises when there is none or ``module_attr`` names none)."""
    peft = peft_models(module)
    key = module_attr.strip(".") if module_attr is not None else None
    if key is not None and key in peft:
        return ModelToSave(key, peft[key], True)
    if key is None and len(peft) == 1:
        attr, model = next(iter(peft.items()))
        return ModelToSave(attr, model, True)
    attr, model = hf_model_attr(module, module_attr)
    return ModelToSave(attr, model, False)


def hf_configs(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{attribute path: config dict}`` of the Hugging Face models in ``module``, to store in a checkpoint.

    Example:
        >>> def on_save_checkpoint(self, checkpoint):  # in a LightningModule  # doctest: +SKIP
        ...     checkpoint[HF_CONFIG_KEY] = hf_configs(self)
    """
    return {name: model.config.to_dict() for name, model in hf_models(module).items()}


def config_from(source: Any) -> Any:
    """A ``PretrainedConfig`` from a config object, a config dict (with ``model_type``), a ``config.json`` file or
    a folder holding one."""
    transformers = _transformers()
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
        if data.get("model_type") not in transformers.CONFIG_MAPPING:
            raise ValueError(
                f"lightning_3d: a Hugging Face config dict needs a known 'model_type', got {data.get('model_type')!r}"
            )
        return transformers.CONFIG_MAPPING[data["model_type"]].from_dict(data)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"lightning_3d: no Hugging Face config at {str(source)!r} (expected config.json)")
    return config_from(json.loads(path.read_text()))


def _model_class(config: Any) -> Any:
    """The class named in ``config.architectures`` when transformers has it, else ``AutoModelForCausalLM``'s."""
    transformers = _transformers()
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def _build_on_meta(config: Any) -> nn.Module:
    cls = _model_class(config)
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an Auto class
            return cls.from_config(config)
        return cls(config)


def infer_prefix(state_dict: Mapping[str, Any], model_keys: list[str]) -> str:
    """The attribute prefix (``"model."``, ``""``) under which ``model_keys`` all appear in ``state_dict``.

    Raises:
        ValueError: no prefix, or more than one, makes every model key a state dict key.
    """
    if not model_keys:
        raise ValueError("lightning_3d: the Hugging Face model has no state dict keys")
    probe = model_keys[0]
    candidates = {k[: -len(probe)] for k in state_dict if k.endswith(probe)}
    found = sorted(
        p for p in candidates if (p == "" or p.endswith(".")) and all(p + k in state_dict for k in model_keys)
    )
    if len(found) != 1:
        what = "no prefix" if not found else f"several prefixes ({', '.join(repr(p) for p in found)})"
        raise ValueError(
            f"lightning_3d: {what} of the state dict holds every key of the Hugging Face model (e.g. {probe!r}); "
            "pass the attribute that holds the model (module_attr / --module-attr)."
        )
    return found[0]


def _prefix(module_attr: str | None) -> str | None:
    if module_attr is None:
        return None
    return f"{module_attr.strip('.')}." if module_attr.strip(".") else ""


def export_hf(
    state_dict: Mapping[str, Tensor],
    out_dir: str | os.PathLike,
    config: Any,
    *,
    module_attr: str | None = None,
) -> Path:
    """Write the Hugging Face model held in a LightningModule's full state dict as a ``from_pretrained`` folder.

    Args:
        state_dict: single-device state dict keyed like the LightningModule (e.g. from
            :func:`lightning_3d.checkpoint.load_consolidated` or ``module.state_dict()``).
        out_dir: the folder to write (created; existing files of the same names are replaced).
        config: the model's config: a ``PretrainedConfig``, a config dict, a ``config.json`` or a folder with one.
        module_attr: attribute path of the model in the LightningModule (``"model"``; ``""`` when the state dict
            is the model's own); inferred from the keys when None.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: the prefix cannot be inferred; keys missing; weights the config ties that differ.

    Example:
        >>> export_hf(module.state_dict(), "hf_out", module.model.config, module_attr="model")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("hf_out")  # doctest: +SKIP
    """
    config = config_from(config)
    model = _build_on_meta(config)
    keys = list(model.state_dict().keys())
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    # a tied weight's other names: lightning_3d checkpoints store it once, under its first name
    alias_of = {other: names[0] for names in groups.values() for other in names[1:]}
    required = [k for k in keys if k not in alias_of]
    prefix = _prefix(module_attr)
    if prefix is None:
        prefix = infer_prefix(state_dict, required)
    own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    for alias, canonical in alias_of.items():
        if alias not in own and canonical in own:
            own[alias] = own[canonical]
    missing = [k for k in keys if k not in own]
    if missing:
        raise ValueError(
            f"lightning_3d: the state dict lacks {len(missing)} keys of {type(model).__name__} under prefix "
            f"{prefix!r}, e.g. {', '.join(missing[:3])}"
        )
    own = {k: own[k] for k in keys}  # only the model's keys (the LightningModule may hold more)
    for names in groups.values():
        first = own[names[0]]
        for other in names[1:]:
            if own[other] is not first and not torch.equal(own[other], first):
                raise ValueError(
                    f"lightning_3d: {type(model).__name__} ties {names[0]} and {other} (config.tie_word_embeddings="
                    f"{getattr(config, 'tie_word_embeddings', None)}), but the state dict holds different values "
                    "for them; export with a config that unties them."
                )
    model.load_state_dict(own, assign=True, strict=True)
    model.tie_weights()  # assign=True gave each name its own tensor; tie them again so they are stored once
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def read_hf_folder(
    folder: str | os.PathLike,
    module: nn.Module | None = None,
    *,
    module_attr: str | None = None,
    model_class: Any = None,
) -> dict[str, Tensor]:
    """The state dict of a Hugging Face model folder, keyed like the LightningModule that holds the model.

    The folder is read with ``from_pretrained`` (any checkpoint transformers loads: safetensors, sharded
    index, renamed legacy keys), on CPU in the dtype it was saved in; tied weights appear under every name
    the LightningModule's ``state_dict()`` has.

    Args:
        folder: the Hugging Face model folder.
        module: the LightningModule the state dict is for: the model class and attribute are taken from the
            Hugging Face model it holds (it must hold exactly one unless ``module_attr`` is given).
        module_attr: attribute path of the model (``"model"``); default: from ``module``, else ``"model"``.
        model_class: class to load with when no ``module`` is given (default: from ``config.architectures``,
            else ``AutoModelForCausalLM``).

    Returns:
        ``{prefix + key: tensor}``.

    Example:
        >>> trainer.strategy.load_full_state_dict(read_hf_folder("hf_out", module))  # doctest: +SKIP
    """
    cls = model_class
    if module is not None:
        found = hf_models(module)
        if module_attr is not None:
            if module_attr.strip(".") not in found:
                raise ValueError(
                    f"lightning_3d: {type(module).__name__} has no Hugging Face model at {module_attr!r} "
                    f"(found: {sorted(found) or 'none'})"
                )
            target = found[module_attr.strip(".")]
        elif len(found) == 1:
            module_attr, target = next(iter(found.items()))
        else:
            raise ValueError(
                f"lightning_3d: {type(module).__name__} holds {len(found)} Hugging Face models "
                f"({sorted(found)}); pass module_attr"
            )
        cls = type(target)
    if cls is None:
        cls = _model_class(config_from(folder))
    model = cls.from_pretrained(os.fspath(folder), dtype="auto")
    prefix = _prefix("model" if module_attr is None else module_attr)
    return {f"{prefix}{k}": v for k, v in model.state_dict().items()}


__all__ = [
    "HF_CONFIG_KEY",
    "config_from",
    "export_hf",
    "hf_configs",
    "infer_prefix",
    "is_hf_folder",
    "read_hf_folder",
]


def hf_model_attr(module: nn.Module, module_attr: str | None = None) -> tuple[str, nn.Module]:
    """The attribute path and the module of the Hugging Face model in ``module`` (``module_attr`` names it when
    there are several).

    Raises:
        ValueError: none, or several and ``module_attr`` not one of them.
    """
    models = hf_models(module)
    if module_attr is not None and module_attr.strip(".") in models:
        return module_attr.strip("."), models[module_attr.strip(".")]
    if module_attr is None and len(models) == 1:
        return next(iter(models.items()))
    names = ", ".join(repr(name) for name in models) or "none"
    raise ValueError(
        f"lightning_3d: {type(module).__name__} holds these Hugging Face models: {names}; "
        + ("pass module_attr= to name one." if module_attr is None else f"{module_attr!r} is not one of them.")
    )


def guard_save_pretrained(module: nn.Module, where: str) -> Callable[[], None]:
    """While ``ThreeDStrategy`` runs a split or sharded model: a Hugging Face model's own ``save_pretrained``
    (without ``state_dict=``), or a PEFT model's (which writes the adapters), raises with the way that works instead
    of writing this rank's part (a PEFT model at pp2 wrote stage 0's adapters alone).

    The Hugging Face habit, ``if self.global_rank == 0: self.model.save_pretrained(path)`` in ``on_train_end``,
    wrote pipeline stage 0's weights alone at pp2 (the folder loaded, with the other layers newly initialised and a
    "MISSING" report) and died at dp2 ("Attempted to access the data pointer on an invalid python storage").
    ``where`` names this rank's part in the message. Returns the undo (for teardown).
    """
    undo: list[Callable[[], None]] = []
    for attr, model in {**hf_models(module), **peft_models(module)}.items():
        original = model.save_pretrained

        def guarded(save_directory: Any, *args: Any, _original: Any = original, _attr: str = attr, **kw: Any) -> Any:
            if kw.get("state_dict") is not None:  # the caller gathered the weights itself
                return _original(save_directory, *args, **kw)
            target = f"self.{_attr}" if _attr else "self"
            raise RuntimeError(
                f"lightning_3d: {target}.save_pretrained({str(save_directory)!r}) on this rank would write {where} "
                "only: ThreeDStrategy has split and sharded the model. Call trainer.strategy.save_hf(path) instead, "
                "on every rank (it gathers the whole model, and rank 0 writes the folder with the model's own "
                "save_pretrained); or export a checkpoint afterwards: python -m lightning_3d.checkpoint export-hf "
                "CKPT_DIR OUT_DIR."
            )

        model.save_pretrained = guarded
        undo.append(lambda _model=model: _model.__dict__.pop("save_pretrained", None))

    def undo_all() -> None:
        for step in undo:
            step()

    return undo_all
