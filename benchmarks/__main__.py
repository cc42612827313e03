"""``python -m benchmarks ID [ID ...] [--out DIR] [--tiny] [--model NAME]``: run benchmarks and write ``DIR/ID.json``.

``python -m benchmarks B1 --schedule NAME --partitioner NAME`` times a pipeline schedule (beside 1F1B) with the
body split by a partitioner (defaults: ``1f1b``, ``uniform``); the record names both.

``python -m benchmarks B1 --sweep --out DIR`` times every schedule at pp 2 and 4 with m = 4, 8, 16
(``DIR/B1_sweep.json`` and ``DIR/B1_sweep.md``); ``python -m benchmarks B3 --schedule A,B,...`` measures the
activation memory each schedule (a name or a CSV action list) keeps in flight per stage against its action list
(``DIR/B3_<name>.json``).

``P1`` (the planner against measured layouts, ``benchmarks/p1_planner.py``) and ``S1`` (the zero-bubble schedules'
split backward against one whole backward, ``benchmarks/s1_split_backward.py``) run by id only, not in ``all``.

``python -m benchmarks B5 --grad-reduce-dtype bf16`` counts the data-parallel gradient bytes with gradient
compression, under replicate and fsdp (record ``B5_grad_bf16``).

``--model hf_llama`` (or ``hf_llama_tied``) runs the benchmarks that have a Hugging Face Llama variant (a module
listing it in ``MODELS``) on that model instead of the example GPT and writes ``DIR/ID_hf_llama.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

from . import BENCHMARKS as CORE_BENCHMARKS
from . import RUN_ORDER
from .common import environment, fmt, report
from .hf_llama import MODEL_NAMES

# Benchmarks run by id only, never by ``all`` (minutes long): P1 checks the planner against measured layouts.
# N1 measures the loss with gradient compression (grad_reduce_dtype) against fp32 reduction (three 100-step runs).
# S1 times the zero-bubble schedules' split backward (I + W) against one whole backward (one process, a minute).
EXTRA_BENCHMARKS: dict[str, str] = {"P1": "p1_planner", "N1": "n1_grad_reduce", "S1": "s1_split_backward"}
BENCHMARKS: dict[str, str] = {**CORE_BENCHMARKS, **EXTRA_BENCHMARKS}


def _module(bench_id: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{BENCHMARKS[bench_id]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="lightning_3d benchmarks B0..B8 (see shared/notes/benchmarks.md). Each prints measured, "
        "baseline (same run), ideal and ratio, and writes OUT/ID.json.",
    )
    parser.add_argument(
        "ids", nargs="+", help=f"benchmark ids ({', '.join(BENCHMARKS)}), 'all', or GPU (gpu_check.py, alone)"
    )
    parser.add_argument("--out", default="bench_out", help="folder for the JSON records (default: bench_out)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model and few repetitions: checks the plumbing, times nothing"
    )
    parser.add_argument(
        "--model",
        default="gpt",
        choices=("gpt", *MODEL_NAMES, "xl-shallow"),
        help="gpt (default): the example GPT; hf_llama / hf_llama_tied: a Hugging Face LlamaForCausalLM (GQA; "
        "untied / tied embeddings), for B2..B5 (records ID_MODEL.json); xl-shallow: B4 --data-parallel fsdp's "
        "peak memory against share + one layer (B4_fsdp_xl-shallow.json)",
    )
    parser.add_argument(
        "--data-parallel",
        default="replicate",
        choices=("replicate", "fsdp"),
        help="B4 and N1 only: ThreeDStrategy(data_parallel=...); fsdp writes B4_fsdp.json / N1_fsdp.json",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        help="B1: the pipeline schedule timed beside 1F1B (1f1b (default), gpipe, interleaved1f1b, "
        "interleavedzerobubble, zbvzerobubble, dualpipev; multi-stage ones with 2 stages per rank, NAME:1 with one "
        "(interleavedzerobubble:1); or a CSV "
        "action list at pp 2, with its own stages per rank and micro-batch count); B3: one or "
        "several (A,B,...; a name or a CSV action list), each measured alone",
    )
    parser.add_argument(
        "--partitioner",
        default=None,
        help="B1 only: how the body is split into stages (uniform (default), parameters, compute, memory)",
    )
    parser.add_argument(
        "--split-backward",
        default=None,
        choices=("linear", "autograd"),
        help="B1 only: how a zero-bubble schedule's stages split the backward, as ThreeDStrategy(split_backward=...)"
        ": linear (default: W computes the linear layers' kept products) or autograd (torch's graph split)",
    )
    parser.add_argument(
        "--grad-reduce-dtype",
        default=None,
        choices=("bf16", "fp16"),
        help="B5 only: ThreeDStrategy(grad_reduce_dtype=...) under replicate and fsdp; the data-parallel gradient "
        "bytes against the formula (record B5_grad_<dtype>)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="B1 only: every schedule at pp 2 and 4, m 4, 8, 16, each split by --partitioner for its own placement "
        "(writes OUT/B1_sweep.json and OUT/B1_sweep.md)",
    )
    args = parser.parse_args(argv)
    if args.sweep:  # the B1 sweep (b1_pipeline.run_sweep): its own table and JSON
        if [i.upper() for i in args.ids] != ["B1"]:
            parser.error("--sweep applies to B1 alone: run `python -m benchmarks B1 --sweep --out DIR`")
        from .b1_pipeline import run_sweep

        run_sweep(
            Path(args.out),
            reps=1 if args.tiny else 7,
            split_backward=args.split_backward or "linear",
            partitioner=args.partitioner or "uniform",
        )
        return 0
    b1_options = {
        k: v
        for k, v in (
            ("schedule", args.schedule),
            ("partitioner", args.partitioner),
            ("split_backward", args.split_backward),
        )
        if v is not None
    }
    if [i.upper() for i in args.ids] == ["GPU"]:  # the GPU check (gpu_check.py): its own table and JSON
        from . import gpu_check

        return gpu_check.main(["--out", args.out] + (["--dry-run-cpu"] if args.tiny else []))
    ids = list(RUN_ORDER) if [i.lower() for i in args.ids] == ["all"] else [i.upper() for i in args.ids]
    unknown = [i for i in ids if i not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark id(s) {unknown}; choose from {', '.join(BENCHMARKS)} or 'all'")
    if args.model not in ("gpt", "xl-shallow"):  # xl-shallow: B4's FSDP memory record (checked below)
        without = [i for i in ids if args.model not in getattr(_module(i), "MODELS", ("gpt",))]
        if without and [i.lower() for i in args.ids] == ["all"]:
            ids = [i for i in ids if i not in without]  # 'all' with a model: the benchmarks that have it
        elif without:
            parser.error(f"benchmark(s) {without} have no --model {args.model} variant")
    if args.data_parallel != "replicate" and (
        ids not in (["B4"], ["N1"])
        or args.model not in ("gpt", "xl-shallow")
        or (ids == ["N1"] and args.model != "gpt")
    ):
        parser.error(
            "--data-parallel fsdp is measured by B4 (with the example GPT: gpt or xl-shallow) and N1 (gpt) only"
        )
    if args.model == "xl-shallow" and args.data_parallel != "fsdp":
        parser.error(
            "--model xl-shallow is B4's FSDP memory record: `python -m benchmarks B4 --data-parallel fsdp "
            "--model xl-shallow`"
        )
    if args.grad_reduce_dtype is not None and (ids != ["B5"] or args.model != "gpt"):
        parser.error("--grad-reduce-dtype is measured by B5 with the example GPT only")
    if ids == ["B3"] and list(b1_options) == ["schedule"]:  # B3 for one schedule (b3_activations.run_schedule)
        from .b3_activations import run_schedules

        started, env = time.monotonic(), environment()
        for record in run_schedules(Path(args.out), b1_options["schedule"], tiny=args.tiny):  # A,B,...: one launch
            report(record, Path(args.out), env, time.monotonic() - started)
        return 0
    if b1_options and ids != ["B1"]:
        parser.error(
            "--schedule and --partitioner apply to B1 alone (and --schedule to B3 alone): run `python -m benchmarks "
            "B1 --schedule ...`"
        )
    out = Path(args.out)
    summary, failed = {}, []
    for bench_id in ids:
        module = _module(bench_id)
        env = environment()
        start = time.monotonic()
        try:
            if args.data_parallel != "replicate" and bench_id == "B4":
                record = module.run(out, tiny=args.tiny, model=args.model, data_parallel=args.data_parallel)
            elif args.data_parallel != "replicate":
                record = module.run(out, tiny=args.tiny, data_parallel=args.data_parallel)
            elif args.grad_reduce_dtype is not None:
                record = module.run(out, tiny=args.tiny, grad_reduce_dtype=args.grad_reduce_dtype)
            elif b1_options:
                record = module.run(out, tiny=args.tiny, **b1_options)
            elif args.model == "gpt":
                record = module.run(out, tiny=args.tiny)
            else:
                record = module.run(out, tiny=args.tiny, model=args.model)
        except Exception:  # a failed benchmark must not stop the others
            failed.append(bench_id)
            print(f"== {bench_id} FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        data = report(record, out, env, time.monotonic() - start)
        summary[record.id] = {k: data[k] for k in ("measured", "baseline", "ideal", "ratio", "unit")}
        summary[record.id]["loadavg_start"] = env["loadavg_start"]
    if len(ids) > 1:
        print("\nsummary:")
        for bench_id, row in sorted(summary.items()):
            print(f"  {bench_id}: ratio {fmt(row['ratio'])}  (measured {fmt(row['measured'])})")
        out.mkdir(parents=True, exist_ok=True)
        path = out / "summary.json"
        merged = json.loads(path.read_text()) if path.exists() else {}  # a partial rerun updates its own rows
        merged.update(summary)
        path.write_text(json.dumps(dict(sorted(merged.items())), indent=2, default=str))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
