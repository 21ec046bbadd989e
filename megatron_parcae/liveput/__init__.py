"""Liveput optimizer: throughput and migration-cost models, preemption scenarios, and the
dynamic program that picks the layout to run in each coming interval.

The live coordinator, the spot emulator and the simulator all call these objects.
"""

from megatron_parcae.liveput.cost import CostConstants, MigrationCost, MigrationCostModel
from megatron_parcae.liveput.optimizer import Decision, LiveputOptimizer
from megatron_parcae.liveput.scenarios import ScenarioCosts, StepOutlook
from megatron_parcae.liveput.throughput import PipelineModel, ProfileTable, ThroughputModel

__all__ = [
    "CostConstants", "Decision", "LiveputOptimizer", "MigrationCost", "MigrationCostModel", "PipelineModel",
    "ProfileTable", "ScenarioCosts", "StepOutlook", "ThroughputModel",
]
