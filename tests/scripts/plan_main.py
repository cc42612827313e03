"""``python -m lightning_3d.plan`` for tests/launch.py, which starts scripts by path."""

import runpy

runpy.run_module("lightning_3d.plan", run_name="__main__", alter_sys=True)
