"""Models as people write them train under ThreeDStrategy with single-device numbers.

Not one nn.Sequential: a nanoGPT-style model (blocks in an nn.ModuleList inside an nn.ModuleDict, untied and with
the LM head tied to the token embedding) and unmodified Hugging Face causal LMs (Llama: GQA, RoPE, SwiGLU, RMSNorm;
Qwen3: q/k norms; GPT-2: Conv1D, learned positions, tied embeddings), each wrapped in a LightningModule whose
training_step calls the model as usual (``self.model(input_ids=x, labels=x).loss``). Every layout is checked
against one process on the same global batches (tests/scripts/parity_run.py): float64 step-1 gradients within
1e-10 and float32 20-step curves (Adam, clipping, LR schedule) within 1e-4 relative, data-parallel replicas
bitwise identical.
"""

from __future__ import annotations

import pytest

from conftest import copy_inits
from launch import run_lightning
from parity_check import check_replicas, compare, load

HF = ("llama", "qwen3", "gpt2")


def precision_of(case: str) -> str:
    bits = case[-2:]
    return f"{bits}hf" if bits == "64" and case.startswith(HF) else bits


# (tp, pp, dp): cases. tp2 x pp2 x dp2 runs every model in both precisions; the other layouts a selection.
LAYOUTS = {
    (2, 2, 2): ["nano64", "nano32", "nanotied64", "nanotied32", "llama64", "llama32", "qwen364", "gpt264", "gpt232"],
    (1, 4, 2): ["nano32", "nanotied64", "llama64", "qwen364", "gpt264"],
    (2, 1, 2): ["nano64", "llama32", "qwen364", "gpt264"],
    (1, 1, 4): ["nanotied32", "llama64", "gpt264"],
}
ALL_CASES = sorted({c for cases in LAYOUTS.values() for c in cases})


@pytest.fixture(scope="module")
def any_reference(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("any_ref")
    run_lightning("parity_run.py", ["--ref", "--cases", ",".join(ALL_CASES), "--out", out], timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "dp"), list(LAYOUTS), ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_any_model_matches_single_device(any_reference, tmp_path, tp, pp, dp):
    cases = LAYOUTS[(tp, pp, dp)]
    copy_inits(any_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--tp", tp, "--pp", pp, "--dp", dp, "--micro", 4, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=420,
    )
    problems = []
    for case in cases:
        ref, got = load(any_reference, case), load(tmp_path, case)
        found = compare(ref, got, precision_of(case)) + check_replicas(got)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])
