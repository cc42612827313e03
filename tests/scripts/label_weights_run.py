"""A Hugging Face causal LM fine-tuned on padded, prompt-masked batches (``labels == -100``), against one device.

The batches are mappings (``input_ids``, ``attention_mask``, ``labels``) as Hugging Face's collators make them: each
sample has its own length (padding after it) and its own prompt (no loss there), so micro-batches and data-parallel
replicas hold different numbers of label tokens. The model's loss is the mean over the batch's label tokens; one
device's gradients and logged loss are that mean over the whole batch. ``--weighting``: the strategy's
``loss_weighting``; ``--loss``: the model's own loss or the step's (see ``PaddedLM``). Rank 0 writes to ``OUT`` the
logged training losses per step, the callback metrics at the end (validation loss, token accuracy), the final
parameters' largest difference from one device's (``--ref``), the label-token counts of each micro-batch of the
first batch (they must differ, or sample weighting would be exact too) and the fewest label tokens of a sample (0:
at one sample per micro-batch, a micro-batch whose mean loss is NaN, which one device never sees).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy

from models import LossSteps, hf_config, quiet_trainer

LAYOUTS = {"single": None, "pp2dp2": {"pp": 2}, "tp2pp2": {"tp": 2, "pp": 2}, "dp4": {}}
BATCH, LENGTH, MICRO = 8, 12, 2


class Padded(Dataset):
    """Token rows of random lengths, padded with 0; labels -100 on the padding and on a 1-5 token prompt."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(4, LENGTH + 1, (1,), generator=g))
            prompt = int(torch.randint(1, 6, (1,), generator=g))
            ids = torch.randint(1, 32, (LENGTH,), generator=g)
            ids[length:] = 0
            mask = (torch.arange(LENGTH) < length).long()
            labels = ids.clone()
            labels[length:] = -100
            labels[:prompt] = -100
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


class PaddedLM(LossSteps):
    """``loss="hf"``: the model's own ``.loss`` (Hugging Face computes it in float32 from float64 logits);
    ``loss="own"``: the step's own float64 token mean over the shifted labels, and a token accuracy logged."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss = loss

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation="eager")

    def _loss(self, batch) -> torch.Tensor:
        if self.loss == "hf":
            return self.model(**batch).loss
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        kept = labels.ne(-100)
        self.log("token_acc", (logits.argmax(-1) == labels)[kept].to(logits.dtype).mean())
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def _loader(self, ds: Dataset) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(Padded(32, seed=0))

    def val_dataloader(self) -> DataLoader:
        return self._loader(Padded(16, seed=1))


class LoadInit(L.Callback):
    """The 3D run starts from one device's initial weights."""

    def __init__(self, init: Path) -> None:
        self.init = init

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.world_size > 1:
            assert trainer.strategy.load_full_state_dict(torch.load(self.init)).loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--weighting", default="auto")
    parser.add_argument("--loss", choices=("hf", "own"), default="hf")
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--ref", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    L.seed_everything(0)
    layout = LAYOUTS[args.layout]
    world = 1 if layout is None else 4
    dp = 1 if layout is None else world // (layout.get("tp", 1) * layout.get("pp", 1))
    model = PaddedLM(args.loss)
    if layout is None:
        model.configure_model()
        torch.save(model.state_dict(), args.init)
        kwargs = {"devices": 1}
    else:
        strategy = ThreeDStrategy(micro_batches=MICRO, loss_weighting=args.weighting, train_timeout=120, **layout)
        kwargs = {"devices": world, "strategy": strategy}
    trainer = quiet_trainer(
        precision="64-true",
        max_epochs=1,
        limit_val_batches=2,
        callbacks=[LoadInit(args.init)],
        use_distributed_sampler=False,
        **kwargs,
    )
    trainer.fit(model, datamodule=Data(BATCH // dp))
    final = trainer.strategy.full_state_dict() if layout is not None else model.state_dict()
    if trainer.global_rank != 0:
        return
    first = next(iter(DataLoader(Padded(32, seed=0), batch_size=BATCH)))["labels"][:, 1:]
    counts = first.ne(-100).sum(1).view(dp * MICRO, -1).sum(1).tolist()  # the first batch's micro-batches
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    fewest = int(torch.stack([r["labels"][1:].ne(-100).sum() for r in Padded(32, seed=0).rows]).min())
    row = {"train": model.train_losses, "metrics": metrics, "counts": counts, "fewest_labels": fewest}
    if args.ref is not None:
        ref = torch.load(args.ref)
        row["param_diff"] = max(float((final[k] - ref[k]).abs().max()) for k in ref)
    else:
        torch.save({k: v.detach().clone() for k, v in final.items()}, args.out.with_suffix(".pt"))
    args.out.write_text(json.dumps(row))


if __name__ == "__main__":
    main()
