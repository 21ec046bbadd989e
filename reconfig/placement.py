"""Where workers run: instances (nodes) of G GPUs, one worker per GPU.

A preemption takes a whole instance, and tensor parallelism must stay on the instance's
NVLink, so layouts are placed in blocks: Megatron ranks [k*G, (k+1)*G) of a layout all
run on one instance. Megatron orders ranks tensor-parallel first, so with T dividing G
no tensor-parallel group crosses an instance. A job of one-GPU instances is the case
G = 1, where every worker is its own instance.

Instances may also be named in failure domains (a cloud zone, a rack, a switch): instances
of one domain may fail together, so buddies (`copy_holders`) are chosen across domains.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reconfig.layout import Layout, Parallelism, require_fields, require_int

MAX_GPUS_PER_INSTANCE = 64


@dataclass(frozen=True)
class Placement:
    """The instance each worker runs on, how many GPUs (workers) an instance has, and the
    failure domain of the workers whose domain is known (the others: unknown)."""

    gpus_per_instance: int = 1
    instance_of: Mapping[int, str] = field(default_factory=dict)
    domain_of: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = require_int("placement.gpus_per_instance", self.gpus_per_instance, 1)
        if g > MAX_GPUS_PER_INSTANCE:
            raise ValueError(f"placement.gpus_per_instance: at most {MAX_GPUS_PER_INSTANCE}, got {g}")
        checked = _names_by_worker("placement.instances", self.instance_of, "an instance name")
        object.__setattr__(self, "instance_of", checked)
        crowded = [i for i, n in Counter(checked.values()).items() if n > g]
        if crowded:
            raise ValueError(f"placement: instance(s) {', '.join(sorted(crowded))} run more than "
                             f"{g} workers (gpus_per_instance)")
        domains = _names_by_worker("placement.domains", self.domain_of, "a failure domain name")
        object.__setattr__(self, "domain_of", domains)
        # A domain is a property of the instance: its workers fail with it.
        named: dict[str, set[str]] = {}
        for worker, domain in domains.items():
            named.setdefault(self.instance(worker), set()).add(domain)
        split = sorted(i for i, found in named.items() if len(found) > 1)
        if split:
            raise ValueError(f"placement: instance(s) {', '.join(split)} are named in more than one failure domain")

    def instance(self, worker: int) -> str:
        """The worker's instance; a worker the placement does not name is its own."""
        return self.instance_of.get(worker, f"worker-{worker}")

    def domain(self, worker: int) -> str | None:
        """The worker's failure domain; None where it is not known."""
        return self.domain_of.get(worker)

    def instances(self, workers: Iterable[int]) -> dict[str, list[int]]:
        """The instances `workers` run on, each with its workers in id order."""
        found: dict[str, list[int]] = {}
        for worker in sorted(workers):
            found.setdefault(self.instance(worker), []).append(worker)
        return found

    def capacity(self, workers: Iterable[int]) -> int:
        """The most ranks a layout can place on `workers`: a whole block on each instance
        with G of them, and of the others only the fullest, for the last, short block."""
        g = self.gpus_per_instance
        sizes = [len(found) for found in self.instances(workers).values()]
        return g * sum(n == g for n in sizes) + max((n for n in sizes if n < g), default=0)

    def fits(self, parallelism: Parallelism) -> bool:
        """Whether `parallelism`'s tensor-parallel groups can stay inside instances."""
        return self.gpus_per_instance % parallelism.tp == 0

    def block(self, rank: int) -> int:
        """The placement block (one instance) of Megatron rank `rank`."""
        return rank // self.gpus_per_instance

    def blocks(self, world_size: int) -> list[range]:
        """The ranks of each placement block of a layout (the last may be short)."""
        g = self.gpus_per_instance
        return [range(start, min(start + g, world_size)) for start in range(0, world_size, g)]

    def check(self, layout: Layout) -> None:
        """Refuse a layout that splits a block over instances (so a TP group would cross one)."""
        if self.gpus_per_instance == 1:
            return
        if not self.fits(layout.parallelism):
            raise ValueError(f"tensor-parallel size {layout.parallelism.tp} does not divide the "
                             f"{self.gpus_per_instance} GPUs of an instance")
        for block in self.blocks(layout.parallelism.world_size):
            instances = {self.instance(layout.slots[r]) for r in block}
            if len(instances) > 1:
                raise ValueError(f"ranks {block.start}-{block.stop - 1} are placed on several instances "
                                 f"({', '.join(sorted(instances))}); a block of {self.gpus_per_instance} "
                                 f"ranks must share one")

    def assign(self, target: Parallelism, workers: Sequence[int]) -> tuple[int, ...]:
        """Slots of `target` filled from `workers` in order of preference, a block per instance.

        For a fresh start or a restart, where no state decides who sits where.
        """
        if self.gpus_per_instance == 1:
            if len(workers) < target.world_size:
                raise ValueError(f"{target.world_size} workers needed, {len(workers)} available")
            return tuple(workers[:target.world_size])
        if not self.fits(target):
            raise ValueError(f"tensor-parallel size {target.tp} does not divide the "
                             f"{self.gpus_per_instance} GPUs of an instance")
        by_instance: dict[str, list[int]] = {}
        for worker in workers:
            by_instance.setdefault(self.instance(worker), []).append(worker)
        free = list(by_instance.values())
        slots: list[int] = []
        for block in self.blocks(target.world_size):
            found = next((i for i, group in enumerate(free) if len(group) >= len(block)), None)
            if found is None:
                raise ValueError(f"{target.tp}x{target.pp}x{target.dp} (tp x pp x dp) needs "
                                 f"{len(self.blocks(target.world_size))} instances with up to "
                                 f"{self.gpus_per_instance} workers each; the available ones do not have them")
            slots.extend(free.pop(found)[:len(block)])
        return tuple(slots)

    def to_dict(self) -> dict[str, Any]:
        """Domains only where some are named, so plans without them read as before."""
        d: dict[str, Any] = {"gpus_per_instance": self.gpus_per_instance,
                             "instances": {str(w): i for w, i in sorted(self.instance_of.items())}}
        if self.domain_of:
            d["domains"] = {str(w): domain for w, domain in sorted(self.domain_of.items())}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Placement:
        require_fields("placement", d, {"gpus_per_instance", "instances"}, frozenset({"domains"}))
        return cls(d["gpus_per_instance"], _by_worker("placement.instances", d["instances"]),
                   _by_worker("placement.domains", d.get("domains", {})))


def _names_by_worker(where: str, names: Any, what: str) -> dict[int, str]:
    """A mapping of worker ids to non-empty names, checked."""
    if not isinstance(names, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(names).__name__}")
    for worker, name in names.items():
        require_int(f"{where} key", worker, 0)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}[{worker}]: expected {what}, got {name!r}")
    return dict(names)


def _by_worker(where: str, names: Any) -> dict[int, Any]:
    """A JSON object keyed by worker id, with int keys."""
    if not isinstance(names, dict):
        raise ValueError(f"{where}: expected an object, got {type(names).__name__}")
    parsed = {}
    for key, name in names.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"{where}: key {key!r} is not a worker id")
        parsed[int(key)] = name
    return parsed


ONE_GPU = Placement()


def copy_holders(layout: Layout, placement: Placement) -> dict[int, int]:
    """worker -> its buddy: the worker G places on (G GPUs an instance) in the layout's
    workers ordered by `_across_domains`, which is on the next instance of that order, so
    no instance holds its own copy, and one failure domain loses a worker together with its
    copy only where the domain has more than half of the instances. A rotation: every
    worker holds at most one copy. Without domains the order is the ranks'. Empty for a
    layout on one instance."""
    g, slots = placement.gpus_per_instance, layout.slots
    if len(slots) <= g:
        return {}
    order = [w for block in _across_domains([slots[r.start:r.stop] for r in placement.blocks(len(slots))],
                                            placement) for w in block]
    holders = {w: order[(i + g) % len(order)] for i, w in enumerate(order)}
    return {w: h for w, h in holders.items() if placement.instance(w) != placement.instance(h)}


def _across_domains(blocks: list[tuple[int, ...]], placement: Placement) -> list[tuple[int, ...]]:
    """The blocks (instances) reordered so that neighbours, the last and the first too, are
    in different failure domains where the domains' sizes allow: each next block comes from
    the domain with the most blocks left, other than the previous block's (ties: the more
    populous domain, then the earlier rank), in rank order within a domain. This leaves
    2 * largest - blocks same-domain neighbours where one domain has more than half the
    blocks, and none otherwise. A block of unknown domain is a domain of its own, so with no
    domains named the order is the ranks'."""
    by_domain: dict[str | int, list[tuple[int, ...]]] = {}
    for index, block in enumerate(blocks):
        named = next((d for d in map(placement.domain, block) if d is not None), None)
        by_domain.setdefault(index if named is None else named, []).append(block)
    domains = sorted(by_domain.values(), key=len, reverse=True)  # stable: ties in rank order
    left = [len(d) for d in domains]
    order: list[tuple[int, ...]] = []
    previous = -1
    for _ in blocks:
        chosen = max((d for d in range(len(domains)) if left[d] and d != previous),
                     key=lambda d: (left[d], -d), default=previous)
        order.append(domains[chosen][len(domains[chosen]) - left[chosen]])
        left[chosen] -= 1
        previous = chosen
    return order
