"""``torchrun --nproc-per-node N -m lightning_3d.train ARGS...`` for tests/launch.py: ranks created externally.

Usage: ``cli_torchrun.py N ARGS...``. The rendezvous port is launch.py's free ``MASTER_PORT``.
"""

import os
import sys

from torch.distributed.run import main

nproc, *args = sys.argv[1:]
main(["--nproc-per-node", nproc, "--master-port", os.environ["MASTER_PORT"], "-m", "lightning_3d.train", *args])
