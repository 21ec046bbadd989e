"""The workers measure the network between two instances once (training/network.py):
three gloo processes on CPU, two of them on one instance, with a real etcd."""

from __future__ import annotations

import json
import socket
import time

from helpers import child_env, first_layout, new_job, run_ranks
from megatron_parcae.control.etcd import JobStore
from megatron_parcae.control.etcd.keys import MemberRecord
from megatron_parcae.training.network import PROBE_BYTES, ROUNDS

_RANK = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
from megatron_parcae.control.etcd import EtcdClient, JobStore
from megatron_parcae.training.network import measure_network
from reconfig.layout import Layout

rank, port, endpoint, job, layout = sys.argv[1:]
rank, layout = int(rank), Layout.from_dict(json.loads(layout))
calls = []
for name in ("send", "recv", "broadcast", "all_reduce"):
    def counted(*args, _name=name, _call=getattr(dist, name), **kwargs):
        calls.append(_name)
        return _call(*args, **kwargs)
    setattr(dist, name, counted)
timeout = timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", int(port), 3, rank == 0, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timeout)
with EtcdClient(endpoint) as client:
    for generation in (1, 2):  # the second layout finds the record
        calls.clear()
        measure_network(JobStore(client, job), layout, generation, timeout)
        print(json.dumps({name: calls.count(name) for name in set(calls)}), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_and_the_first_rank_on_another_instance_measure_once(etcd_server, client):
    store = JobStore(client, new_job())
    lease, _ = client.grant_lease(120)
    for worker, instance in ((10, "node-a"), (11, "node-a"), (12, "node-b")):
        assert store.register_member(MemberRecord(worker, instance, 1000 + worker, time.time(), 0), lease) == 0
    layout = first_layout([10, 11, 12])  # ranks 0 and 1 on node-a, rank 2 on node-b
    args = [str(_free_port()), etcd_server.endpoint, store.keys.job, json.dumps(layout.to_dict())]
    try:
        outputs = run_ranks(_RANK, lambda rank: [str(rank), *args], 3, child_env())
    finally:
        client.revoke_lease(lease)
    calls = []
    for returncode, out, err in outputs:
        assert returncode == 0, err[-3000:]
        calls.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    # Every rank learns from rank 0 whether and with whom to measure; only rank 0 and
    # rank 2, the first on another instance, exchange messages (two sizes, each round
    # trip a send and a receive), and the others wait for them; the second time nobody does.
    pair = {"broadcast": 1, "send": 2 * (ROUNDS + 1), "recv": 2 * (ROUNDS + 1), "all_reduce": 1}
    assert calls == [[pair, {"broadcast": 1}], [{"broadcast": 1, "all_reduce": 1}, {"broadcast": 1}],
                     [pair, {"broadcast": 1}]], calls
    record = store.network()
    assert (record.generation, record.instance, record.peer_instance) == (1, "node-a", "node-b")
    assert record.message_bytes == PROBE_BYTES and record.bytes_per_second > 0 and record.latency_seconds > 0
