"""``python -m benchmarks ID [ID ...] [--out DIR] [--tiny]``: run benchmarks and write ``DIR/ID.json``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from . import BENCHMARKS, RUN_ORDER
from .common import environment, fmt, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="lightning_3d benchmarks B0..B7 (see shared/notes/benchmarks.md). Each prints measured, "
        "baseline (same run), ideal and ratio, and writes OUT/ID.json.",
    )
    parser.add_argument("ids", nargs="+", help=f"benchmark ids ({', '.join(BENCHMARKS)}) or 'all'")
    parser.add_argument("--out", default="bench_out", help="folder for the JSON records (default: bench_out)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model and few repetitions: checks the plumbing, times nothing"
    )
    args = parser.parse_args(argv)
    ids = list(RUN_ORDER) if [i.lower() for i in args.ids] == ["all"] else [i.upper() for i in args.ids]
    unknown = [i for i in ids if i not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark id(s) {unknown}; choose from {', '.join(BENCHMARKS)} or 'all'")
    out = Path(args.out)
    summary, failed = {}, []
    for bench_id in ids:
        module = importlib.import_module(f"benchmarks.{BENCHMARKS[bench_id]}")
        env = environment()
        start = time.monotonic()
        try:
            record = module.run(out, tiny=args.tiny)
        except Exception:  # a failed benchmark must not stop the others
            failed.append(bench_id)
            print(f"== {bench_id} FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        data = report(record, out, env, time.monotonic() - start)
        summary[bench_id] = {k: data[k] for k in ("measured", "baseline", "ideal", "ratio", "unit")}
        summary[bench_id]["loadavg_start"] = env["loadavg_start"]
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
