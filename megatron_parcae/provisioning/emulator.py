"""The spot emulator's backend: `parcae replay` plays the cloud.

Each pool holds a target count, which `request` raises and `release` lowers (up to the
pool's max-count). An on-demand pool runs its target; a spot pool runs as many of it as
the trace allows (`set_capacity`, which the replay calls at each step of its trace),
and the rest wait for capacity, as a spot fleet keeps its target. Every instance starts
its pool's start-up time after it is asked for, in trace time (`clock`). Instances over
a pool's allowance go, those still starting first, then the newest: a spot one taken
back by the trace is preempted like any other.

The replay implements `InstanceHost`: it starts an instance's workers under the name
given (`--parcae-instance`), and preempts them. Names are `<pool>/<number>`, so a member
record names its pool through its instance (`pool_of`). The backend is remote: the
coordinator publishes the counts it wants, which the replay applies (`apply`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_parcae.provisioning.pools import Pool
from megatron_parcae.provisioning.provisioner import (
    Instance, Provisioner, ProvisionerError, ProvisionerParameters, named_pool,
)

REMOTE = True  # the replay, not the coordinator, runs this backend


class InstanceHost(Protocol):
    """What runs emulated instances: the replay's job under test."""

    def start_instance(self, name: str) -> None:
        """Start the workers of a new instance called `name`."""

    def stop_instance(self, name: str) -> None:
        """Preempt the workers of instance `name` (notice, then kill after the grace period)."""


@dataclass(frozen=True)
class EmulatorOptions:
    """The emulator takes no options: its pools and the trace say everything."""


def parse_options(options: Mapping[str, Any]) -> EmulatorOptions:
    if options:
        raise ValueError(f"takes no options, got {', '.join(map(str, options))}")
    return EmulatorOptions()


@dataclass
class _Emulated:
    name: str
    pool: str
    ready_at: float  # trace hours
    started: bool = False


class EmulatorProvisioner(Provisioner):
    """See the module docstring. `clock()` is the trace time in hours."""

    def __init__(self, pools: tuple[Pool, ...], host: InstanceHost, clock: Callable[[], float]) -> None:
        super().__init__(pools)
        self._host, self._clock = host, clock
        self._wanted = {name: 0 for name in self.pools}
        self._capacity: dict[str, int] = {}  # spot pools the trace has set
        self._instances: list[_Emulated] = []  # in the order asked for
        self._numbers = 0

    def request(self, pool: str, count: int) -> list[str]:
        limit = self.pool(pool).max_count
        self._wanted[pool] = min(limit, self._wanted[pool] + self.check_count(count))
        before = {i.name for i in self._instances}
        self.step()
        return [i.name for i in self._instances if i.pool == pool and i.name not in before]

    def release(self, pool: str, count: int) -> list[str]:
        self.pool(pool)
        self._wanted[pool] = max(0, self._wanted[pool] - self.check_count(count))
        before = [i.name for i in self._instances if i.pool == pool]
        self.step()
        kept = {i.name for i in self._instances}
        return [name for name in before if name not in kept]

    def running(self, pool: str) -> list[Instance]:
        self.pool(pool)
        return [Instance(i.name, i.pool) for i in self._instances if i.pool == pool and i.started]

    def pool_of(self, instance: str) -> str | None:
        return named_pool(instance, self.pools)

    def held(self, pool: str) -> int:
        """Instances of `pool` asked for and not given back (started or not)."""
        self.pool(pool)
        return self._wanted[pool]

    def apply(self, wanted: Mapping[str, int]) -> dict[str, list[str]]:
        """Request or release the difference to the counts `wanted` (by pool; pools not
        named keep theirs): the names asked for or given back, by pool changed."""
        changed = {}
        for pool, count in wanted.items():
            difference = self.check_count(count) - self.held(pool)
            if difference:
                changed[pool] = self.request(pool, difference) if difference > 0 else self.release(pool, -difference)
        return changed

    def set_capacity(self, pool: str, count: int) -> None:
        """The spot instances of `pool` the trace allows from now on."""
        if self.pool(pool).market != "spot":
            raise ProvisionerError(f"pool {pool!r} is on-demand: its capacity is not the trace's")
        self._capacity[pool] = self.check_count(count)
        self.step()

    def step(self) -> None:
        """Bring every pool to its allowance now: start those whose start-up is over,
        stop the ones over it. The replay calls it as its clock moves."""
        now = self._clock()
        for name, pool in self.pools.items():
            wanted = self._wanted[name]
            allowed = min(wanted, self._capacity.get(name, wanted)) if pool.preemptible else wanted
            mine = [i for i in self._instances if i.pool == name]
            # Over the allowance: those still starting go first, then the newest.
            for instance in sorted(mine, key=lambda i: (i.started, -self._instances.index(i)))[:max(0, len(mine) - allowed)]:
                self._instances.remove(instance)
                if instance.started:
                    self._host.stop_instance(instance.name)
            for _ in range(allowed - len(mine)):
                self._numbers += 1
                self._instances.append(_Emulated(f"{name}/{self._numbers}", name, now + pool.startup_hours))
        for instance in self._instances:
            if not instance.started and instance.ready_at <= now + 1e-12:
                instance.started = True
                self._host.start_instance(instance.name)


def create(params: ProvisionerParameters) -> EmulatorProvisioner:
    missing = [key for key in ("host", "clock") if key not in params.context]
    if missing:
        raise ProvisionerError("the emulator backend runs inside `parcae replay`, which hands it its "
                               f"{' and '.join(missing)}")
    return EmulatorProvisioner(params.pools, params.context["host"], params.context["clock"])
