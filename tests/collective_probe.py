"""Run a training script with every torch.distributed collective checked for its plane,
and its point-to-point traffic checked against NCCL's rules.

    python tests/collective_probe.py OUT_DIR SCRIPT [ARGS...]

Planes. Each collective that the project's own code calls (megatron_parcae/, reconfig/)
must get tensors that reconfig.planes made, on that plane's device: control-plane tensors
on the CPU, data-plane ones on `planes.data_device()`. A tensor made anywhere else is
what went wrong before GPU runs, and on CPU nothing else would notice it.

NCCL's rules. On CPU every plane is gloo, which matches messages by tag and buffers
sends, so an exchange that NCCL would hang on passes. The probe records, for each WORLD
(named by its store prefix, alike in every process), what each rank posts in order: its
point-to-point operations (peer, size, plane, and the `batch_isend_irecv` group they were
posted in), its waits, and its collectives. `read_findings` then replays the ranks
together under NCCL's rules for the data plane: unbatched operations between two ranks
run in order on one stream per pair and are matched by order, not tag (two sends facing
each other, or a receive queued behind a send while the peer does the same, never
complete); a batch runs as one group on the communicator's stream, whose first use must
be a collective of every rank; a wait blocks its rank until the operation completes.
What cannot complete is a violation. Control-plane (gloo) messages are matched by tag.

Each process appends its findings to OUT_DIR/probe-PID.jsonl as it goes (a killed worker
keeps what it found). megatron-core's own collectives are not checked.
"""

from __future__ import annotations

import itertools
import json
import os
import runpy
import sys
from collections import defaultdict, deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The project's code, and what PARCAE_PROBE_ALSO adds (a test's own script).
OURS = (str(REPO / "megatron_parcae") + os.sep, str(REPO / "reconfig") + os.sep,
        *filter(None, [os.environ.get("PARCAE_PROBE_ALSO")]))
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# Collectives the project must not call itself: barrier picks NCCL on GPUs (planes has a
# control-plane one); object collectives pickle.
FORBIDDEN = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


class Probe:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"probe-{os.getpid()}.jsonl"
        self.seen: set[tuple[str, str]] = set()
        self.prefixes: dict[int, str] = {}
        self.stores: list = []  # keeps the stores whose ids name prefixes alive
        self.comm: str | None = None
        self.rank = -1
        self.ids = itertools.count()
        self.batches = itertools.count()

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _site(self, name: str, depth: int) -> str | None:
        frame = sys._getframe(depth)
        where = frame.f_code.co_filename
        if not where.startswith(OURS):
            return None
        function = frame
        while function.f_code.co_name.startswith("<") and function.f_back is not None:  # <listcomp>
            function = function.f_back
        return f"{os.path.relpath(where, REPO)}:{function.f_code.co_name}:{name}"

    def check(self, site: str, name: str, tensors: list) -> list[str | None]:
        """The plane of each tensor, writing a violation for a misplaced one."""
        from reconfig import planes

        found = []
        for tensor in tensors:
            plane = planes.plane_of(tensor) if isinstance(tensor, torch.Tensor) else None
            found.append(plane)
            if plane is None:
                self._write({"violation": f"{site}: a tensor reconfig.planes did not make"})
                continue
            expected = torch.device("cpu") if plane == planes.CONTROL else planes.data_device()
            if tensor.device != expected:
                self._write({"violation": f"{site}: {plane}-plane tensor on {tensor.device}, not {expected}"})
            if (site, plane) not in self.seen:
                self.seen.add((site, plane))
                self._write({"site": site, "plane": plane})
        return found

    def post(self, record: dict) -> None:
        if self.comm is not None:
            self._write({"comm": self.comm, "rank": self.rank, **record})

    def install(self) -> None:
        for name in TENSOR_COLLECTIVES:
            setattr(dist, name, _Collective(self, name, getattr(dist, name)))
        for name in POINT_TO_POINT:
            setattr(dist, name, _PointToPoint(self, name, getattr(dist, name)))
        for name in FORBIDDEN:
            setattr(dist, name, _Forbidden(self, name, getattr(dist, name)))
        dist.batch_isend_irecv = _Batch(self, dist.batch_isend_irecv)
        dist.P2POp = _P2POp
        original_prefix_store = dist.PrefixStore

        def prefix_store(prefix, store):
            made = original_prefix_store(prefix, store)
            self.prefixes[id(made)] = prefix
            self.stores.append(made)
            return made

        dist.PrefixStore = prefix_store
        original_init, original_destroy = dist.init_process_group, dist.destroy_process_group

        def init_process_group(*args, **kwargs):
            result = original_init(*args, **kwargs)
            store = kwargs.get("store")
            self.comm = "env" if store is None else self.prefixes.get(id(store), f"store-{id(store)}")
            self.rank = dist.get_rank()
            self.post({"open": dist.get_world_size()})
            return result

        def destroy_process_group(group=None):
            if group is None or group is dist.GroupMember.WORLD:
                self.post({"close": True})
                self.comm = None
            return original_destroy(group)

        dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
        from torch.distributed import distributed_c10d

        original_abort = distributed_c10d._abort_process_group

        def abort_process_group(group=None):
            if group is None or group is dist.GroupMember.WORLD:
                self.post({"failed": "aborted"})  # what was in flight may never complete
                self.comm = None
            return original_abort(group)

        distributed_c10d._abort_process_group = abort_process_group


def _on_world(group) -> bool:
    return group is None or group is dist.GroupMember.WORLD


class _Work:
    """A request whose waits are recorded."""

    def __init__(self, probe: Probe, ident: int, work) -> None:
        self.probe, self.ident, self.work = probe, ident, work

    def wait(self, *args, **kwargs):
        self.probe.post({"wait": self.ident})
        try:
            return self.work.wait(*args, **kwargs)
        except BaseException:
            self.probe.post({"failed": self.ident})
            raise

    def __getattr__(self, name):
        return getattr(self.work, name)


class _Collective:
    def __init__(self, probe: Probe, name: str, original) -> None:
        self.probe, self.name, self.original = probe, name, original

    def __call__(self, *args, **kwargs):
        site = self.probe._site(self.name, 2)
        if site is None:
            return self.original(*args, **kwargs)
        first = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
        planes_found = self.probe.check(site, self.name, first if isinstance(first, (list, tuple)) else [first])
        group = kwargs.get("group")
        recorded = _on_world(group)
        if recorded:
            self.probe.post({"collective": self.name, "plane": planes_found[0], "site": site})
        try:
            return self.original(*args, **kwargs)
        except BaseException:
            if recorded:
                self.probe.post({"failed": "collective"})
            raise


class _PointToPoint:
    def __init__(self, probe: Probe, name: str, original) -> None:
        self.probe, self.name, self.original = probe, name, original

    def __call__(self, tensor, peer=None, group=None, tag=0, **kwargs):
        site = self.probe._site(self.name, 2)
        if site is None:
            return self.original(tensor, peer, group, tag, **kwargs)
        plane = self.probe.check(site, self.name, [tensor])[0]
        if not _on_world(group):
            self.probe._write({"violation": f"{site}: point-to-point outside WORLD"})
            return self.original(tensor, peer, group, tag, **kwargs)
        ident = next(self.probe.ids)
        kind = "send" if self.name in ("send", "isend") else "recv"
        blocking = self.name in ("send", "recv")
        self.probe.post({"post": ident, "op": kind, "peer": peer, "plane": plane, "n": tensor.numel(), "tag": tag,
                         "site": site})
        if blocking:
            self.probe.post({"wait": ident})
        try:
            work = self.original(tensor, peer, group, tag, **kwargs)
        except BaseException:
            self.probe.post({"failed": ident})
            raise
        return work if blocking else _Work(self.probe, ident, work)


class _Forbidden:
    def __init__(self, probe: Probe, name: str, original) -> None:
        self.probe, self.name, self.original = probe, name, original

    def __call__(self, *args, **kwargs):
        site = self.probe._site(self.name, 2)
        if site is not None:
            self.probe._write({"violation": f"{site}: the project calls {self.name}"})
        return self.original(*args, **kwargs)


class _Batch:
    """batch_isend_irecv: one group of operations, all of WORLD's data plane."""

    def __init__(self, probe: Probe, original) -> None:
        self.probe, self.original = probe, original

    def __call__(self, ops):
        site = self.probe._site("batch_isend_irecv", 2)
        if site is None:
            return self.original(ops)
        batch = next(self.probe.batches)
        posted = []
        for op in ops:
            plane = self.probe.check(site, "batch_isend_irecv", [op.tensor])[0]
            if not _on_world(op.group):
                self.probe._write({"violation": f"{site}: batched point-to-point outside WORLD"})
            kind = "send" if op.op is _original(dist.isend) or getattr(op.op, "__name__", "") == "isend" else "recv"
            ident = next(self.probe.ids)
            posted.append(ident)
            self.probe.post({"post": ident, "op": kind, "peer": op.peer, "plane": plane, "n": op.tensor.numel(),
                             "tag": op.tag, "batch": batch, "site": site})
        works = self.original(ops)
        return [_Work(self.probe, ident, work) for ident, work in zip(posted, works)]


def _original(function):
    return getattr(function, "original", function)


# -- replaying the ranks under NCCL's rules ---------------------------------------------


class _Op:
    def __init__(self, rank: int, record: dict) -> None:
        self.rank, self.kind, self.peer = rank, record["op"], record["peer"]
        self.plane, self.n, self.tag = record["plane"], record["n"], record["tag"]
        self.site = record.get("site", "?")
        self.done = False
        self.unit: dict | None = None

    def describe(self) -> str:
        direction = "to" if self.kind == "send" else "from"
        return f"rank {self.rank} {self.kind}s {self.n} elements {direction} rank {self.peer} ({self.site})"


def _replay(comm: str, segments: dict[int, list[dict]]) -> list[str]:
    """NCCL's hangs in one WORLD's traffic (see the module docstring)."""
    size = max((r.get("open", 0) for events in segments.values() for r in events), default=0)
    ranks = sorted(segments)
    ops: dict[tuple[int, int], _Op] = {}
    pair: dict[tuple[int, int], deque] = defaultdict(deque)  # unbatched data plane, per (rank, peer)
    units: dict[int, deque] = defaultdict(deque)  # the communicator's stream: batches and data collectives
    batched = {"send": defaultdict(list), "recv": defaultdict(list)}  # (sender, receiver) -> ops in order
    tagged_sends: dict[tuple, int] = defaultdict(int)
    tagged_recvs: list[tuple[_Op, tuple, int]] = []
    tagged_count: dict[tuple, int] = defaultdict(int)
    control_reached = defaultdict(int)
    data_collectives = defaultdict(int)
    open_batch: dict[int, dict] = {}
    pc = {r: 0 for r in ranks}
    blocked: dict[int, tuple | None] = {r: None for r in ranks}
    failed = any("failed" in e for events in segments.values() for e in events)
    closed = all(any("close" in e for e in segments[r]) for r in ranks) and len(ranks) == size
    violations: list[str] = []

    def free(rank: int) -> bool:
        why = blocked[rank]
        if why is None:
            return True
        if why[0] == "wait":
            done = ops[why[1]].done
        elif why[0] == "control":
            done = all(control_reached[r] >= why[1] for r in ranks) and len(ranks) == size
        else:
            done = why[1]["done"]
        if done:
            blocked[rank] = None
        return done

    def close_batch(rank: int) -> None:
        unit = open_batch.pop(rank, None)
        if unit is not None:
            units[rank].append(unit)

    progress = True
    while progress and not violations:
        progress = False
        for rank in ranks:
            events = segments[rank]
            while free(rank) and pc[rank] < len(events):
                e = events[pc[rank]]
                pc[rank] += 1
                progress = True
                if "batch" not in e or "post" not in e or (rank in open_batch and open_batch[rank]["id"] != e["batch"]):
                    close_batch(rank)
                if "post" in e:
                    op = ops[rank, e["post"]] = _Op(rank, e)
                    if op.plane != "data":
                        key = (rank, op.peer, op.tag) if op.kind == "send" else (op.peer, rank, op.tag)
                        if op.kind == "send":
                            tagged_sends[key] += 1
                            op.done = True
                        else:
                            tagged_recvs.append((op, key, tagged_count[key]))
                            tagged_count[key] += 1
                    elif "batch" in e:
                        if rank not in open_batch:
                            if data_collectives[rank] == 0:
                                violations.append(f"{comm}: {op.describe()} in a batch before any collective of "
                                                  "every rank set the data plane's communicator up")
                            open_batch[rank] = {"id": e["batch"], "ops": [], "done": False}
                        open_batch[rank]["ops"].append(op)
                        op.unit = open_batch[rank]
                        sender, receiver = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                        batched[op.kind][sender, receiver].append(op)
                    else:
                        pair[rank, op.peer].append(op)
                elif "wait" in e and isinstance(e["wait"], int):
                    close_batch(rank)
                    blocked[rank] = ("wait", (rank, e["wait"]))
                elif "collective" in e:
                    if e["plane"] == "data":
                        unit = {"collective": data_collectives[rank], "done": False}
                        data_collectives[rank] += 1
                        units[rank].append(unit)
                        blocked[rank] = ("unit", unit)
                    else:
                        control_reached[rank] += 1
                        blocked[rank] = ("control", control_reached[rank])
            close_batch(rank) if pc[rank] >= len(events) else None
        # gloo: a receive completes once its send is posted
        for op, key, index in tagged_recvs:
            if not op.done and tagged_sends[key] > index:
                op.done = progress = True
        # unbatched data plane: heads of a pair's two streams must be a send and a receive
        for (a, b), queue in list(pair.items()):
            other = pair.get((b, a))
            while queue and other:
                x, y = queue[0], other[0]
                if x.kind == y.kind:
                    violations.append(f"{comm}: NCCL would hang: {x.describe()} while {y.describe()}, "
                                      f"neither batched: both first {x.kind} on pair {min(a, b)}-{max(a, b)}")
                    break
                if x.n != y.n:
                    violations.append(f"{comm}: {x.describe()} is matched (by order) with {y.describe()}")
                x.done = y.done = progress = True
                queue.popleft()
                other.popleft()
        # the communicator's stream: a batch's operations match their peers' by order per pair
        heads = {r: units[r][0] for r in ranks if units[r]}
        for r, unit in heads.items():
            for op in unit.get("ops", []):
                if op.done or op.kind != "send":
                    continue
                index = batched["send"][r, op.peer].index(op)
                receives = batched["recv"][r, op.peer]
                if index < len(receives) and receives[index].unit is heads.get(op.peer):
                    other = receives[index]
                    if other.n != op.n:
                        violations.append(f"{comm}: {op.describe()} is matched (by order) with {other.describe()}")
                    op.done = other.done = progress = True
        collectives = {u.get("collective") for u in heads.values()}
        if len(heads) == len(ranks) == size and len(collectives) == 1 and None not in collectives:
            for unit in heads.values():
                unit["done"] = True
        for r in ranks:
            while units[r] and (units[r][0]["done"] or ("ops" in units[r][0]
                                                         and all(op.done for op in units[r][0]["ops"]))):
                units[r].popleft()["done"] = True
                progress = True
    if not violations and closed and not failed:
        stuck = [r for r in ranks if pc[r] < len(segments[r]) or not free(r)]
        if stuck:
            waiting = []
            for r in stuck:
                why = blocked[r]
                what = ops[why[1]].describe() if why and why[0] == "wait" else str(why and why[0])
                waiting.append(f"rank {r} waits on {what}")
            violations.append(f"{comm}: NCCL would hang, a wait before the matching post: {'; '.join(waiting)}")
    return violations


def nccl_violations(records: list[dict]) -> list[str]:
    """What NCCL would hang on in the recorded traffic (records of every process)."""
    comms: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        if "comm" in record:
            comms[record["comm"]][record["rank"]].append(record)
    return [v for comm, segments in comms.items() for v in _replay(comm, segments)]


def read_findings(out_dir: Path) -> tuple[set[tuple[str, str]], list[str]]:
    """(site, plane) pairs seen and violations found, over every process's file, NCCL's
    rules included."""
    sites, violations, traffic = set(), [], []
    for path in sorted(out_dir.glob("probe-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a process killed mid-line
                continue
            if "violation" in record:
                violations.append(record["violation"])
            elif "site" in record and "plane" in record and "comm" not in record:
                sites.add((record["site"], record["plane"]))
            elif "comm" in record:
                traffic.append(record)
    return sites, violations + nccl_violations(traffic)


if __name__ == "__main__":
    # torch is imported only here, where the probe runs: multiprocessing's spawned helpers
    # (the checkpoint writer's results queue) import this file again as a module, and
    # tests read findings with it.
    import torch
    import torch.distributed as dist

    class _P2POp(dist.P2POp):
        """torch's P2POp with the original isend/irecv: batch_isend_irecv tells them apart
        by identity."""

        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, _original(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(_original(op), *args, **kwargs)

    out, script, *rest = sys.argv[1:]
    Probe(Path(out)).install()
    # Small chunks, so that the chunked gathers of optimizer state and the chunked
    # exchanges run in many pieces.
    from reconfig import optimizer_state, transfer

    optimizer_state.GATHER_CHUNK_ELEMENTS = 4096
    transfer.CHUNK_ELEMENTS = int(os.environ.get("PARCAE_PROBE_CHUNK", "65536"))
    script = str(Path(script).resolve())  # frames name their file as run: absolute, as OURS
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")
