"""lightning_3d: tensor x pipeline x data parallel training for ordinary LightningModules.

>>> from lightning.pytorch import Trainer
>>> from lightning_3d import ThreeDStrategy
>>> trainer = Trainer(accelerator="cpu", devices=8, strategy=ThreeDStrategy(tp=2, pp=2))  # doctest: +SKIP
"""

from lightning.pytorch.strategies import StrategyRegistry

from .materialize import LoadReport, load_full_state_dict
from .partition import ParameterPartitioner, Partitioner, UniformPartitioner
from .strategy import ThreeDStrategy
from .topology import Topology

__all__ = [
    "LoadReport",
    "ParameterPartitioner",
    "Partitioner",
    "ThreeDStrategy",
    "Topology",
    "UniformPartitioner",
    "load_full_state_dict",
]

if "3d" not in StrategyRegistry:
    ThreeDStrategy.register_strategies(StrategyRegistry)
