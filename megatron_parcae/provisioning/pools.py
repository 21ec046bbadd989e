"""Instance pools a job buys from, as the coordinator's config states them.

A pool is one kind of instance in one market: `spot` instances come and go as the cloud
allows (a trace, in simulation); `on-demand` ones start when asked, after their start-up
time, and are never preempted. Each is priced per instance-hour, at a constant or along
a price trace (piecewise constant, hours from the trace's start). In YAML or JSON::

    pools:
      - {name: v100-spot, market: spot, gpus_per_instance: 1, price: 0.918, max_count: 16}
      - name: v100-on-demand
        market: on-demand
        gpus_per_instance: 1
        price: {trace: [[0, 3.06], [24, 2.90]]}   # from hour 0, then from hour 24
        max_count: 16
        startup_hours: 0.1
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKETS = ("spot", "on-demand")
_FIELDS = ("name", "market", "gpus_per_instance", "price", "max_count", "startup_hours")


class PoolConfigError(ValueError):
    """A pool config that cannot be used; the message says where and why."""


def _number(where: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise PoolConfigError(f"{where}: expected a {'positive' if positive else 'non-negative'} number, "
                              f"got {value!r}")
    return float(value)


def _count(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolConfigError(f"{where}: expected a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class PriceTrace:
    """A price that changes over time: `prices[i]` from `hours[i]` on (hours[0] is 0)."""

    hours: tuple[float, ...]
    prices: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.hours or len(self.hours) != len(self.prices):
            raise PoolConfigError("price trace: expected one price per hour mark, at least one")
        if self.hours[0] != 0 or any(b <= a for a, b in zip(self.hours, self.hours[1:])):
            raise PoolConfigError("price trace: hours must start at 0 and strictly increase")

    def at(self, hour: float) -> float:
        return self.prices[max(0, bisect.bisect_right(self.hours, hour) - 1)]

    @classmethod
    def from_list(cls, where: str, rows: Any) -> PriceTrace:
        if not isinstance(rows, list) or not rows:
            raise PoolConfigError(f"{where}: expected a list of [hour, price] pairs")
        hours, prices = [], []
        for k, row in enumerate(rows):
            if not isinstance(row, (list, tuple)) or len(row) != 2:
                raise PoolConfigError(f"{where}[{k}]: expected [hour, price], got {row!r}")
            hours.append(_number(f"{where}[{k}] hour", row[0]))
            prices.append(_number(f"{where}[{k}] price", row[1]))
        if hours[0] != 0 or any(b <= a for a, b in zip(hours, hours[1:])):
            raise PoolConfigError(f"{where}: hours must start at 0 and strictly increase, got {hours}")
        return cls(tuple(hours), tuple(prices))


@dataclass(frozen=True)
class Pool:
    """One kind of instance in one market, and what it costs."""

    name: str
    market: str  # one of MARKETS
    gpus_per_instance: int
    price: float | PriceTrace  # dollars per instance-hour
    max_count: int
    startup_hours: float = 0.0  # from the request until the instance can train

    def __post_init__(self) -> None:
        where = f"pool {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PoolConfigError(f"pool: name must be a non-empty string, got {self.name!r}")
        if self.market not in MARKETS:
            raise PoolConfigError(f"{where}: market must be one of {', '.join(MARKETS)}, got {self.market!r}")
        _count(f"{where}: gpus_per_instance", self.gpus_per_instance)
        _count(f"{where}: max_count", self.max_count)
        _number(f"{where}: startup_hours", self.startup_hours)
        if not isinstance(self.price, PriceTrace):
            _number(f"{where}: price", self.price)

    @property
    def preemptible(self) -> bool:
        return self.market == "spot"

    def price_at(self, hour: float) -> float:
        """Dollars per instance-hour at `hour` (hours from the price trace's start)."""
        return self.price.at(hour) if isinstance(self.price, PriceTrace) else float(self.price)

    @classmethod
    def from_dict(cls, data: Any, where: str = "pool") -> Pool:
        if not isinstance(data, dict):
            raise PoolConfigError(f"{where}: expected a mapping with {', '.join(_FIELDS)}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise PoolConfigError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
        missing = [f for f in _FIELDS[:5] if f not in data]
        if missing:
            raise PoolConfigError(f"{where}: missing {', '.join(missing)}")
        price = data["price"]
        if isinstance(price, dict):
            if set(price) != {"trace"}:
                raise PoolConfigError(f"{where}.price: expected a number or {{trace: [[hour, price], ...]}}")
            price = PriceTrace.from_list(f"{where}.price.trace", price["trace"])
        return cls(data["name"], data["market"], data["gpus_per_instance"], price, data["max_count"],
                   data.get("startup_hours", 0.0))


def load_pools(data: Any, where: str = "pools") -> tuple[Pool, ...]:
    """Pools from a config value: a list of pool mappings, or a mapping with key `pools`."""
    if isinstance(data, dict) and "pools" in data:
        data = data["pools"]
    if not isinstance(data, list) or not data:
        raise PoolConfigError(f"{where}: expected a non-empty list of pools")
    pools = tuple(Pool.from_dict(item, f"{where}[{k}]") for k, item in enumerate(data))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise PoolConfigError(f"{where}: pool names must be unique, got {', '.join(names)}")
    return pools


def read_pools(path: str | Path) -> tuple[Pool, ...]:
    """Pools from a JSON or YAML file (by its suffix)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PoolConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError's parser errors
        raise PoolConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - yaml's errors do not derive from ValueError
        raise PoolConfigError(f"{path}: not valid YAML: {exc}") from None
    return load_pools(data, str(path))


@dataclass(frozen=True)
class Market:
    """The two pools a deadline job buys from: spot first, on-demand to make up."""

    spot: Pool
    on_demand: Pool

    def __post_init__(self) -> None:
        if self.spot.market != "spot" or self.on_demand.market != "on-demand":
            raise PoolConfigError("market: expected one spot pool and one on-demand pool")
        if self.spot.gpus_per_instance != self.on_demand.gpus_per_instance:
            raise PoolConfigError(f"market: pools {self.spot.name!r} and {self.on_demand.name!r} differ in "
                                  f"gpus_per_instance; the job's layouts count GPUs of one kind")

    @classmethod
    def of(cls, pools: tuple[Pool, ...]) -> Market:
        by_market = {m: [p for p in pools if p.market == m] for m in MARKETS}
        if any(len(found) != 1 for found in by_market.values()):
            raise PoolConfigError("pools: a deadline job needs exactly one spot and one on-demand pool, got "
                                  + ", ".join(f"{len(v)} {m}" for m, v in by_market.items()))
        return cls(by_market["spot"][0], by_market["on-demand"][0])

    @classmethod
    def constant(cls, spot_price: float, on_demand_price: float, max_count: int, startup_hours: float,
                 gpus_per_instance: int = 1) -> Market:
        return cls(Pool("spot", "spot", gpus_per_instance, spot_price, max_count, 0.0),
                   Pool("on-demand", "on-demand", gpus_per_instance, on_demand_price, max_count, startup_hours))
