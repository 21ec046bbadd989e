"""Point-to-point exchanges of state between live workers, posted as NCCL needs them.

Every exchange of the project (a migration's transfers, a grace hand-over, snapshot
copies, a recovery's refill from copies, joiners' state) goes through `exchange`, which
every member of WORLD calls together, each with what it sends and what it expects:

1. Control plane (gloo, matched by tag, so the order of posts cannot deadlock): each
   message's sizes and a JSON header with its element count and one checksum per chunk.
2. Data plane: one data-plane all-reduce over WORLD first, which sets its NCCL
   communicator up with every rank (bounded by the group's timeout) and finds the
   busiest rank's number of messages, which share one chunk of device memory per step;
   then, step by step, chunk k of every message in one `batch_isend_irecv` group, posted
   on both sides of each pair in the order of the messages' tags. NCCL matches the
   sends and receives of a pair by order within a group and runs a group's operations
   together, so no cycle of first-sends can form. Payloads stay in host memory on both
   sides; the device holds the chunks in flight.
3. Agreement: a received chunk whose checksum or length differs from its header (a peer
   killed mid-send, a communicator aborted after `wait()` returned) is not taken: the
   ranks agree over the control plane whether every message checked, and all raise
   `TransferBroken` if one did not, so no worker builds on a damaged payload.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash

from reconfig import planes
from reconfig.timeouts import exchange_timeout
from reconfig.world import patient

CHUNK_ELEMENTS = 1 << 24  # fp32 elements in flight per rank and step: 64 MiB of device memory
MAX_ELEMENTS = 1 << 40
# What an exchange's timeout assumes of the link where no rate is given: slower than any
# data-centre network, so that only a stalled peer reaches it.
LINK_BYTES_PER_SECOND = 1e9


class TransferBroken(RuntimeError):
    """A message of an exchange arrived short or damaged somewhere in WORLD: what was
    received is not to be used (the change or snapshot is retried)."""


@dataclass(frozen=True)
class Outgoing:
    """A message to the rank `peer`: `header` (JSON bytes, the caller's) and a flat fp32
    `payload` in host memory. `tag` orders a pair's messages alike on both sides."""

    peer: int
    tag: int
    header: bytes
    payload: torch.Tensor


@dataclass(frozen=True)
class Incoming:
    """A message expected from the rank `peer` with `tag`."""

    peer: int
    tag: int


@dataclass
class Received:
    header: bytes
    payload: torch.Tensor  # host memory


@dataclass
class Exchanged:
    """What arrived, by (peer, tag), and the most data-plane bytes a step of this rank held."""

    messages: dict[tuple[int, int], Received]
    in_flight_bytes: int


HostBuffer = Callable[[int, int, int], torch.Tensor]  # (peer, tag, elements) -> fp32 host tensor to fill


def checksums(payload: torch.Tensor, chunk: int) -> list[int]:
    """xxh3-64 of each chunk's bytes (host memory), as signed 64-bit integers."""
    flat = payload.reshape(-1)
    sums = []
    for first in range(0, flat.numel(), chunk):
        digest = xxhash.xxh3_64_intdigest(flat[first: first + chunk].numpy())
        sums.append(digest - (1 << 64) if digest >= 1 << 63 else digest)
    return sums


def _wire_header(message: Outgoing, chunk: int) -> bytes:
    return json.dumps({"header": message.header.decode(), "elements": message.payload.numel(), "chunk": chunk,
                       "sums": checksums(message.payload, chunk)}).encode()


def _parse_wire(raw: bytes, elements: int, chunk: int) -> tuple[bytes, list[int]] | str:
    """(caller's header, chunk checksums), or why the wire header is unusable."""
    try:
        d = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"unreadable header ({exc})"
    if not isinstance(d, dict) or not isinstance(d.get("header"), str) or not isinstance(d.get("sums"), list):
        return "header is not an object with header and sums"
    if d.get("elements") != elements or d.get("chunk") != chunk:
        return f"header says {d.get('elements')!r} elements in chunks of {d.get('chunk')!r}, sizes say {elements} in {chunk}"
    sums = d["sums"]
    if len(sums) != -(-elements // chunk) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sums):
        return f"header has {len(sums)} checksums for {elements} elements"
    return d["header"].encode(), sums


def _steps(elements: int, chunk: int) -> int:
    return -(-elements // chunk)


class _Staging:
    """One chunk-sized data-plane buffer per message; on CPU the host memory itself."""

    def __init__(self, elements: int, chunk: int) -> None:
        on_device = planes.data_device().type != "cpu"
        self.buffer = planes.data_buffer(min(elements, chunk), torch.float32) if on_device and elements else None

    def part(self, host: torch.Tensor, first: int, count: int) -> torch.Tensor:
        if self.buffer is None:
            return planes.as_data_plane(host[first: first + count])
        return planes.as_data_plane(self.buffer[:count])


def exchange(sends: Sequence[Outgoing], receives: Sequence[Incoming], usual: timedelta,
             host_buffer: HostBuffer | None = None, chunk: int | None = None, what: str = "exchange",
             link_bytes_per_second: float | None = None) -> Exchanged:
    """Send `sends` and receive `receives` (collective over WORLD: every member calls it,
    with nothing to move if so). Returns what arrived by (peer, tag), checked; raises
    TransferBroken on every rank if any message anywhere failed its checks.

    A step moves at most `chunk` elements through each rank's device in all: the
    messages of the busiest rank share it. WORLD's collectives wait as long as the
    busiest rank's bytes take over the link (`exchange_timeout`), then `usual` again."""
    sends = sorted(sends, key=lambda m: (m.peer, m.tag))
    receives = sorted(receives, key=lambda m: (m.peer, m.tag))
    rate = link_bytes_per_second or LINK_BYTES_PER_SECOND
    with patient(None, exchange_timeout(0, rate), usual):
        busiest = planes.data_buffer(2, torch.int64)
        busiest[0] = len(sends) + len(receives)
        busiest[1] = 4 * sum(m.payload.numel() for m in sends)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)  # also sets the data plane's communicator up with every rank
        messages, nbytes = (int(x) for x in busiest.tolist())
        with patient(None, exchange_timeout(nbytes, rate), usual):
            return _exchange(sends, receives, host_buffer, max(1, (chunk or CHUNK_ELEMENTS) // max(1, messages)),
                             what)


def _exchange(sends: list[Outgoing], receives: list[Incoming], host_buffer: HostBuffer | None, part: int,
              what: str) -> Exchanged:
    posted = []
    for m in sends:
        wire = _wire_header(m, part)
        posted.append(dist.isend(planes.control_tensor([len(wire), m.payload.numel()]), m.peer, tag=2 * m.tag))
        posted.append(dist.isend(planes.control_bytes(wire), m.peer, tag=2 * m.tag + 1))
    problems: list[str] = []
    expected: list[tuple[Incoming, int, bytes, list[int] | None]] = []
    for m in receives:
        sizes = planes.control_buffer(2, torch.int64)
        dist.recv(sizes, m.peer, tag=2 * m.tag)
        length, elements = int(sizes[0]), int(sizes[1])
        if not (0 < length < 1 << 30 and 0 <= elements < MAX_ELEMENTS):
            raise TransferBroken(f"{what}: message from rank {m.peer} announces {length} header bytes and {elements} "
                                 "elements")
        raw = planes.control_buffer(length, torch.uint8)
        dist.recv(raw, m.peer, tag=2 * m.tag + 1)
        parsed = _parse_wire(raw.numpy().tobytes(), elements, part)
        if isinstance(parsed, str):
            problems.append(f"message from rank {m.peer}: {parsed}")
            expected.append((m, elements, b"", None))
        else:
            expected.append((m, elements, parsed[0], parsed[1]))
    for request in posted:
        request.wait()

    targets = [host_buffer(m.peer, m.tag, e) if host_buffer is not None else planes.host_buffer(e)
               for m, e, _, _ in expected]
    for target, (m, e, _, _) in zip(targets, expected):
        if target.numel() != e or target.dtype != torch.float32:
            raise TransferBroken(f"{what}: no place for {e} elements from rank {m.peer}")
    send_staging = [_Staging(m.payload.numel(), part) for m in sends]
    recv_staging = [_Staging(e, part) for _, e, _, _ in expected]
    # A message's chunks are a prefix of the steps: a rank with a chunk at step k had one
    # at every step before, so its peers' groups of step k are all posted.
    steps = max([_steps(m.payload.numel(), part) for m in sends] + [_steps(e, part) for _, e, _, _ in expected],
                default=0)
    in_flight = 0
    for step in range(steps):
        first = step * part
        ops, arrived = [], []
        for m, staging in zip(sends, send_staging):
            count = min(part, m.payload.numel() - first)
            if count > 0:
                piece = staging.part(m.payload, first, count)
                if staging.buffer is not None:
                    piece.copy_(m.payload[first: first + count], non_blocking=True)
                ops.append(dist.P2POp(dist.isend, piece, m.peer, tag=2 * m.tag))
        for index, ((m, e, _, _), staging) in enumerate(zip(expected, recv_staging)):
            count = min(part, e - first)
            if count > 0:
                piece = staging.part(targets[index], first, count)
                ops.append(dist.P2POp(dist.irecv, piece, m.peer, tag=2 * m.tag))
                arrived.append((index, piece, count))
        in_flight = max(in_flight, sum(op.tensor.numel() * 4 for op in ops))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for index, piece, count in arrived:
            m, e, _, sums = expected[index]
            host = targets[index][first: first + count]
            if recv_staging[index].buffer is not None:
                host.copy_(piece)
            if sums is not None and checksums(host, part)[0] != sums[step]:
                problems.append(f"message from rank {m.peer}: elements {first} to {first + count} of {e} arrived "
                                "damaged or short (checksum differs)")
                expected[index] = (m, e, b"", None)

    broken = planes.control_tensor([len(problems)])
    dist.all_reduce(broken, op=dist.ReduceOp.SUM)
    if int(broken[0]):
        here = f"; on rank {dist.get_rank()}: {problems[0]}" if problems else ""
        raise TransferBroken(f"{what}: {int(broken[0])} message(s) arrived damaged or short{here}")
    return Exchanged({(m.peer, m.tag): Received(header, target)
                      for (m, _, header, _), target in zip(expected, targets)}, in_flight)
