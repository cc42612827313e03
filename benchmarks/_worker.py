"""Entry point of a benchmark process: ``python -m benchmarks._worker module:function '{"json": "kwargs"}'``.

Started by :func:`benchmarks.common.launch` with the torchrun environment. The function runs on every rank;
rank 0's return value (JSON-serialisable) is written to ``$BENCH_RESULT``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    target, kwargs = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    module_name, func_name = target.split(":")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    module = importlib.import_module(f"benchmarks.{module_name}")
    result = getattr(module, func_name)(**kwargs)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        Path(os.environ["BENCH_RESULT"]).write_text(json.dumps(result, default=str))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank is done: nothing is left to communicate
    # Leave without running the C++ teardown of gloo's threads: it can abort ("terminate called without an active
    # exception") after the work is done, which would turn a finished benchmark into a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
