"""The parallel machinery under ``ThreeDStrategy``: mesh, stages, tensor and data parallelism, the per-batch path.

Nothing here imports Lightning's strategy, the opt-in tools (``lightning_3d.tools``) or the Hydra application
(``lightning_3d.train``); private torch symbols are reached only through ``torch_compat.py``.
"""
