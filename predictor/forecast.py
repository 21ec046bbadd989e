"""Availability forecasters: how many instances the next H intervals will have.

Every forecaster has the same shape. The live coordinator (and the back-test) feeds it
one interval at a time with ``observe``; it keeps the point path it would have issued at
every origin and scores it when the outcomes arrive. Its forecast distribution is its
point forecast plus its own recent errors at the same horizon step, taken from origins
in the same regime as now (how many changes the last ``volatility_window`` intervals
saw, and whether the count is at its highest so far: errors after a calm spell at the
cap differ from errors in the middle of a preemption storm). Outcomes are clipped to
0..highest count seen, so the expected count (the mean) respects the cap. Expected
preemptions per step are what followed recent origins in the same regime; expected
arrivals then follow from ``change of expected count = arrivals - preemptions``, so the
three outputs agree with each other.

On real spot traces the last count is very hard to beat (counts move in steps and stay
put most of the time). The default forecaster therefore starts as last value and
switches a horizon step to another model (rolling median, Prophet) only when that
model's paired absolute errors on the recent history are lower by a clear margin (mean
difference more than ``switch_z`` standard errors below zero).

Counts are integers, so a point interval such as [16, 16] would "cover" every interval
without a change and no honest 80% interval could exist when the count stays put more
than 80% of the time. Quantiles other than the median are therefore quantiles of the
count spread over [count - 0.5, count + 0.5] (the usual continuity correction for
counts); the back-test scores coverage the same way. The median is the point forecast.
"""

from __future__ import annotations

import abc
import inspect
import logging
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = [
    "AvailabilityForecast",
    "Forecaster",
    "LastValueForecaster",
    "RollingMedianForecaster",
    "ProphetForecaster",
    "DefaultForecaster",
    "FORECASTERS",
    "QUANTILES",
    "make_forecaster",
]

log = logging.getLogger(__name__)

QUANTILES: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
_SPREAD_LEVELS = np.array([level for level in QUANTILES if level != 0.5])
_REGIMES = 6


@dataclass(frozen=True, eq=False)
class AvailabilityForecast:
    """Forecast for the ``H`` intervals after the last observed one (step 1 is next).

    ``quantiles[0.5]`` is the point forecast (what ``mae`` scores); the other levels are
    continuity-corrected (see the module docstring). ``models`` names, per step, the
    model whose point forecast was used.
    """

    interval_seconds: float
    expected: np.ndarray
    quantiles: dict[float, np.ndarray]
    preemptions: np.ndarray
    arrivals: np.ndarray
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_seconds) and self.interval_seconds > 0):
            raise ValueError(f"interval_seconds must be positive, got {self.interval_seconds}")
        expected = _frozen(self.expected, "expected")
        horizon = len(expected)
        quantiles = {float(level): _frozen(values, f"quantiles[{level}]") for level, values in self.quantiles.items()}
        for required in (0.1, 0.5, 0.9):
            if required not in quantiles:
                raise ValueError(f"quantiles must include {required}")
        levels = sorted(quantiles)
        if not all(0 < level < 1 for level in levels):
            raise ValueError(f"quantile levels must lie in (0, 1), got {levels}")
        arrays = [expected, *quantiles.values()]
        for name in ("preemptions", "arrivals"):
            arrays.append(_frozen(getattr(self, name), name))
            object.__setattr__(self, name, arrays[-1])
        if any(len(array) != horizon for array in arrays):
            raise ValueError("expected, quantiles, preemptions and arrivals must all have one value per step")
        if np.any(self.preemptions < 0) or np.any(self.arrivals < 0) or np.any(expected < 0):
            raise ValueError("expected counts and event counts must be non-negative")
        stacked = np.array([quantiles[level] for level in levels])
        if np.any(np.diff(stacked, axis=0) < -1e-9):
            raise ValueError("quantiles must not decrease with the level")
        if self.models and len(self.models) != horizon:
            raise ValueError("models must name one model per step")
        object.__setattr__(self, "expected", expected)
        object.__setattr__(self, "quantiles", quantiles)
        object.__setattr__(self, "models", tuple(self.models))

    @property
    def horizon(self) -> int:
        return len(self.expected)

    def interval(self, coverage: float = 0.8) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper bounds of the central interval with this coverage."""
        low, high = round((1 - coverage) / 2, 10), round((1 + coverage) / 2, 10)
        if low not in self.quantiles or high not in self.quantiles:
            raise ValueError(f"no {coverage:.0%} interval: quantiles {low} and {high} are not in this forecast")
        return self.quantiles[low], self.quantiles[high]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for etcd, logs); ``from_dict`` reads it back with validation."""
        return {
            "interval_seconds": self.interval_seconds,
            "expected": self.expected.tolist(),
            "quantiles": {str(level): values.tolist() for level, values in sorted(self.quantiles.items())},
            "preemptions": self.preemptions.tolist(),
            "arrivals": self.arrivals.tolist(),
            "models": list(self.models),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "AvailabilityForecast":
        if not isinstance(data, dict):
            raise ValueError("forecast must be a JSON object")
        try:
            quantiles = {float(level): values for level, values in data["quantiles"].items()}
            models = data.get("models", [])
            if not isinstance(models, list) or not all(isinstance(model, str) for model in models):
                raise ValueError("models must be a list of strings")
            return cls(
                float(data["interval_seconds"]), data["expected"], quantiles,
                data["preemptions"], data["arrivals"], tuple(models),
            )
        except KeyError as exc:
            raise ValueError(f"forecast is missing {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"malformed forecast: {exc}") from None


def _frozen(values: Any, name: str) -> np.ndarray:
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers") from None
    if array.ndim != 1 or len(array) == 0 or not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be a non-empty list of finite numbers")
    array.setflags(write=False)
    return array


# ---- shared machinery -------------------------------------------------------------


class _History:
    """Counts seen so far, in a buffer that keeps at least the last ``keep`` values."""

    def __init__(self, keep: int):
        self.keep = keep
        self._buffer = np.zeros(max(2 * keep, 64), dtype=np.int64)
        self._size = 0
        self.total = 0  # counts observed since the start, including dropped ones

    def append(self, count: int) -> None:
        if self._size == len(self._buffer):
            self._buffer[: self.keep] = self._buffer[self._size - self.keep : self._size]
            self._size = self.keep
        self._buffer[self._size] = count
        self._size += 1
        self.total += 1

    def recent(self, length: int | None = None) -> np.ndarray:
        start = 0 if length is None else max(self._size - length, 0)
        return self._buffer[start : self._size]

    @property
    def last(self) -> int:
        return int(self._buffer[self._size - 1])


class _ErrorLog:
    """The last ``window`` errors (outcome minus point forecast) of each horizon step."""

    def __init__(self, horizon: int, window: int):
        self.window = window
        self._values = np.zeros((horizon, window))
        self._written = np.zeros(horizon, dtype=np.int64)

    @property
    def horizon(self) -> int:
        return len(self._written)

    def grow(self, horizon: int) -> None:
        extra = horizon - self.horizon
        if extra > 0:
            self._values = np.vstack([self._values, np.zeros((extra, self.window))])
            self._written = np.concatenate([self._written, np.zeros(extra, dtype=np.int64)])

    def record(self, step: int, error: float) -> None:
        row = step - 1
        self._values[row, self._written[row] % self.window] = error
        self._written[row] += 1

    def recent(self, step: int, length: int | None = None) -> np.ndarray:
        """The newest ``length`` (default: all kept) errors of ``step``, oldest first.

        Logs written in step with each other return the same origins at the same positions.
        """
        written = int(self._written[step - 1])
        size = min(written, self.window, self.window if length is None else length)
        if written <= self.window and size == written:
            return self._values[step - 1, :size]
        return self._values[step - 1, np.arange(written - size, written) % self.window]


def _smoothed_quantiles(sorted_counts: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Per row, quantiles of integer counts each spread uniformly over [k - 0.5, k + 0.5].

    Within the spread of count ``k`` the CDF rises linearly from P(< k) to P(<= k), so
    the quantile at level q is k - 0.5 + (q - P(< k)) / P(= k), k the plain quantile.
    ``sorted_counts`` is (rows, n) sorted along each row; the result is (rows, levels).
    """
    size = sorted_counts.shape[1]
    plain = sorted_counts[:, np.clip(np.ceil(levels * size - 1e-9).astype(np.int64) - 1, 0, size - 1)]
    below = (sorted_counts[:, :, None] < plain[:, None, :]).sum(axis=1)
    upto = (sorted_counts[:, :, None] <= plain[:, None, :]).sum(axis=1)
    return plain - 0.5 + (levels * size - below) / (upto - below)


# ---- the interface and its implementations ----------------------------------------


class Forecaster(abc.ABC):
    """Observe one interval at a time; forecast the next ``horizon`` intervals.

    ``horizon`` is how many steps are scored and calibrated from the start; asking for a
    longer forecast grows it (the new steps calibrate from the history's changes until
    their own errors arrive). Errors kept: ``error_window`` origins for choosing models,
    ``calibration_seconds`` worth (at least ``min_errors``) for the distribution.

    Subclasses only say how to make a point path (``_point_path``) and, if they need to,
    how to refresh a model after each observation (``_after_observe``); scoring,
    calibration and event expectations are shared.
    """

    name: str = ""

    def __init__(
        self,
        interval_seconds: float,
        *,
        horizon: int = 10,
        error_window: int = 1440,
        calibration_seconds: float = 12 * 3600.0,
        min_errors: int = 20,
        volatility_window: int = 20,
    ):
        finite = isinstance(interval_seconds, (int, float)) and math.isfinite(interval_seconds)
        if not finite or interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be a positive number, got {interval_seconds!r}")
        integers = {"horizon": horizon, "error_window": error_window, "min_errors": min_errors,
                    "volatility_window": volatility_window}
        for option, value in integers.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be a positive integer, got {value!r}")
        if not calibration_seconds > 0:
            raise ValueError(f"calibration_seconds must be positive, got {calibration_seconds!r}")
        self.interval_seconds = float(interval_seconds)
        self._min_errors = min_errors
        self._calibration = max(int(round(calibration_seconds / interval_seconds)), min_errors)
        self._volatility_window = volatility_window
        self._history = _History(keep=self._history_needed(max(self._calibration, volatility_window) + horizon + 1))
        self._errors = _ErrorLog(horizon, error_window)
        # The spread of errors depends on how turbulent the recent past was: errors are
        # also kept per volatility regime of their origin (see _regime).
        self._regime_errors = [_ErrorLog(horizon, self._calibration) for _ in range(_REGIMES)]
        # Preemptions seen each step after an origin, pooled and per regime, the same way.
        self._preemptions = _ErrorLog(horizon, self._calibration)
        self._regime_preemptions = [_ErrorLog(horizon, self._calibration) for _ in range(_REGIMES)]
        self._issued: deque[tuple[np.ndarray, int]] = deque(maxlen=horizon)  # (path, regime), newest last
        self._peak = 0

    def _history_needed(self, intervals: int) -> int:
        """How many past counts this forecaster must keep (subclasses may need more)."""
        return intervals

    @property
    def horizon(self) -> int:
        """Steps that are scored and calibrated; grows when a longer forecast is asked for."""
        return self._errors.horizon

    def observe(self, count: int, preempted: int = 0, arrived: int = 0) -> None:
        """Record one interval: the count at its end and the events during it.

        Events that do not explain the count change are raised to the fewest that do
        (a drop of 3 with ``preempted=1`` counts as 3 preemptions).
        """
        for what, value in (("count", count), ("preempted", preempted), ("arrived", arrived)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
        count = int(count)
        if self._history.total:
            preempted = max(int(preempted), int(arrived) - (count - self._history.last))
        for step, (path, regime) in enumerate(reversed(self._issued), start=1):
            if step <= len(path):
                self._errors.record(step, count - path[step - 1])
                self._regime_errors[regime].record(step, count - path[step - 1])
                self._preemptions.record(step, preempted)
                self._regime_preemptions[regime].record(step, preempted)
        self._history.append(count)
        self._peak = max(self._peak, count)
        self._after_observe()
        self._issued.append((np.asarray(self._point_path(self.horizon), dtype=np.float64), self._regime()))

    def forecast(self, horizon: int) -> AvailabilityForecast:
        if not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be a positive integer, got {horizon!r}")
        if not self._history.total:
            raise ValueError(f"{self.name}: forecast() needs at least one observe() first")
        if horizon > self.horizon:
            for error_log in (self._errors, *self._regime_errors, self._preemptions, *self._regime_preemptions):
                error_log.grow(horizon)
            self._issued = deque(self._issued, maxlen=horizon)
            self._issued[-1] = (np.asarray(self._point_path(horizon), dtype=np.float64), self._issued[-1][1])
        point = self._issued[-1][0][:horizon]
        return self._distribution(point, self._models(horizon))

    def _models(self, horizon: int) -> tuple[str, ...]:
        return (self.name,) * horizon

    def _after_observe(self) -> None:
        """Hook: refresh a fitted model after a new count arrived."""

    @abc.abstractmethod
    def _point_path(self, horizon: int) -> np.ndarray:
        """Point forecasts for steps 1..horizon from the history seen so far."""

    def _regime(self) -> int:
        """Volatility (0: no change in the last ``volatility_window`` intervals, 1: one or
        two, 2: more) times 2, plus 1 when the count is at the highest seen so far."""
        changes = np.count_nonzero(np.diff(self._history.recent(self._volatility_window + 1)))
        volatility = 0 if changes == 0 else (1 if changes <= 2 else 2)
        return 2 * volatility + int(self._history.last >= self._peak)

    def _step_preemptions(self, step: int) -> float:
        """Mean preemptions ``step`` intervals after recent origins in the current regime
        (all recent origins while that regime has too few)."""
        regime = self._regime_preemptions[self._issued[-1][1]].recent(step)
        pooled = self._preemptions.recent(step, self._calibration)
        chosen = regime if len(regime) >= self._min_errors else pooled
        return float(chosen.mean()) if len(chosen) else 0.0

    def _step_errors(self, step: int) -> np.ndarray:
        """Recent errors at ``step`` from origins in the current regime; all recent errors
        while that regime has too few; the history's changes while those are too few."""
        regime = self._issued[-1][1]
        for errors in (self._regime_errors[regime].recent(step), self._errors.recent(step, self._calibration)):
            if len(errors) >= self._min_errors:
                return errors
        counts = self._history.recent(self._calibration + step).astype(np.float64)
        changes = counts[step:] - counts[:-step]
        return changes if len(changes) > len(errors) else (errors if len(errors) else np.zeros(1))

    def _distribution(self, point: np.ndarray, models: tuple[str, ...]) -> AvailabilityForecast:
        errors = [self._step_errors(step) for step in range(1, len(point) + 1)]
        common = min(len(step_errors) for step_errors in errors)  # steps differ by a few early on
        errors = np.stack([step_errors[len(step_errors) - common :] for step_errors in errors])
        # Outcomes are counts: the forecast distribution lives on 0..peak.
        outcomes = np.sort(np.clip(np.rint(point[:, None] + errors), 0, self._peak), axis=1)
        expected = outcomes.mean(axis=1)
        spread = _smoothed_quantiles(outcomes, _SPREAD_LEVELS)
        quantiles = {0.5: point.copy()}
        for column, level in enumerate(_SPREAD_LEVELS):
            bound = np.minimum if level < 0.5 else np.maximum  # keep the point inside
            quantiles[float(level)] = bound(spread[:, column], point)
        # Expected preemptions: what followed recent origins like this one (raised to the
        # expected drop where that is larger); arrivals make up the expected change.
        before = np.concatenate(([float(self._history.last)], expected[:-1]))
        change = expected - before
        observed = np.array([self._step_preemptions(step) for step in range(1, len(point) + 1)])
        preemptions = np.maximum(observed, -change)
        arrivals = np.maximum(change + preemptions, 0.0)
        return AvailabilityForecast(self.interval_seconds, expected, quantiles, preemptions, arrivals, models)


class LastValueForecaster(Forecaster):
    """Every future interval keeps the last observed count."""

    name = "last-value"

    def _point_path(self, horizon: int) -> np.ndarray:
        return np.full(horizon, float(self._history.last))


class RollingMedianForecaster(Forecaster):
    """The median of the last ``window`` counts: rides out short dips and blips."""

    name = "rolling-median"

    def __init__(self, interval_seconds: float, *, window: int = 6, **options: Any):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        self._window = window
        super().__init__(interval_seconds, **options)

    def _history_needed(self, intervals: int) -> int:
        return max(intervals, self._window)

    def _point_path(self, horizon: int) -> np.ndarray:
        # Lower median, so that the forecast is a count the trace has shown.
        recent = np.sort(self._history.recent(self._window))
        return np.full(horizon, float(recent[(len(recent) - 1) // 2]))


class ProphetForecaster(Forecaster):
    """Last count plus the change Prophet's trend and daily seasonality predict.

    Prophet's level forecast is worse than the last count on step-like availability, so
    only its predicted *change* from now is used. It is refitted every ``refit_seconds``
    on the last ``window_seconds`` averaged into at most ``max_fit_points`` buckets
    (a fit costs tens of milliseconds instead of about a second on 7 days of minutes),
    and each fit predicts every step until the next one, so an update in between only
    reads an array. Until ``min_fit_seconds`` of history exist it forecasts the last count.
    """

    name = "prophet"

    def __init__(
        self,
        interval_seconds: float,
        *,
        refit_seconds: float = 3 * 3600.0,
        window_seconds: float = 7 * 86400.0,
        max_fit_points: int = 240,
        min_fit_seconds: float = 2 * 3600.0,
        **options: Any,
    ):
        if not (refit_seconds > 0 and window_seconds > 0 and min_fit_seconds >= 0):
            raise ValueError("refit_seconds and window_seconds must be positive, min_fit_seconds non-negative")
        if not isinstance(max_fit_points, int) or max_fit_points < 10:
            raise ValueError(f"max_fit_points must be an integer >= 10, got {max_fit_points!r}")
        self._window = max(int(window_seconds // interval_seconds), 2)
        self._refit_every = max(int(round(refit_seconds / interval_seconds)), 1)
        self._min_fit = max(int(math.ceil(min_fit_seconds / interval_seconds)), 10)
        self._max_fit_points = max_fit_points
        self._change: np.ndarray | None = None  # predicted level, from the fit's origin on
        self._fitted_at = -1
        self._prophet_class = prophet_class()  # import now, not inside the first timed update
        super().__init__(interval_seconds, **options)

    def _history_needed(self, intervals: int) -> int:
        return max(intervals, self._window)

    def _after_observe(self) -> None:
        now = self._history.total - 1
        due = self._fitted_at < 0 or now - self._fitted_at >= self._refit_every
        if due and self._history.total >= self._min_fit:
            self._fit(now)

    def _fit(self, now: int) -> None:
        counts = self._history.recent(self._window).astype(np.float64)
        bucket = math.ceil(len(counts) / self._max_fit_points)
        usable = len(counts) // bucket * bucket
        levels = counts[len(counts) - usable :].reshape(-1, bucket).mean(axis=1)
        # Bucket k averages the intervals ending (buckets - 1 - k) * bucket before now.
        ends = now - bucket * np.arange(len(levels) - 1, -1, -1)
        centres = (ends - (bucket - 1) / 2.0) * self.interval_seconds
        future = (now + np.arange(self._refit_every + self.horizon + 1)) * self.interval_seconds
        self._fitted_at = now
        if np.ptp(levels) == 0:
            self._change = np.zeros(len(future))
            return
        try:
            daily = centres[-1] - centres[0] >= 2 * 86400
            predicted = _prophet_level(self._prophet_class, centres, levels, future, daily)
        except (RuntimeError, ValueError) as exc:  # Stan failures are data-dependent; keep forecasting
            log.warning("prophet fit failed at interval %d (%s); forecasting the last count", now, exc)
            self._change = None
            return
        self._change = predicted - predicted[0]

    def _point_path(self, horizon: int) -> np.ndarray:
        last = float(self._history.last)
        offset = self._history.total - 1 - self._fitted_at
        if self._change is None or offset + horizon >= len(self._change):
            return np.full(horizon, last)
        change = self._change[offset + 1 : offset + horizon + 1] - self._change[offset]
        return np.maximum(last + change, 0.0)


PROPHET_EPOCH = np.datetime64("2000-01-01T00:00:00")


def _prophet_level(
    prophet_class: type, times: np.ndarray, levels: np.ndarray, future: np.ndarray, daily: bool
) -> np.ndarray:
    """Fit Prophet to (seconds, level) points and predict the level at ``future`` seconds."""
    import pandas as pd

    def stamps(seconds: np.ndarray) -> np.ndarray:
        return PROPHET_EPOCH + np.round(seconds * 1000).astype("timedelta64[ms]")

    model = prophet_class(
        uncertainty_samples=0,
        daily_seasonality=daily,
        weekly_seasonality=False,
        yearly_seasonality=False,
    )
    with warnings.catch_warnings():  # pandas deprecations inside Prophet are not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        model.fit(pd.DataFrame({"ds": stamps(times), "y": levels}))
        return model.predict(pd.DataFrame({"ds": stamps(future)}))["yhat"].to_numpy()


def prophet_class() -> type:
    """Import Prophet (about half a second the first time) with its chatter off."""
    logging.getLogger("prophet.plot").setLevel(logging.CRITICAL)  # "Importing plotly failed"
    from prophet import Prophet

    logging.getLogger("cmdstanpy").disabled = True
    logging.getLogger("prophet").setLevel(logging.WARNING)
    return Prophet


class DefaultForecaster(Forecaster):
    """Last value, unless another model has clearly beaten it on the recent history.

    Common options go to every member too; ``member_options`` adds per-member ones.
    For each horizon step a member replaces last value when the mean of its paired
    absolute-error differences over the last ``error_window`` origins is more than
    ``switch_z`` standard errors below zero. Errors of one step overlap across ``step``
    consecutive origins, so only ``n / step`` of ``n`` errors count as independent.
    The default's own errors calibrate its distribution, so the switching is priced in.
    """

    name = "default"

    def __init__(
        self,
        interval_seconds: float,
        *,
        members: tuple[str, ...] = ("last-value", "rolling-median", "prophet"),
        member_options: dict[str, dict[str, Any]] | None = None,
        switch_z: float = 2.0,
        min_independent: int = 20,
        **options: Any,
    ):
        if not members or members[0] != "last-value" or "default" in members or len(set(members)) != len(members):
            raise ValueError(f"members must be 'last-value' and then other distinct forecasters, got {members!r}")
        if not switch_z >= 0:
            raise ValueError(f"switch_z must be non-negative, got {switch_z!r}")
        if not isinstance(min_independent, int) or min_independent < 1:
            raise ValueError(f"min_independent must be a positive integer, got {min_independent!r}")
        member_options = member_options or {}
        for member, extra in member_options.items():
            if member not in members or {"horizon", "error_window"} & set(extra):
                raise ValueError(f"member_options[{member!r}]: only for members, without horizon or error_window")
        self._members = [
            make_forecaster(member, interval_seconds, **options, **member_options.get(member, {})) for member in members
        ]
        self._switch_z = float(switch_z)
        self._min_independent = min_independent
        self._chosen: list[str] = []
        super().__init__(interval_seconds, **options)

    def observe(self, count: int, preempted: int = 0, arrived: int = 0) -> None:
        for member in self._members:
            member.observe(count, preempted, arrived)
        super().observe(count, preempted, arrived)

    def forecast(self, horizon: int) -> AvailabilityForecast:
        if isinstance(horizon, int) and horizon > self.horizon and self._history.total:
            for member in self._members:
                member.forecast(horizon)  # grows the member's scored horizon and path
        return super().forecast(horizon)

    def _models(self, horizon: int) -> tuple[str, ...]:
        return tuple(self._chosen[:horizon])

    def _point_path(self, horizon: int) -> np.ndarray:
        paths = [member._issued[-1][0] for member in self._members]
        point = np.empty(horizon)
        self._chosen = []
        for step in range(1, horizon + 1):
            best = self._best_member(step)
            point[step - 1] = paths[best][step - 1]
            self._chosen.append(self._members[best].name)
        return point

    def _best_member(self, step: int) -> int:
        baseline = np.abs(self._members[0]._errors.recent(step))
        independent = len(baseline) / step
        if independent < self._min_independent:
            return 0
        best, best_score = 0, 0.0
        for index, member in enumerate(self._members[1:], start=1):
            difference = np.abs(member._errors.recent(step)) - baseline
            score = difference.mean() + self._switch_z * difference.std() / math.sqrt(independent)
            if score < best_score:
                best, best_score = index, score
        return best


_REGISTRY: dict[str, Callable[..., Forecaster]] = {
    cls.name: cls for cls in (DefaultForecaster, LastValueForecaster, RollingMedianForecaster, ProphetForecaster)
}
FORECASTERS: tuple[str, ...] = tuple(_REGISTRY)


def make_forecaster(name: str, interval_seconds: float, **options: Any) -> Forecaster:
    """A fresh forecaster by name (see ``FORECASTERS``); options go to its constructor."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown forecaster {name!r}; choose one of {', '.join(FORECASTERS)}")
    cls = _REGISTRY[name]
    accepted = set(inspect.signature(cls.__init__).parameters) | set(inspect.signature(Forecaster.__init__).parameters)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"forecaster {name!r} takes no option {', '.join(unknown)}")
    return cls(interval_seconds, **options)
