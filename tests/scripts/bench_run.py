"""``python tests/scripts/bench_run.py ID ... [--out DIR] [--tiny]``: the benchmarks' entry point, as a script
(the test harness starts scripts by path)."""

from __future__ import annotations

import sys

from benchmarks.__main__ import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
