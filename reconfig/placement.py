"""Where workers run: instances (nodes) of G GPUs, one worker per GPU.

A preemption takes a whole instance, and tensor parallelism must stay on the instance's
NVLink, so layouts are placed in blocks: Megatron ranks [k*G, (k+1)*G) of a layout all
run on one instance. Megatron orders ranks tensor-parallel first, so with T dividing G
no tensor-parallel group crosses an instance. A job of one-GPU instances is the case
G = 1, where every worker is its own instance.
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
    """The instance each worker runs on, and how many GPUs (workers) an instance has."""

    gpus_per_instance: int = 1
    instance_of: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = require_int("placement.gpus_per_instance", self.gpus_per_instance, 1)
        if g > MAX_GPUS_PER_INSTANCE:
            raise ValueError(f"placement.gpus_per_instance: at most {MAX_GPUS_PER_INSTANCE}, got {g}")
        if not isinstance(self.instance_of, Mapping):
            raise ValueError(f"placement.instances: expected an object, got {type(self.instance_of).__name__}")
        checked = {}
        for worker, instance in self.instance_of.items():
            require_int("placement.instances key", worker, 0)
            if not isinstance(instance, str) or not instance:
                raise ValueError(f"placement.instances[{worker}]: expected an instance name, got {instance!r}")
            checked[worker] = instance
        object.__setattr__(self, "instance_of", checked)
        crowded = [i for i, n in Counter(checked.values()).items() if n > g]
        if crowded:
            raise ValueError(f"placement: instance(s) {', '.join(sorted(crowded))} run more than "
                             f"{g} workers (gpus_per_instance)")

    def instance(self, worker: int) -> str:
        """The worker's instance; a worker the placement does not name is its own."""
        return self.instance_of.get(worker, f"worker-{worker}")

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
        return {"gpus_per_instance": self.gpus_per_instance,
                "instances": {str(w): i for w, i in sorted(self.instance_of.items())}}

    @classmethod
    def from_dict(cls, d: Any) -> Placement:
        require_fields("placement", d, {"gpus_per_instance", "instances"})
        instances = d["instances"]
        if not isinstance(instances, dict):
            raise ValueError(f"placement.instances: expected an object, got {type(instances).__name__}")
        parsed = {}
        for key, instance in instances.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise ValueError(f"placement.instances: key {key!r} is not a worker id")
            parsed[int(key)] = instance
        return cls(d["gpus_per_instance"], parsed)


ONE_GPU = Placement()


def copy_holders(layout: Layout, placement: Placement) -> dict[int, int]:
    """worker -> its buddy: the worker G ranks on (G GPUs an instance), which is on the
    next instance of the layout, so no instance holds its own copy. Empty for a layout on
    one instance."""
    g, slots = placement.gpus_per_instance, layout.slots
    if len(slots) <= g:
        return {}
    holders = {w: slots[(r + g) % len(slots)] for r, w in enumerate(slots)}
    return {w: h for w, h in holders.items() if placement.instance(w) != placement.instance(h)}
