"""reconfig/optimizer_state.py on its own: where Adam keeps its step, the loss-scale
record, and how state is gathered a chunk at a time."""

from __future__ import annotations

import json

import pytest
import torch

from reconfig.optimizer_state import LossScale, chunks_of, set_step_count, step_count


def test_adam_step_is_read_and_written_per_group_as_fused_adam_keeps_it():
    """Transformer Engine's and apex's FusedAdam keep `step` in each parameter group."""
    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([param])
    param.grad = torch.ones(3)
    adam.step()
    optimizer = type("MegatronOptimizer", (), {"optimizer": adam})()
    assert step_count(optimizer) == 1
    adam.param_groups[0]["step"] = 7
    assert step_count(optimizer) == 7
    set_step_count(optimizer, 3)
    assert adam.param_groups[0]["step"] == 3 and int(adam.state[param]["step"]) == 3


@pytest.mark.parametrize("raw", [None, [], {"scale": 1.0}, {"scale": 0, "growth_tracker": 0, "hysteresis_tracker": 2},
                                 {"scale": float("inf"), "growth_tracker": 0, "hysteresis_tracker": 2},
                                 {"scale": True, "growth_tracker": 0, "hysteresis_tracker": 2},
                                 {"scale": 8.0, "growth_tracker": -1, "hysteresis_tracker": 2},
                                 {"scale": 8.0, "growth_tracker": 1.5, "hysteresis_tracker": 2},
                                 {"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 2, "extra": 1}])
def test_a_bad_loss_scale_record_is_refused(raw):
    with pytest.raises(ValueError):
        LossScale.from_dict(raw)


def test_loss_scale_round_trips():
    scale = LossScale(65536.0, 2, 1)
    assert LossScale.from_dict(json.loads(json.dumps(scale.to_dict()))) == scale


@pytest.mark.parametrize("sizes,limit,expected", [
    ([], 10, []), ([3, 3, 3], 6, [range(0, 2), range(2, 3)]), ([20, 1, 1], 6, [range(0, 1), range(1, 3)]),
    ([1, 20, 1], 6, [range(0, 1), range(1, 2), range(2, 3)]), ([2, 2, 2], 100, [range(0, 3)])])
def test_chunks_cover_every_item_once_within_the_limit(sizes, limit, expected):
    assert chunks_of(sizes, limit) == expected
