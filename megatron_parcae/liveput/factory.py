"""One way to assemble the liveput stack: cost constants -> throughput model -> migration
cost model -> optimizer.

The live coordinator (and so the spot emulator, which runs it), `parcae simulate` and
`parcae plan` all build here, so a simulated job decides as a live one would: the same
throughput model, the same migration pricing and the same planner settings (whether the
job shards its optimizer state decides which moments a plan moves, hence its cost; how
many GPUs an instance has decides which layouts fit and what a preemption takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_parcae.liveput.cost import COST_MODELS, CostConstants, MigrationCostModel, PhaseRates
from megatron_parcae.liveput.optimizer import LiveputOptimizer
from megatron_parcae.liveput.scenarios import SuddenLosses
from megatron_parcae.liveput.throughput import OnInstances, ThroughputModel, load_profile


# Layouts the optimizer weighs per instance count, best throughput first (optimizer.py):
# as many as a search of every layout needs on Parcae's four aws-p3 segments with true
# availability (benchmarks/results/simulate_parcae_costs.txt). Parcae's restart-style
# charges make slower layouts that change less pay, further down the ranking.
CANDIDATES = {"megatron-parcae": 4, "parcae": 8}


@dataclass(frozen=True)
class LiveputStack:
    """A job's throughput and migration cost models, and how its optimizer plans."""

    throughput: ThroughputModel  # layouts whose TP groups fit in an instance only
    costs: MigrationCostModel
    lookahead: int  # intervals the optimizer plans over
    distributed_optimizer: bool  # the job trains with --use-distributed-optimizer
    gpus_per_instance: int  # G: workers per instance, the unit that is preempted and counted
    candidates: int  # layouts the optimizer weighs per instance count
    sudden: SuddenLosses = SuddenLosses()  # preemptions without notice, and what recovers them

    @property
    def constants(self) -> CostConstants:
        return self.costs.constants

    def optimizer(self) -> LiveputOptimizer:
        """A new optimizer; it caches plans and costs, so keep one per job or simulated run."""
        return LiveputOptimizer(self.throughput, self.costs, self.lookahead, self.candidates,
                                distributed_optimizer=self.distributed_optimizer,
                                gpus_per_instance=self.gpus_per_instance, sudden=self.sudden)


def build_liveput(profile: str | Path | ThroughputModel, constants: CostConstants, *, lookahead: int,
                  distributed_optimizer: bool, model: str | None = None, max_workers: int | None = None,
                  gpus_per_instance: int = 1, cost_model: str = "megatron-parcae",
                  phase_rates: PhaseRates | None = None, sudden: SuddenLosses = SuddenLosses()) -> LiveputStack:
    """The stack for `profile`: a throughput model, or a file `load_profile` reads (a CSV
    table takes its shape from `constants` under `model`; a layer profile enumerates
    layouts on up to `max_workers` workers), on instances of `gpus_per_instance` GPUs:
    only layouts whose T divides it are kept (ProfileError when none is). `cost_model`
    names who prices a change (`COST_MODELS`): "megatron-parcae", what this project's
    executor does, or "parcae", what Parcae's artifact charges (T = 1 layouts only).
    `phase_rates`: the executor's phases as the job measured them (`MigrationCostModel.fitted`;
    the live coordinator's), not as the constants price them. `sudden`: the share of
    preemptions that come without notice, and the snapshot and checkpoint intervals that
    say what they cost (scenarios.SuddenLosses; the default prices each as noticed)."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost_model!r}; known: {', '.join(COST_MODELS)}")
    if phase_rates and cost_model != "megatron-parcae":
        raise ValueError("fitted phase rates price this project's executor: not with the parcae cost model")
    throughput = profile if isinstance(profile, ThroughputModel) else \
        load_profile(profile, constants.models, model, max_workers)
    throughput = OnInstances(throughput, gpus_per_instance)
    if cost_model == "parcae" and any(p.tp > 1 for p in throughput.layouts()):
        raise ValueError("the parcae cost model prices Parcae's engine, which has no tensor parallelism: "
                         "the profile has layouts with T > 1")
    costs = MigrationCostModel(constants, throughput.model_shape, phase_rates) if phase_rates else \
        COST_MODELS[cost_model](constants, throughput.model_shape)
    sudden.check_batch(throughput)
    return LiveputStack(throughput, costs, lookahead, distributed_optimizer, gpus_per_instance,
                        CANDIDATES[cost_model], sudden)
