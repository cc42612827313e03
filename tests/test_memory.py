"""A model built in configure_model is never materialised whole, and each rank holds exactly its share.

scripts/memory_run.py builds the example GPT's "xl" preset (1.2B parameters, 4.8 GB in float32) at
tp2 x pp2 on four CPU ranks. Each rank's peak RSS may grow by its quarter of the model plus one layer being
sharded (well under half the model), and it must hold exactly its stage's parameters, the Megatron-sharded
ones split in two (an independent count: column-parallel weights and biases, row-parallel weights,
vocabulary-parallel embeddings and the gathered LM head are split; norms and row-parallel biases are not).
"""

from __future__ import annotations

import math

import pytest
import torch

from launch import run_lightning

SHARDED = ("wte.", "wpe.", "q_proj.", "k_proj.", "v_proj.", "fc.", "out_proj.weight", "proj.weight", "lm_head.")


@pytest.mark.slow
def test_xl_gpt_built_sharded_on_four_ranks(tmp_path):
    run_lightning("memory_run.py", ["--out", tmp_path, "--preset", "xl", "--steps", 0], timeout=420)
    record = torch.load(tmp_path / "memory.pt", weights_only=False)
    full = {name: math.prod(shape) for name, shape in record["full_shapes"].items()}
    full_bytes = 4 * sum(full.values())
    assert full_bytes > 4e9
    owners: dict[str, set[int]] = {}
    for rank in record["ranks"]:
        pp_rank, _ = rank["coords"]
        for name, numel in rank["numels"].items():
            expected = full[name] // 2 if any(key in name for key in SHARDED) else full[name]
            assert numel == expected, (rank["coords"], name, numel, expected)
            owners.setdefault(name, set()).add(pp_rank)
        assert rank["growth"] < 0.5 * full_bytes, (rank["coords"], rank["growth"] / 1e9)
    assert all(len(owners.get(name, ())) == 1 for name in full), "every parameter on exactly one stage"
