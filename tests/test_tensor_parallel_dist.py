"""Sharded vs unsharded numerics of the automatic plan, with 2 and 4 gloo processes (float64).

The script (``scripts/tp_numerics.py``) builds each model, shards a deep copy with
``parallelize_module(copy, mesh, plan.styles_for(...))`` and compares the output and every
gradient with the unsharded model within 1e-10 (GPT-like with SDPA, nanoGPT-style manual attention
with a padding index applied layer by layer, GQA, an MLP chain whose pairs cross Sequential layers,
SwiGLU, and attention that views by its own head-count attributes as OPT and StableLM do, with and
without GQA, under the automatic plan and under an explicit one: the attributes set to one rank's
heads; per-head q/k norms and a learned scalar gate on the MLP's hidden features, whose gradients are
summed over tp; and a block that adds its residual in place into the MLP's row-parallel output, which
the plan copies). It also shows that forcing a shard on attention with a head count the analysis cannot trace
to an attribute gives wrong numbers, which is why the analysis leaves that one replicated (and warns
when an explicit plan shards it).
"""

from __future__ import annotations

import pytest

from launch import run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_numerics_match_unsharded(tp: int) -> None:
    result = run_ranks("tp_numerics.py", tp, timeout=120)
    names = ("gpt", "gpt-manual-attn-padding-idx", "gpt-gqa", "gpt-head-count-attrs", "gpt-gqa-head-count-attrs")
    more = ("gpt-qk-norm-gated-mlp", "gpt-inplace-residual", "explicit-head-count-attrs-qk-norm")
    for name in (*names, "mlp", "swiglu", *more):
        assert f"{name}: tp={tp} ok" in result.output, result.tail()
    assert "hard-coded heads: auto plan left them replicated" in result.output, result.tail()
    assert "all tensor-parallel numerics ok" in result.output, result.tail()
