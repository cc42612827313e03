"""``python tests/scripts/bench_run.py ID ... [--out DIR] [--tiny]``: the benchmarks' entry point, as a script
(the test harness starts scripts by path).

Forked from the test zygote (``tests/zygote.py``), the benchmarks' worker processes are forks of it too (each would
otherwise import torch and Lightning afresh: some 6 s of CPU per process); ``L3D_TEST_SPAWN=1`` keeps fresh
interpreters, as ``python -m benchmarks`` starts them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from benchmarks import common
from benchmarks.__main__ import main


def _forked(cmd: list[str], env: dict[str, str], log: Any) -> Any:
    import l3d_test_zygote  # type: ignore[import-not-found]  # only inside the zygote's forks

    return l3d_test_zygote.ForkedPopen(cmd, env=env, cwd=str(common.ROOT), log=log.name)


if __name__ == "__main__":
    if "l3d_test_zygote" in sys.modules and os.environ.get("L3D_TEST_SPAWN", "0") != "1":
        common.start_process = _forked
    sys.exit(main(sys.argv[1:]))
