"""Comparisons of a ThreeDStrategy run against the single-device reference (records of parity_run.py)."""

from __future__ import annotations

from pathlib import Path

import torch

# float64: every gradient and logged value to 1e-10; float32: PyTorch pipelining's own test tolerance for
# gradients (elementwise rtol 1e-5, atol 4e-5) and relative 1e-4 for anything after several optimizer steps.
# Final parameters are compared per tensor, ||got - ref|| / ||ref||: Adam divides each gradient element by
# its own running magnitude, so an element whose gradient is almost zero moves by lr on round-off alone.
TOL = {
    "64": {"grad_rtol": 1e-10, "grad_atol": 1e-10, "curve": 1e-10, "param_rel": 1e-10},
    "32": {"grad_rtol": 1e-5, "grad_atol": 4e-5, "curve": 1e-4, "param_rel": 1e-4},
    # bf16 autocast: a different split of a matmul's reduction changes bf16 rounding (~1e-2 per op).
    "bf": {"grad_rtol": 0.2, "grad_atol": 2e-2, "curve": 2e-2, "param_rel": 0.25},
    # Hugging Face causal LMs in float64: their loss function upcasts the logits to float32 (ForCausalLMLoss), so a
    # loss averaged over micro-batches differs from the whole batch's by float32 round-off (~1e-7); gradients and
    # parameters stay float64-exact.
    "64hf": {"grad_rtol": 1e-10, "grad_atol": 1e-10, "curve": 1e-6, "param_rel": 1e-10},
    # Compiled blocks at tp 2 (test_compile.py): float32 as above, but the final parameters within 2e-4. Splitting the
    # row-parallel projection's reduction over two tp ranks alone moves gpt32's body.1.proj.weight by 9.6e-5 after
    # its 20 AdamW steps on an AVX2 CPU (eager, test_parity.py; 1.9e-5 on an AVX-512 one): Adam's normalisation turns
    # round-off in near-zero gradients into update-sized steps. Compiling the blocks (AOT autograd's decompositions)
    # adds 2e-5 of the same round-off (1.15e-4 in all). Losses, gradients and norms keep the float32 tolerance, and
    # exactness is checked in float64 (1e-10) by test_parity.py on the same code path.
    "32tp_compiled": {"grad_rtol": 1e-5, "grad_atol": 4e-5, "curve": 1e-4, "param_rel": 2e-4},
}


def schedule_tags(runs: list[tuple[str, int]]) -> list[str]:
    """The record tag of each ``(schedule, stages_per_rank)`` that one ``parity_run.py --schedules`` launch runs:
    case C under it writes ``OUT/C@<tag>.pt``. The tag is the name (a CSV list's file stem), followed by
    ``-<stages per rank>`` when the launch lists that name more than once."""
    stems = [Path(name).stem for name, _ in runs]
    return [stem + (f"-{spr}" if stems.count(stem) > 1 else "") for stem, (_, spr) in zip(stems, runs)]


def load(directory: Path, case: str) -> dict:
    return torch.load(Path(directory) / f"{case}.pt", weights_only=False)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(ref: dict, got: dict, precision: str) -> list[str]:
    """Every difference beyond tolerance, as readable lines (empty: the runs agree)."""
    tol, problems = TOL[precision], []
    if set(ref["grads"]) != set(got["grads"]):
        problems.append(f"gradient keys differ: {sorted(set(ref['grads']) ^ set(got['grads']))}")
    for name in sorted(set(ref["grads"]) & set(got["grads"])):
        r, g = ref["grads"][name], got["grads"][name]
        if r.shape != g.shape or not torch.allclose(g, r, rtol=tol["grad_rtol"], atol=tol["grad_atol"]):
            problems.append(f"step-1 gradient {name}: max abs diff {(g - r).abs().max().item():.3e}")
    if len(ref["loss"]) != len(got["loss"]):
        problems.append(f"steps: reference {len(ref['loss'])}, got {len(got['loss'])}")
    for step, (r, g) in enumerate(zip(ref["loss"], got["loss"])):
        if _rel(g, r) > tol["curve"]:
            problems.append(f"returned loss at step {step}: {g!r} vs reference {r!r}")
    for step, (r, g) in enumerate(zip(ref["norm"], got["norm"])):
        if _rel(g, r) > tol["curve"]:
            problems.append(f"gradient norm at step {step}: {g!r} vs reference {r!r}")
    for kind in ("logged", "bar"):
        for step, (r, g) in enumerate(zip(ref[kind], got[kind])):
            if set(r) != set(g):
                problems.append(f"{kind} keys at step {step}: {sorted(g)} vs reference {sorted(r)}")
            for key in set(r) & set(g):
                if _rel(g[key], r[key]) > tol["curve"]:
                    problems.append(f"{kind} {key!r} at step {step}: {g[key]!r} vs reference {r[key]!r}")
    if set(ref["params"]) != set(got["params"]):
        problems.append(f"parameter keys differ: {sorted(set(ref['params']) ^ set(got['params']))}")
    for name in sorted(set(ref["params"]) & set(got["params"])):
        r, g = ref["params"][name], got["params"][name]
        rel = ((g - r).norm() / r.norm().clamp_min(1e-12)).item() if g.shape == r.shape else float("inf")
        if rel > tol["param_rel"]:
            problems.append(f"final parameter {name}: relative difference {rel:.3e}")
    return problems + compare_summaries(ref, got)


def compare_summaries(ref: dict, got: dict) -> list[str]:
    """Rank 0's model summary table (every module: names, types, parameter counts, modes, and with an example
    input the sizes and FLOPs) against one device's."""
    if ("summary" in ref) != ("summary" in got):
        return [f"model summary recorded by {'the reference' if 'summary' in ref else 'the run'} only"]
    if "summary" not in ref:
        return []
    r, g = ref["summary"], got["summary"]
    problems = [
        f"model summary {key}: {g[key]!r} vs reference {r[key]!r}" for key in r if key != "columns" and g[key] != r[key]
    ]
    got_columns = dict(g["columns"])
    for column, values in r["columns"]:
        if got_columns.get(column) != values:
            problems.append(f"model summary column {column!r}: {got_columns.get(column)} vs reference {values}")
    if [c for c, _ in g["columns"]] != [c for c, _ in r["columns"]]:
        problems.append(
            f"model summary columns: {[c for c, _ in g['columns']]} vs reference {[c for c, _ in r['columns']]}"
        )
    return problems


def check_replicas(got: dict) -> list[str]:
    """DP replicas bitwise identical; ranks of one replica read the same batches, replicas different ones."""
    problems = []
    ranks = got["ranks"]
    by_position: dict[tuple[int, int], set[str]] = {}
    for r in ranks:
        by_position.setdefault(r["coords"][1:], set()).add(r["params_sha"])
    for position, shas in by_position.items():
        if len(shas) != 1:
            problems.append(f"(pp, tp) = {position}: data-parallel replicas differ ({len(shas)} versions)")
    by_replica: dict[int, set[tuple[str, ...]]] = {}
    for r in ranks:
        by_replica.setdefault(r["coords"][0], set()).add(tuple(r["batches"]))
    for replica, seen in by_replica.items():
        if len(seen) != 1:
            problems.append(f"ranks of replica {replica} read different batches")
    firsts = [next(iter(seen))[0] for seen in by_replica.values()]
    if len(set(firsts)) != len(firsts):
        problems.append("different data-parallel replicas read the same first batch")
    return problems
