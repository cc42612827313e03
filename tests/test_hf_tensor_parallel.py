"""Hugging Face models under their own tensor-parallel plans: sharded vs unsharded numerics (2 gloo ranks).

The script (``scripts/hf_tp_numerics.py``) shards tiny Llama (GQA), Qwen3 (q_norm / k_norm, tied embedding)
and GPT-2 (Conv1D, tied embedding) with ``parallelize_module(root, tp_mesh, hf_tp_plan(root, 2).styles)`` and
compares the loss of two accumulated forward/backward passes, every gradient and the parameters after one SGD
step with the unsharded model in float64 (1e-10), and that tied parameters stay one parameter, also when the
model is built and sharded on the meta device and then materialised.
"""

from __future__ import annotations

import pytest

from launch import run_ranks


@pytest.mark.slow
def test_hf_plans_match_unsharded_numerics() -> None:
    result = run_ranks("hf_tp_numerics.py", 2, timeout=240)
    for name in ("llama-gqa", "qwen3-tied", "gpt2", "qwen3-tied-meta", "gpt2-meta"):
        assert f"{name}: tp=2 ok" in result.output, result.tail()
    assert "all hf tensor-parallel numerics ok" in result.output, result.tail()
