"""What a job states about buying instances, as the coordinator config gives it.

    pools:                      # pools.py; `price` may also be {file: PATH} (below)
      - {name: spot, market: spot, gpus_per_instance: 1, price: 0.918, max_count: 16}
      - {name: on-demand, market: on-demand, gpus_per_instance: 1, price: 3.06, max_count: 16,
         startup_hours: 0.1}
    deadline: {samples: 4000000, by: 2026-07-01T12:00:00Z}   # or iterations; or hours: 52
    budget: 1500                # dollars, optional
    provisioner: {backend: slurm, partitions: {spot: spot, on-demand: batch}}

A price trace file (relative to the config's folder) is JSON, a list of [hour, price],
or CSV, rows of `hour,price` (a header row is skipped); hours count from when the job's
dollars started counting. A deadline `by` is a time with its zone (ISO 8601, or Unix
seconds); `hours` counts from that same start. The first pool listed is where members
whose record names no pool are counted.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_parcae.provisioning.pools import Pool, PoolConfigError, load_pools

UNITS = ("samples", "iterations")


@dataclass(frozen=True)
class Deadline:
    """Reach `target` samples or iterations (`unit`) by `at` (Unix seconds), or within
    `hours` of the job's start."""

    unit: str
    target: int
    at: float | None = None
    hours: float | None = None

    def due(self, started_at: float) -> float:
        """The deadline in Unix seconds, for a job whose counting started at `started_at`."""
        return self.at if self.at is not None else started_at + self.hours * 3600

    @classmethod
    def from_dict(cls, data: Any, where: str = "deadline") -> Deadline:
        if not isinstance(data, dict):
            raise PoolConfigError(f"{where}: expected a mapping with samples or iterations, and by or hours")
        unknown = sorted(set(map(str, data)) - {*UNITS, "by", "hours"})
        if unknown:
            raise PoolConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: samples, iterations, by, hours")
        units = [u for u in UNITS if u in data]
        whens = [w for w in ("by", "hours") if w in data]
        if len(units) != 1 or len(whens) != 1:
            raise PoolConfigError(f"{where}: expected one of samples or iterations and one of by or hours, got "
                                  f"{', '.join(map(str, data)) or 'none'}")
        unit, target = units[0], data[units[0]]
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise PoolConfigError(f"{where}: {unit}: expected a positive integer, got {target!r}")
        if whens[0] == "hours":
            hours = data["hours"]
            if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not (0 < hours < 1e6):
                raise PoolConfigError(f"{where}: hours: expected a positive number of hours, got {hours!r}")
            return cls(unit, target, hours=float(hours))
        return cls(unit, target, at=_time(f"{where}: by", data["by"]))


def _time(where: str, value: Any) -> float:
    """Unix seconds from a number, an ISO 8601 string or a YAML timestamp, with a zone."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value < 1e11:
        return float(value)
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            raise PoolConfigError(f"{where}: expected an ISO 8601 time such as 2026-07-01T12:00:00Z, "
                                  f"got {value!r}") from None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise PoolConfigError(f"{where}: {value.isoformat()} has no time zone: add one (Z for UTC)")
        return value.timestamp()
    raise PoolConfigError(f"{where}: expected a time (ISO 8601 with a zone, or Unix seconds), got {value!r}")


def budget_of(value: Any, where: str = "budget") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PoolConfigError(f"{where}: expected a positive number of dollars, got {value!r}")
    return float(value)


def read_price_trace(path: Path, where: str) -> list[list[float]]:
    """[[hour, price], ...] from a JSON or CSV file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolConfigError(f"{where}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise PoolConfigError(f"{where}: {path} is not valid JSON: {exc}") from None
    rows = []
    for number, row in enumerate(csv.reader(text.splitlines()), 1):
        if not row or (number == 1 and not _is_number(row[0])):
            continue
        if len(row) != 2 or not all(map(_is_number, row)):
            raise PoolConfigError(f"{where}: {path}:{number}: expected hour,price, got {','.join(row)!r}")
        rows.append([float(row[0]), float(row[1])])
    return rows


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def config_pools(data: Any, base: Path, where: str = "pools") -> tuple[Pool, ...]:
    """The pools of a config, price trace files read (relative to `base`)."""
    if isinstance(data, list):
        resolved = []
        for k, item in enumerate(data):
            price = item.get("price") if isinstance(item, dict) else None
            if isinstance(price, dict) and set(price) == {"file"}:
                if not isinstance(price["file"], str) or not price["file"]:
                    raise PoolConfigError(f"{where}[{k}].price.file: expected a file path, got {price['file']!r}")
                path = Path(price["file"]) if Path(price["file"]).is_absolute() else base / price["file"]
                item = {**item, "price": {"trace": read_price_trace(path, f"{where}[{k}].price.file")}}
            resolved.append(item)
        data = resolved
    return load_pools(data, where)
