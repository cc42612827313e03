"""lightning_3d: tensor x pipeline x data parallel training for ordinary LightningModules.

>>> from lightning.pytorch import Trainer
>>> from lightning_3d import ThreeDStrategy
>>> trainer = Trainer(accelerator="cpu", devices=8, strategy=ThreeDStrategy(tp=2, pp=2))  # doctest: +SKIP
"""

from lightning.pytorch.strategies import StrategyRegistry

from .checkpoint.lightning_file import read_folders_as_files
from .core.grad_norm import grad_norm
from .core.materialize import LoadReport, load_full_state_dict
from .core.partition import ParameterPartitioner, Partitioner, UniformPartitioner
from .core.topology import Topology
from .reliability import ConsistencyError, DPConsistencyCheck, DPDivergenceError, NonFiniteError, diagnose_barrier
from .settings import ThreeDSettings
from .strategy import ThreeDStrategy

__all__ = [
    "ConsistencyError",
    "DPConsistencyCheck",
    "DPDivergenceError",
    "LoadReport",
    "NonFiniteError",
    "ParameterPartitioner",
    "Partitioner",
    "ThreeDSettings",
    "ThreeDStrategy",
    "Topology",
    "UniformPartitioner",
    "diagnose_barrier",
    "grad_norm",
    "load_full_state_dict",
]

# Lightning's checkpoint loader (load_from_checkpoint, a single-device Trainer's ckpt_path=) reads our folders
read_folders_as_files()

if "3d" not in StrategyRegistry:
    ThreeDStrategy.register_strategies(StrategyRegistry)
