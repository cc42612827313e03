"""Bucketed data-parallel gradient reduction, overlapped with the last micro-batch's backward (2 ranks).

One launch of scripts/dp_buckets.py: a replicate group per layer (a tied pair stays with the root), one
all-reduce per bucket per optimizer step, every one issued while the last micro-batch's backward runs, none in a
batch that defers the sync (gradient accumulation), and the gradients equal to a single process's averaged by
hand; then gradient compression (grad_reduce_dtype="bf16", replicate and fsdp) against fp32 reduction.
Parity of whole training runs with dp is in test_parity.py.
"""

from __future__ import annotations

import pytest

from launch import run_ranks


@pytest.mark.slow
def test_one_all_reduce_per_bucket_inside_the_last_backward():
    result = run_ranks("dp_buckets.py", 2, timeout=120)
    assert result.output.count("dp buckets ok (3 all-reduces, all inside the last backward)") == 2, result.tail()
    for mode in ("replicate", "fsdp"):
        assert result.output.count(f"{mode} bf16 reduction ok") == 2, result.tail()
