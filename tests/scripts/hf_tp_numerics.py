"""Hugging Face plans sharded vs unsharded (run with 2 ranks, gloo, float64).

For tiny ``LlamaForCausalLM`` (GQA: 4 heads, 2 kv heads), ``Qwen3ForCausalLM`` (q_norm / k_norm, embedding
tied to the LM head) and ``GPT2LMHeadModel`` (Conv1D, tied embedding): build the model once, hold it in a
LightningModule-like root as ``self.model``, shard a deep copy with
``parallelize_module(root, tp_mesh, hf_tp_plan(root, 2).styles)``, then run two forward/backward passes
(``model(input_ids=..., labels=...).loss``; gradients accumulate as over micro-batches) and one SGD step on both,
and compare the losses, every parameter's gradient (``full_tensor()`` of DTensors) and every updated parameter
with the unsharded model, within 1e-10. Also checks that tied parameters are still one parameter and that each
rank holds half of every sharded parameter. The ``-meta`` variants build the sharded model on the meta device,
shard it there and materialise it with ``to_empty`` (ties must survive both). Raises (exit code != 0) on any
mismatch.
"""

from __future__ import annotations

import copy
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from lightning_3d.core.tensor_parallel.hf_plan import hf_tp_plan

TOL = 1e-10
VOCAB = 64

CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-gqa": (
        "llama",
        dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2),
    ),
    "qwen3-tied": (
        "qwen3",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
    ),
    "gpt2": (
        "gpt2",
        dict(
            n_embd=32,
            n_head=4,
            n_layer=2,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


class Root(nn.Module):
    """Stands for a LightningModule that holds the Hugging Face model as ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def build(kind: str, kwargs: dict, device: str = "cpu") -> Root:
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, use_cache=False, **kwargs)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    if device != "meta":
        with torch.no_grad():  # non-trivial norm weights, so their gradients are not all alike
            for name, param in model.named_parameters():
                if "norm" in name or "ln_" in name:
                    param.add_(0.1 * torch.randn_like(param))
    return Root(model)


def sharded_from_meta(kind: str, kwargs: dict, ref: Root, mesh) -> tuple[Root, object]:  # type: ignore[no-untyped-def]
    """The way a strategy builds a big model: on the meta device, sharded there, then materialised (``to_empty``)
    and filled with each rank's slices of the reference's values."""
    model = build(kind, kwargs, device="meta")
    plan = hf_tp_plan(model, 2)
    assert plan is not None
    parallelize_module(model, mesh, plan.styles)
    assert len(plan.ties) == 0, "the tied-parameter registry kept entries after sharding"
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter is listed once
            full_value = ref.get_parameter(name)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full_value, mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full_value)
        for name, b in model.named_buffers():  # RoPE's inv_freq: not persistent, recomputed by HF's init
            b.copy_(ref.get_buffer(name))
    return model, plan


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(name: str, kind: str, kwargs: dict, mesh, rank: int, meta: bool) -> None:  # type: ignore[no-untyped-def]
    ref = build(kind, kwargs)
    if meta:
        sharded, plan = sharded_from_meta(kind, kwargs, ref, mesh)
    else:
        sharded = copy.deepcopy(ref)
        plan = hf_tp_plan(sharded, 2)
        assert plan is not None, f"{name}: no plan"
        parallelize_module(sharded, mesh, plan.styles)

    for group in plan.tied:
        objs = {id(sharded.get_parameter(n)) for n in group}
        assert len(objs) == 1, f"{name}: tied parameters {group} were untied by sharding"
    expect_tied = kind in ("qwen3", "gpt2")
    assert bool(plan.tied) == expect_tied, f"{name}: tied groups {plan.tied}"

    n_dtensor = 0
    for pname, p in sharded.named_parameters():
        p_ref = ref.get_parameter(pname)
        if isinstance(p, DTensor):
            n_dtensor += 1
            assert p.to_local().numel() * 2 == p_ref.numel() or "bias" in pname, f"{name}: {pname} not halved"
            assert torch.equal(p.full_tensor(), p_ref), f"{name}: {pname} sharded with other values"
    assert n_dtensor >= 6, f"{name}: only {n_dtensor} DTensor parameters"

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]
    losses = []
    for ids in batches:  # two backward passes: gradients accumulate, as over micro-batches
        loss_ref = ref.model(input_ids=ids, labels=ids).loss
        loss_ref.backward()
        loss = sharded.model(input_ids=ids, labels=ids).loss
        assert not isinstance(loss, DTensor), f"{name}: the loss is a DTensor"
        loss.backward()
        # Hugging Face's loss upcasts the logits with .float(), i.e. to float32 here: the two losses agree to
        # 1e-10 because logits that agree to ~1e-15 round to the same float32 values (a different rounding of
        # one logit would show as a ~1e-7 difference; with these seeds it does not happen).
        diff = abs(loss.item() - loss_ref.item())
        assert diff < TOL, f"{name}: loss {loss.item()} vs {loss_ref.item()} (diff {diff})"
        assert math.isfinite(loss.item())
        losses.append(loss.item())

    ref_params = dict(ref.named_parameters())
    params = dict(sharded.named_parameters())
    assert params.keys() == ref_params.keys(), f"{name}: parameter names changed"
    for pname, p_ref in ref_params.items():
        grad = params[pname].grad
        assert grad is not None and p_ref.grad is not None, f"{name}: {pname} has no gradient"
        worst = (full(grad) - p_ref.grad).abs().max().item()
        assert worst < TOL, f"{name}: gradient of {pname} differs by {worst}"
        if not isinstance(grad, DTensor):  # replicated: every rank must hold the same gradient
            others = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(others, grad.contiguous())
            assert torch.equal(others[0], others[1]), f"{name}: replicated gradient of {pname} differs across ranks"

    for model in (ref, sharded):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for pname, p_ref in ref_params.items():
        worst = (full(params[pname].detach()) - p_ref.detach()).abs().max().item()
        assert worst < TOL, f"{name}: parameter {pname} after a step differs by {worst}"
    if rank == 0:
        print(f"{name}: tp=2 ok ({n_dtensor} sharded parameters, losses {losses[0]:.6f} {losses[1]:.6f})", flush=True)


def main() -> None:
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with 2 ranks"
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    only = sys.argv[1:] or [*CONFIGS, "qwen3-tied-meta", "gpt2-meta"]
    for name in only:
        kind, kwargs = CONFIGS[name.removesuffix("-meta")]
        check(name, kind, kwargs, mesh, rank, meta=name.endswith("-meta"))
    dist.barrier()
    if rank == 0:
        print("all hf tensor-parallel numerics ok", flush=True)
    dist.destroy_process_group()
    # Skip interpreter finalization, as tp_numerics.py does: gloo worker threads that still hold finished async
    # work objects can abort the process there (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
