"""``python -m lightning_3d.train`` for tests/launch.py, which starts scripts by path.

``runpy`` with ``alter_sys=True`` makes ``__main__.__spec__`` the module's, so Lightning's launcher starts
the other ranks as ``python -m lightning_3d.train ...``: the same commands a user's run produces.
"""

import runpy

runpy.run_module("lightning_3d.train", run_name="__main__", alter_sys=True)
