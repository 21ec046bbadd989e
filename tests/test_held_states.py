"""Workers bringing state of different steps into a change (a peer died while some had
applied a step and others had not): every one of them finds out, as StatesDiffer, which
tells the live hook to report no state kept (a retry from it would fail alike)."""

from __future__ import annotations

import os

import pytest

from helpers import REPO, run_ranks

_HOLDER = """
import sys
from datetime import timedelta
import torch.distributed as dist
from reconfig.execute import Counters, HeldState, StatesDiffer, _agree_on_progress

rank, port, steps = int(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
held = HeldState({}, {}, 0, 1, Counters(steps[rank], steps[rank] * 32, None))
try:
    counters, consumed = _agree_on_progress(held, steps[rank] * 32)
    print(f"agreed {counters.step} {consumed}", flush=True)
except StatesDiffer as exc:
    print(f"differ: {exc}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("steps, expected", [pytest.param("21,21", "agreed 21 672", marks=pytest.mark.extended),
                                             ("22,21", "differ: ")])
def test_holders_of_different_steps_all_find_out(steps, expected):
    port = 20000 + (os.getpid() * 7 + len(steps) + int(steps[:2])) % 20000
    outputs = run_ranks(_HOLDER, lambda rank: [str(rank), str(port), steps], 2,
                        {**os.environ, "PYTHONPATH": str(REPO)})
    for _, out, err in outputs:
        assert out.startswith(expected), (out, err[-2000:])
    if expected.startswith("differ"):
        assert "Adam step 21 to 22, consumed samples 672 to 704" in outputs[0][1]
