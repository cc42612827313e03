"""A PEFT LoRA Llama (adapters on q/v/o and the MLP's down projection: column- and row-parallel base layers; on the
token embedding: a vocabulary-parallel base with whole adapters; the head trained whole as a ``modules_to_save``
copy) built in ``configure_model``, against one device (float64).

On fit start each rank reports whether its LoRA ``B`` matrices are zero and its ``A`` matrices not (PEFT's
initialisation; on the meta device the model's ``_init_weights`` drew both from a normal) and whether the head's
trained copy equals its original (PEFT deep-copies it), then the 3D run loads one
device's initial weights (``strategy.load_full_state_dict``) and trains four AdamW steps on the adapters only, with
the step's own float64 loss. Rank 0 writes to ``OUT`` every rank's report, the logged training losses, the
validation loss, and the largest differences from one device's final weights, adapters and frozen base apart. At the
end the adapters are written as one device writes them (``save_pretrained`` there, ``strategy.save_hf`` here, after
rank 0's ``self.model.save_pretrained`` was refused), and the two files compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import LossSteps, OrderedData, hf_config, quiet_trainer

LAYOUTS = {"single": None, "tp2pp2": {"tp": 2, "pp": 2}, "pp2fsdp": {"pp": 2, "data_parallel": "fsdp"}}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj", "embed_tokens"]


class LoRALlama(LossSteps):
    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation="eager")
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=["lm_head"])
        self.model = get_peft_model(base, config)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Start(L.Callback):
    """Report PEFT's initialisation as built, then start the 3D run from one device's initial weights."""

    def __init__(self, init: Path) -> None:
        self.init = init
        self.report: dict[str, object] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        named = [(n, _local(p.detach())) for n, p in pl_module.named_parameters() if "lora_" in n]
        self.report = {
            "adapters": len(named),
            "b_zero": all(bool((p == 0).all()) for n, p in named if "lora_B" in n),
            "a_nonzero": all(bool((p != 0).any()) for n, p in named if "lora_A" in n),
            # on the embedding PEFT does it the other way round: A zero, B drawn (on the first stage)
            # (name, all zero, all finite, sum: the tp ranks of the first stage must draw the same B)
            "embedding": [
                [n.split(".")[-2], bool((p == 0).all()), bool(p.isfinite().all()), float(p.sum())]
                for n, p in named
                if "lora_embedding_" in n
            ],
            # which of the embedding's base weight and adapters are DTensors (at tp2: the base alone, sharded)
            "embedding_dtensors": [
                isinstance(p, DTensor)
                for n, p in pl_module.named_parameters()
                if "embed_tokens.base_layer" in n or "lora_embedding_" in n
            ],
        }
        params = {n: _local(p.detach()) for n, p in pl_module.named_parameters()}
        copies = [n for n in params if ".modules_to_save.default." in n]  # on the last stage
        self.report["copy_is_original"] = all(
            torch.equal(params[n], params[n.replace(".modules_to_save.default.", ".original_module.")]) for n in copies
        )
        if trainer.world_size == 1:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.init)
        else:
            assert trainer.strategy.load_full_state_dict(torch.load(self.init)).loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--ref", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    layout = LAYOUTS[args.layout]
    dp = 1 if layout is None else 4 // (layout.get("tp", 1) * layout["pp"])
    kwargs = (
        {"devices": 1}
        if layout is None
        else {"devices": 4, "strategy": ThreeDStrategy(micro_batches=2, train_timeout=120, **layout)}
    )
    start = Start(args.init)
    trainer = quiet_trainer(
        precision="64-true",
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        callbacks=[start],
        **kwargs,
    )
    model = LoRALlama()
    trainer.fit(model, datamodule=OrderedData("llama", batch_size=8 // dp, n=64, val_n=16))
    reports = [start.report]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, start.report)
    final = trainer.strategy.full_state_dict() if layout is not None else model.state_dict()
    adapters_dir = args.out.with_suffix(".adapters")
    refused = None
    if layout is None:
        model.model.save_pretrained(str(adapters_dir))
    else:
        if trainer.global_rank == 0:  # the Hugging Face habit: it would write this rank's stage alone
            try:
                model.model.save_pretrained(str(adapters_dir))
            except RuntimeError as err:
                refused = str(err)
        trainer.strategy.save_hf(adapters_dir)  # collective: every adapter, as one device writes them
    if trainer.global_rank != 0:
        return
    row = {"reports": reports, "train": model.train_losses, "val": float(trainer.callback_metrics["val_loss"])}
    row["refused"] = refused
    if args.ref is None:
        torch.save({k: v.detach().clone() for k, v in final.items()}, args.out.with_suffix(".pt"))
    else:
        ref, init = torch.load(args.ref), torch.load(args.init)
        adapters = [k for k in ref if "lora_" in k or ".modules_to_save." in k]  # trained; the rest frozen
        row["adapter_diff"] = max(float((final[k] - ref[k]).abs().max()) for k in adapters)
        row["adapters_moved"] = max(float((ref[k] - init[k]).abs().max()) for k in adapters)
        row["base_diff"] = max(float((final[k] - init[k]).abs().max()) for k in ref if k not in adapters)
        from safetensors.torch import load_file

        mine = load_file(str(adapters_dir / "adapter_model.safetensors"))
        theirs = load_file(str(args.ref.with_suffix(".adapters") / "adapter_model.safetensors"))
        row["saved_keys_equal"] = sorted(mine) == sorted(theirs)
        row["saved_diff"] = max(float((mine[k] - theirs[k]).abs().max()) for k in theirs if k in mine)
        configs = [
            json.loads((d / "adapter_config.json").read_text())
            for d in (adapters_dir, args.ref.with_suffix(".adapters"))
        ]
        for config in configs:  # a set in PEFT: its order is the hash seed's
            config["target_modules"] = sorted(config["target_modules"])
        row["saved_config_equal"] = configs[0] == configs[1]
    args.out.write_text(json.dumps(row))


if __name__ == "__main__":
    main()
