"""Benchmarks of lightning_3d (definitions in ``shared/notes/benchmarks.md``).

``python -m benchmarks ID [ID ...] [--out DIR]`` runs B0..B7 (or ``all``); each prints the measured value,
the baseline measured in the same run, the ideal and the ratio, and writes ``DIR/ID.json``.
``--model hf_llama`` (B2, B3, B4, B5) or ``--model hf_llama_tied`` (B3, B4, B5) runs them on a Hugging Face
``LlamaForCausalLM`` (``hf_llama.py``) instead of the example GPT and writes ``DIR/ID_<model>.json``.

==  ====================================================================================================
B0  calibration: gloo send/recv and all-reduce bandwidth, one-core matmul GFLOP/s
B1  pipeline efficiency, pp=2 on 2 processes, GPipe and 1F1B, m = 1, 2, 4, 8, 16, against one process
B2  strategy overhead: ``Trainer(strategy=ThreeDStrategy)`` against a hand-written loop (pp=2; tp=2)
B3  activation memory in flight (saved-tensor bytes per stage): GPipe, 1F1B, interleaved 1F1B
B4  state bytes per rank (parameters + gradients + optimizer) at dp2 x pp2 x tp2 and peak RSS
B5  communication audit of one dp2 x pp2 x tp2 step against the formulas
B6  tp=2 on 2 processes against one process with 2 threads, hidden 256 and 1024
B7  dp=2 weak scaling against one process
B8  host synchronisations per training step added over plain Lightning (counted on CPU; per step, per micro-batch)
==  ====================================================================================================
"""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "B0": "b0_calibration",
    "B1": "b1_pipeline",
    "B2": "b2_overhead",
    "B3": "b3_activations",
    "B4": "b4_state",
    "B5": "b5_comm",
    "B6": "b6_tensor_parallel",
    "B7": "b7_data_parallel",
    "B8": "b8_sync",
}
"""Benchmark id -> module of this package (each has ``ID``, ``TITLE`` and ``run(out, tiny) -> Record``)."""

RUN_ORDER: tuple[str, ...] = ("B0", "B1", "B2", "B6", "B7", "B3", "B4", "B5", "B8")
"""Order of ``all``: the timed benchmarks first, then the ones that only count (B4 and B5 start 8 processes,
which raise the load average for a minute or two after them)."""

__all__ = ["BENCHMARKS", "RUN_ORDER"]
