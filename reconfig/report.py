"""The log line of a layout change: written by rank 0 of the running job, read by the
spot emulator, the tests and the benchmarks. Free of torch, so readers load fast."""

from __future__ import annotations

import re

from reconfig.layout import Parallelism

CHANGE_REPORT = re.compile(
    r"layout change at iteration (?P<iteration>\d+) \(generation (?P<generation>\d+)\): (?P<kind>[\w-]+)"
    r"(?: migration)? to tp (?P<tp>\d+) pp (?P<pp>\d+) dp (?P<dp>\d+)"
    r"(?:, (?P<bytes>\d+) bytes planned)?(?:.*?(?P<lost_steps>\d+) steps lost)?[^|]*?, (?P<ms>[0-9.]+) ms"
    r"(?:, (?P<groups>\d+) process groups, (?P<mib>\d+) MiB resident)?")


def _head(generation: int, iteration: int, kind: str, p: Parallelism) -> str:
    return f" layout change at iteration {iteration} (generation {generation}): {kind} to tp {p.tp} pp {p.pp} dp {p.dp}"


def migration_line(kind: str, generation: int, iteration: int, p: Parallelism, bytes_planned: int, seconds: float,
                   process_groups: int, resident_mib: float) -> str:
    """An in-place migration of `kind` (intra-stage, inter-stage, pipeline, tensor)."""
    return (f"{_head(generation, iteration, f'{kind} migration', p)}, {bytes_planned} bytes planned, "
            f"{seconds * 1000.0:.1f} ms, {process_groups} process groups, {resident_mib:.0f} MiB resident")


def restart_line(generation: int, iteration: int, p: Parallelism, source: str, lost_steps: int, seconds: float) -> str:
    """A layout built from a checkpoint (or the seed): nothing could be migrated."""
    return (f"{_head(generation, iteration, 'restart', p)} from {source}, {lost_steps} steps lost, "
            f"{seconds * 1000.0:.1f} ms")
