"""Liveput optimizer: throughput and migration-cost models, preemption scenarios, and the
dynamic program that picks the layout to run in each coming interval.

The live coordinator, the spot emulator and the simulator all build them with
`build_liveput` (factory.py) and call them.
"""

from megatron_parcae.liveput.cost import CostConstants, MigrationCost, MigrationCostModel
from megatron_parcae.liveput.factory import LiveputStack, build_liveput
from megatron_parcae.liveput.optimizer import Decision, LiveputOptimizer
from megatron_parcae.liveput.scenarios import ScenarioCosts, StepOutlook, SuddenLosses
from megatron_parcae.liveput.throughput import PipelineModel, ProfileTable, ThroughputModel

__all__ = [
    "CostConstants", "Decision", "LiveputOptimizer", "LiveputStack", "MigrationCost", "MigrationCostModel",
    "PipelineModel", "ProfileTable", "ScenarioCosts", "StepOutlook", "SuddenLosses", "ThroughputModel",
    "build_liveput",
]
