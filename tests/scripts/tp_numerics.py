"""Sharded vs unsharded numerics of automatic tensor-parallel plans (run with N ranks, gloo, float64).

For each model: build it with a fixed seed, deep-copy it, shard the copy with
``parallelize_module(copy, mesh, plan.styles_for(...))``, run forward + backward on the same input,
and compare the output and every gradient (DTensor gradients via ``full_tensor()``) with the
unsharded module. Also checks that each rank holds exactly ``local_numel`` elements of each
parameter and that the plan sharded what it should. Raises (exit code != 0) on any mismatch.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_models import Attention, Block, Embed, Head, gpt, mlp_chain, swiglu_model

from lightning_3d.core.tensor_parallel import local_numel, resolve_plan
from lightning_3d.core.tensor_parallel.styles import LocalHeadCounts, style_kind

TOL = 1e-10
ATTENTION_PAIR = {"*.attn.[qkv]_proj": "colwise", "*.attn.out_proj": "rowwise"}


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def check(
    name: str,
    build: Callable[[], nn.Sequential],
    x: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    min_sharded: int,
    per_layer: bool,
    mesh,
    tp: int,
    explicit: dict[str, str] | None = None,
) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ref = build().double()
    model = copy.deepcopy(ref)
    plan = resolve_plan(model, tp, explicit=explicit)
    sharded = [f for f, e in plan.entries.items() if e.style != "replicate"]
    assert len(sharded) >= min_sharded, f"{name}: only {sharded} sharded; notes: {plan.notes}"
    if per_layer:  # the way a pipeline stage applies it: one top-level layer at a time
        for i, layer in enumerate(model):
            styles = plan.styles_for(str(i))
            if styles:
                parallelize_module(layer, mesh, styles)
    else:
        parallelize_module(model, mesh, plan.styles_for(""))
    assert bool(plan.copied) == ("inplace" in name), f"{name}: outputs copied for {plan.copied}"
    summed = {f for f, e in plan.entries.items() if style_kind(e.style) == "grad_allreduce"}
    assert bool(summed) == ("qk-norm" in name), f"{name}: gradients summed for {summed}"
    counted = {f: e.style for f, e in plan.entries.items() if isinstance(e.style, LocalHeadCounts)}
    assert bool(counted) == ("head-count" in name), f"{name}: head counts set on {list(counted)}"
    for fqn, style in counted.items():
        held = {a: getattr(model.get_submodule(fqn), a) for a in style.counts}
        assert held == style.local_counts(tp), f"{name}: {fqn} holds {held}, not one rank's counts"

    out_ref = ref(x)
    loss_fn(out_ref, target).backward()
    out = model(x)
    assert not isinstance(out, DTensor), f"{name}: the body returned a DTensor"
    loss_fn(out, target).backward()
    worst = (out - out_ref).abs().max().item()
    assert worst < TOL, f"{name}: output differs by {worst}"

    params = dict(model.named_parameters())
    assert params.keys() == dict(ref.named_parameters()).keys(), f"{name}: parameter names changed"
    n_dtensor = 0
    for pname, p_ref in ref.named_parameters():
        p = params[pname]
        local = p.to_local() if isinstance(p, DTensor) else p
        n_dtensor += isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        expected = local_numel(pname, tuple(p_ref.shape), plan, tp)
        assert local.numel() == expected, f"{name}: {pname} holds {local.numel()} elements, expected {expected}"
        assert p.grad is not None and p_ref.grad is not None, f"{name}: {pname} has no gradient"
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        diff = (grad - p_ref.grad).abs().max().item()
        assert diff < TOL, f"{name}: gradient of {pname} differs by {diff}"
    assert n_dtensor >= min_sharded, f"{name}: only {n_dtensor} sharded parameters"
    if dist.get_rank() == 0:
        print(f"{name}: tp={tp} ok, {len(sharded)} modules sharded, output diff {worst:.2e}", flush=True)


def check_hard_coded_heads_is_wrong(tokens: torch.Tensor, mesh, tp: int) -> None:  # type: ignore[no-untyped-def]
    """Why the analysis refuses ``view(B, T, 4, -1)`` with a count it cannot trace to a head-count attribute:
    forced shardings give silently wrong numbers."""
    torch.manual_seed(0)
    attn = Attention(16, 4, hard_coded="literal")
    ref = nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, attn=attn)).double()
    model = copy.deepcopy(ref)
    auto = resolve_plan(model, tp)
    assert "1.attn.q_proj" in auto.notes and "1.attn.q_proj" not in auto.entries, "hard-coded heads were sharded"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = resolve_plan(model, tp, explicit=ATTENTION_PAIR)
    assert any("gives wrong numbers" in str(w.message) for w in caught), "no warning for an unfit explicit pair"
    parallelize_module(model, mesh, forced.styles_for(""))
    diff = (model(tokens) - ref(tokens)).abs().max().item()
    assert diff > 1e-6, f"forcing a shard on hard-coded heads should change the output, diff {diff}"
    if dist.get_rank() == 0:
        print(f"hard-coded heads: auto plan left them replicated; forced shard differs by {diff:.2e}", flush=True)


def main() -> None:
    start = time.monotonic()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    torch.manual_seed(1)
    tokens = torch.randint(0, 32, (2, 8))
    tokens[:, 0] = 0  # the padding index of the padded variant
    targets = torch.randint(0, 32, (2, 8))
    feats, feat_target = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    cases = [
        # name, builder, input, target, loss, at least this many sharded modules, apply per layer
        ("gpt", lambda: gpt(heads=4, layers=2), tokens, targets, lm_loss, 15, False),
        (
            "gpt-manual-attn-padding-idx",
            lambda: gpt(manual=True, padding_idx=0, layers=1),
            tokens,
            targets,
            lm_loss,
            9,
            True,
        ),
        ("gpt-gqa", lambda: gpt(heads=8, kv_heads=4, layers=1), tokens, targets, lm_loss, 9, False),
        # attention that views by its own head-count attributes (OPT, StableLM): those set to the rank's share
        ("gpt-head-count-attrs", lambda: gpt(heads=4, layers=2, hard_coded="attr"), tokens, targets, lm_loss, 15, True),
        (
            "gpt-gqa-head-count-attrs",
            lambda: gpt(heads=8, kv_heads=4, layers=1, hard_coded="attr"),
            tokens,
            targets,
            lm_loss,
            9,
            False,
        ),
        ("mlp", lambda: mlp_chain((8, 16, 16, 8)), feats, feat_target, mse, 3, True),
        ("swiglu", lambda: swiglu_model(layers=2), tokens, targets, lm_loss, 17, False),
    ]
    for name, build, x, target, loss_fn, n, per_layer in cases:
        check(name, build, x, target, loss_fn, n, per_layer, mesh, tp)
    # learned parameters meeting only sharded tensors (per-head q/k norms; a scalar gate on the MLP's hidden
    # features): sharded, those gradients summed over tp
    qk_norm = lambda: gpt(heads=8, kv_heads=4, layers=2, qk_norm=True, gated=True)  # noqa: E731
    check("gpt-qk-norm-gated-mlp", qk_norm, tokens, targets, lm_loss, 15, True, mesh, tp)
    # a row-parallel output the block modifies in place (`out += x`): the plan copies that output
    inplace = lambda: nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, inplace=True), Head(16, 32))  # noqa: E731
    check("gpt-inplace-residual", inplace, tokens, targets, lm_loss, 9, False, mesh, tp)
    # the user's own plan for such attention: its head counts are set per rank as under the automatic plan
    # (and its per-head q/k norms their gradients summed)
    attrs = lambda: gpt(heads=8, kv_heads=4, layers=1, hard_coded="attr", qk_norm=True)  # noqa: E731
    name = "explicit-head-count-attrs-qk-norm"
    check(name, attrs, tokens, targets, lm_loss, 5, False, mesh, tp, explicit=ATTENTION_PAIR)
    check_hard_coded_heads_is_wrong(tokens, mesh, tp)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"all tensor-parallel numerics ok in {time.monotonic() - start:.1f}s", flush=True)
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo worker threads that still hold finished async work
    # objects can abort the process there (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
