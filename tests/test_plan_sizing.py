"""`parcae plan`'s search: spot sizes ruled out by the ideal policy's cost are ones that
simulating would not have chosen."""

from __future__ import annotations

import numpy as np
import pytest

import helpers
from megatron_parcae.liveput.cost import CostConstants
from megatron_parcae.liveput.factory import build_liveput
from megatron_parcae.tools.plan import Sizer, cycled, outcome
from megatron_parcae.tools.simulate import Simulation
from predictor.traces import AvailabilityTrace

TINY = str(helpers.REPO / "configs" / "profiles" / "gpt-tiny-cpu.json")
# Instances per minute for half an hour: losses of one to three instances, and recoveries.
COUNTS = [4, 4, 3, 2, 2, 3, 4, 4, 1, 1, 2, 4, 4, 4, 3, 3, 1, 2, 4, 4, 4, 3, 3, 2, 2, 4, 4, 4, 2, 4, 4]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> AvailabilityTrace:
    path = tmp_path_factory.mktemp("trace") / "varying.csv"
    path.write_text("".join(f"{minute * 60000},{count}\n" for minute, count in enumerate(COUNTS)))
    return AvailabilityTrace.load(path)


@pytest.fixture(scope="module")
def liveput():
    return build_liveput(TINY, CostConstants.load(), max_workers=4, lookahead=1, distributed_optimizer=False)


def test_the_ideal_looked_up_is_the_ideal_simulated(trace, liveput):
    """The bound that rules sizes out is only sound if it is the simulator's ideal."""
    sizer = Sizer([trace], liveput, 150_000, 0.5, 1.0, 3.0)
    replay = cycled(trace.scale(3), 60.0, sizer.intervals)
    rates = np.array(Simulation(replay, liveput, on_demand=1).run("ideal").rates)
    simulated = outcome(rates, replay, 1, 150_000, 1.0, 3.0)
    looked_up = sizer.evaluate(3, 1, "ideal").outcomes[0]
    assert looked_up.hours == pytest.approx(simulated.hours) and looked_up.dollars == pytest.approx(simulated.dollars)


# 1,000 samples: two sizes simulated; 150,000: spot alone finishes; 250,000: most sizes need on-demand instances
@pytest.mark.parametrize("samples", [1_000, 150_000, 250_000])
def test_search_answers_what_simulating_every_size_answers(trace, liveput, samples):
    sizer = Sizer([trace], liveput, samples, 0.5, 1.0, 3.0)
    found, ruled_out = sizer.search()
    assert ruled_out  # otherwise this compares nothing
    every = {spot: sizer.fewest_on_demand(spot, sizer.largest - spot) for spot in range(sizer.largest + 1)}
    assert found[0] == min((c for c in every.values() if c), key=lambda c: (c.dollars, c.hours))
    assert sorted([c.spot for c in found] + [f.spot for f in ruled_out]) == [s for s, c in every.items() if c]
    for floor in ruled_out:
        assert found[0].dollars < floor.dollars <= every[floor.spot].dollars
