"""The network between two of the job's instances, measured by its workers once.

A layer profile prices pipeline and data-parallel traffic, and the cost constants the
state a change sends between instances, at a network figure they only assume (another
cloud, instance type or placement moves it). So when a layout is formed on two
instances or more (the job's first, as a rule, or the first it grows to), rank 0 and
the first rank on another instance send a message back and forth, one byte and then
PROBE_BYTES, on the data plane (NCCL on GPUs, the path a change's state takes), and
rank 0 puts the figures in etcd (`NetworkRecord`), where the coordinator reads them.
Only rank 0 reads etcd: the others learn from one small broadcast whether to measure and
who does, so they agree without racing the record's write. With the record there, no
layout measures again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_parcae.control.etcd.client import EtcdError
from megatron_parcae.control.etcd.keys import JobStore, NetworkRecord, SchemaError
from megatron_parcae.training.device import SETUP_TIMEOUT
from reconfig import planes
from reconfig.layout import Layout
from reconfig.world import patient

PROBE_BYTES = 4 * 2**20  # a few ms at 10 Gb/s: long against the latency, short to wait for
ROUNDS = 5  # timed round trips of each size, after an untimed one; the fastest counts (the least disturbed)


@dataclass(frozen=True)
class Link:
    """A message between two workers takes `latency_seconds` plus its bytes at `bytes_per_second`."""

    latency_seconds: float
    bytes_per_second: float


def measure_network(store: JobStore, layout: Layout, generation: int, usual: timedelta) -> None:
    """Right after WORLD formed on `layout` (the plan of `generation`): measure the network
    between two instances unless the job already has (collective; `usual` is WORLD's
    timeout). A failure to read or write etcd only leaves the network
    as assumed."""
    if layout.parallelism.world_size == 1:
        return
    rank, peer, instances = dist.get_rank(), 0, ["", ""]
    if rank == 0:
        try:
            if store.network() is None:
                members = store.members()
                here = [members[w].instance if w in members else "" for w in layout.slots]
                peer = next((r for r, instance in enumerate(here) if instance and here[0] and instance != here[0]), 0)
                instances = [here[0], here[peer]]
        except (EtcdError, SchemaError) as exc:
            print(f" the network between instances is not measured: {exc}", flush=True)
    decided = planes.control_tensor([peer])
    dist.broadcast(decided, src=0)
    peer = int(decided[0])
    if peer == 0:
        return
    # NCCL forms the pair's communicator at its first message; the other ranks wait here.
    with patient(None, SETUP_TIMEOUT, usual):
        link = measure_link(peer if rank == 0 else 0) if rank in (0, peer) else None
        planes.control_barrier()
    if link is not None:
        record = NetworkRecord(generation, *instances, PROBE_BYTES, link.latency_seconds, link.bytes_per_second,
                               time.time())
        try:
            store.publish_network(record)
        except (EtcdError, SchemaError) as exc:
            print(f" the network measured between instances is not recorded: {exc}", flush=True)
            return
        print(f" network between instances {instances[0]} and {instances[1]}: {link.bytes_per_second * 8 / 1e9:.2f} "
              f"Gb/s, {link.latency_seconds * 1e6:.0f} us latency (ranks 0 and {peer})", flush=True)


def measure_link(peer: int) -> Link | None:
    """The link between this rank and WORLD rank `peer`, which calls this too: the lower
    rank sends first and times the round trips, of one byte (the latency) and of
    PROBE_BYTES (the rate); it gets the figures, the other None."""
    leads = dist.get_rank() < peer
    one_way = []
    for size in (1, PROBE_BYTES):
        buffer = planes.data_buffer(size, torch.uint8)
        times = [_round_trip(buffer, peer, leads) for _ in range(ROUNDS + 1)][1:]
        one_way.append(min(times) / 2)
    if not leads:
        return None
    latency, seconds = one_way
    # A message timed no slower than one byte (timer noise on a fast link) counts whole.
    return Link(latency, (PROBE_BYTES - 1) / (seconds - latency if seconds > latency else seconds))


def _round_trip(buffer: torch.Tensor, peer: int, leads: bool) -> float:
    started = time.perf_counter()
    if leads:
        dist.send(buffer, peer)
        dist.recv(buffer, peer)
    else:
        dist.recv(buffer, peer)
        dist.send(buffer, peer)
    if buffer.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started
