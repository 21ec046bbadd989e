"""The posting order the executor's exchange had before reconfig/transfer.py, run for
T1P2D1 -> T2P1D1 on two ranks: every control and data-plane isend of a worker's
transfers first, then its receives. gloo completes it; the collective probe must find
that NCCL would not (tests/test_nccl_rules.py)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import SHAPE  # noqa: E402
from reconfig import planes  # noqa: E402
from reconfig.layout import Layout, Parallelism  # noqa: E402
from reconfig.plan import MigrationRequest, plan_migration  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    me = dist.get_rank()
    old = Layout(Parallelism.even(SHAPE.num_layers, 1, 2, 1), (0, 1))
    plan = plan_migration(MigrationRequest(old, survivors=frozenset({0, 1}), leaving=frozenset(),
                                           joining=frozenset()), Parallelism.even(SHAPE.num_layers, 2, 1, 1), SHAPE)
    sends, incoming = [], []
    for index, t in enumerate(plan.transfers):
        if t.src == me and t.dst != me:
            header = json.dumps([[t.unit, "param", 1000]]).encode()
            messages = [planes.control_tensor([len(header), 1000]), planes.control_bytes(header),
                        planes.on_data_plane(torch.zeros(1000))]
            sends += [dist.isend(m, t.dst, tag=3 * index + i) for i, m in enumerate(messages)]
        if t.dst == me and t.src != me:
            sizes = planes.control_buffer(2, torch.int64)
            incoming.append((index, t, sizes, dist.irecv(sizes, t.src, tag=3 * index)))
    for index, t, sizes, request in incoming:
        request.wait()
        header = planes.control_buffer(int(sizes[0]), torch.uint8)
        payload = planes.data_buffer(int(sizes[1]), torch.float32)
        for w in [dist.irecv(header, t.src, tag=3 * index + 1), dist.irecv(payload, t.src, tag=3 * index + 2)]:
            w.wait()
    for s in sends:
        s.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
