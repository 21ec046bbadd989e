"""Getting and giving back instances: one `Provisioner` per backend, chosen by name.

The coordinator decides how many instances of each pool (pools.py) the job should hold;
a provisioner is how it gets them where the job runs. Backends are registered by name,
as torch.distributed.elastic registers its rendezvous backends, and the coordinator
config's `provisioner:` section names one and gives its options::

    provisioner:
      backend: slurm            # or emulator (`parcae replay`), or one registered by a plugin
      partitions: {v100-spot: spot, v100-on-demand: batch}

A backend is a module with `parse_options(options) -> object` (checks the options when
the config is loaded: ValueError on bad ones) and `create(params) -> Provisioner`. It is
registered by its import path, and imported only when a job uses it.

Most backends run inside the coordinator, which calls them (SLURM: sbatch and scancel
from the control job). A backend whose instances another process starts sets
`REMOTE = True` in its module (the emulator: `parcae replay` plays the cloud): the
coordinator then only publishes the counts it wants (etcd's `provisioning` record), and
that process applies them. Such a backend names its instances `<pool>/<number>`, so the
coordinator tells a member's pool by its instance (`named_pool`).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatron_parcae.provisioning.pools import Pool, PoolConfigError


class ProvisionerError(RuntimeError):
    """A backend could not get or give back instances; the message says which and why."""


@dataclass(frozen=True)
class Instance:
    """One instance a provisioner holds for the job: its name where the job runs (a SLURM
    array element, an emulated instance) and its pool."""

    name: str
    pool: str


class Provisioner(abc.ABC):
    """Requests and releases instances of the job's pools.

    `request` and `release` return at once: an instance runs once it has started (an
    on-demand one after its start-up time, a spot one when the market has it), and
    `running` says which have. Releasing gives back those not started yet first, then the
    newest: they have trained least since the last layout change."""

    def __init__(self, pools: tuple[Pool, ...]) -> None:
        self.pools = {pool.name: pool for pool in pools}

    def pool(self, name: str) -> Pool:
        if name not in self.pools:
            raise ProvisionerError(f"no pool {name!r}; pools: {', '.join(self.pools)}")
        return self.pools[name]

    @staticmethod
    def check_count(count: int) -> int:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ProvisionerError(f"an instance count must be a non-negative integer, got {count!r}")
        return count

    @abc.abstractmethod
    def request(self, pool: str, count: int) -> list[str]:
        """Ask for `count` more instances of `pool` (fewer where the pool's max-count
        stops it); the names of those asked for."""

    @abc.abstractmethod
    def release(self, pool: str, count: int) -> list[str]:
        """Give back up to `count` instances of `pool`; the names of those given back."""

    @abc.abstractmethod
    def running(self, pool: str) -> list[Instance]:
        """The instances of `pool` that have started and not been released or preempted."""

    def pool_of(self, instance: str) -> str | None:
        """The pool of an instance as a member record names it (None: not one of this
        provisioner's). The coordinator prices members whose record names no pool by it."""
        return None

    def close(self) -> None:
        """Stop what the provisioner runs itself (not the instances)."""


@dataclass(frozen=True)
class ProvisionerConfig:
    """The coordinator config's `provisioner:` section: a backend and its options."""

    backend: str
    options: Mapping[str, Any] = field(default_factory=dict)
    parsed: Any = None  # the backend's parse_options(options)

    @classmethod
    def from_dict(cls, data: Any, where: str = "provisioner") -> ProvisionerConfig:
        if not isinstance(data, dict) or not isinstance(data.get("backend"), str):
            raise PoolConfigError(f"{where}: expected a mapping with 'backend' (one of "
                                  f"{', '.join(provisioner_registry.backends())}) and the backend's options")
        backend = data["backend"]
        if backend not in provisioner_registry.backends():
            raise PoolConfigError(f"{where}: backend {backend!r} is not one of "
                                  f"{', '.join(provisioner_registry.backends())}")
        options = {k: v for k, v in data.items() if k != "backend"}
        try:
            parsed = provisioner_registry.module(backend).parse_options(options)
        except (ValueError, TypeError) as exc:
            raise PoolConfigError(f"{where}: {backend}: {exc}") from None
        return cls(backend, options, parsed)


@dataclass(frozen=True)
class ProvisionerParameters:
    """What a backend's `create` gets: the job, its pools, the parsed options, and the
    objects the calling process hands it (`context`: the emulator's host, a command runner)."""

    backend: str
    job: str
    pools: tuple[Pool, ...]
    options: Any
    context: Mapping[str, Any] = field(default_factory=dict)


class ProvisionerRegistry:
    """Backends by name, each an import path of a module (see the module docstring)."""

    def __init__(self) -> None:
        self._modules: dict[str, str] = {}

    def register(self, backend: str, module: str) -> None:
        self._modules[backend] = module

    def backends(self) -> list[str]:
        return sorted(self._modules)

    def module(self, backend: str) -> Any:
        if backend not in self._modules:
            raise PoolConfigError(f"backend {backend!r} is not one of {', '.join(self.backends())}")
        return importlib.import_module(self._modules[backend])

    def create(self, params: ProvisionerParameters) -> Provisioner:
        return self.module(params.backend).create(params)

    def remote(self, backend: str) -> bool:
        """Whether another process applies the backend's counts (see the module docstring)."""
        return bool(getattr(self.module(backend), "REMOTE", False))


provisioner_registry = ProvisionerRegistry()
provisioner_registry.register("emulator", "megatron_parcae.provisioning.emulator")
provisioner_registry.register("slurm", "megatron_parcae.provisioning.slurm")


def create_provisioner(config: ProvisionerConfig, job: str, pools: tuple[Pool, ...], **context: Any) -> Provisioner:
    """The provisioner the coordinator config names, for `job`'s `pools`."""
    return provisioner_registry.create(ProvisionerParameters(config.backend, job, pools, config.parsed, context))


def named_pool(instance: str, pools: Mapping[str, Pool] | tuple[str, ...]) -> str | None:
    """The pool of an instance named `<pool>/<number>`, if `pools` has it."""
    pool = instance.rsplit("/", 1)[0] if "/" in instance else None
    return pool if pool in pools else None
