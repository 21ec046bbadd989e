"""Preemption and arrival rates per interval: a constant rate, and a rate by hour of day.

Liveput draws each coming interval's preemptions from a Poisson distribution whose mean
is the forecast's expected preemptions (``preemption_distribution`` in
``megatron_parcae/liveput/scenarios.py``). A rate model gives such means from the
history (``RateModel.expected``) and is scored by the Poisson log-likelihood of the
counts that then happened (``RateModel.log_likelihood``): the score of exactly the
distribution liveput would use. A binomial over the instances present would also bound
the count, but Poisson is what liveput draws from, and it needs no bound: the exposure
below already keeps every observed count possible.

``ForecastRates`` puts a rate model's means into a forecast in place of the forecaster's,
refitting the model on the availability history as it grows; the coordinator's ``rates``
key and ``parcae simulate --rates`` choose one by name (``make_rates``).

Preemptions are counted per instance that ran during the interval (those running at its
start plus those that arrived in it: an instance can arrive and be preempted within one
interval, so this exposure is never below the preemptions); arrivals per interval.

Hours of day count from the trace's start: the trace formats keep no time zone, and
SkyPilot's keep no clock at all. A daily cycle shows at some phase either way. The live
coordinator's clock is its interval boundaries' Unix time, so its hours are UTC's.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from predictor.forecast import PROPHET_EPOCH, AvailabilityForecast, prophet_class
from predictor.traces import AvailabilityTrace

__all__ = ["IntervalEvents", "RateModel", "ConstantRates", "SeasonalRates", "RATE_MODELS", "RATES", "ForecastRates",
           "make_rates", "poisson_log_pmf"]

log = logging.getLogger(__name__)

_DAY = 86400.0
_HOUR = 3600.0


@dataclass(frozen=True, eq=False)
class IntervalEvents:
    """Per interval: its start (seconds from the trace start), instances running at its
    start, and the preemptions and arrivals during it."""

    starts: np.ndarray
    instances: np.ndarray
    preemptions: np.ndarray
    arrivals: np.ndarray

    @classmethod
    def from_trace(cls, trace: AvailabilityTrace) -> "IntervalEvents":
        """The intervals between consecutive samples of an evenly resampled trace."""
        if trace.interval_seconds is None:
            raise ValueError("rate models need an evenly spaced trace: resample it first")
        return cls(trace.times[:-1], trace.counts[:-1], trace.preemptions[1:], trace.arrivals[1:])

    def __len__(self) -> int:
        return len(self.starts)

    def window(self, begin: int, end: int) -> "IntervalEvents":
        return IntervalEvents(*(array[begin:end] for array in (self.starts, self.instances,
                                                                self.preemptions, self.arrivals)))

    def series(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(events, exposure) of preemptions and of arrivals (see the module docstring)."""
        return ((self.preemptions, self.instances + self.arrivals),
                (self.arrivals, np.ones(len(self.arrivals), dtype=np.int64)))


def poisson_log_pmf(counts: np.ndarray, means: np.ndarray) -> np.ndarray:
    """log P(count | Poisson(mean)), elementwise; a zero mean gives 0 for a zero count."""
    counts = np.asarray(counts, dtype=np.float64)
    means = np.asarray(means, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log(means), 0.0)
    log_factorials = np.array([math.lgamma(count + 1) for count in counts.ravel()]).reshape(counts.shape)
    return terms - means - log_factorials


class RateModel(abc.ABC):
    """Fitted on past intervals; gives each future interval's preemption rate (per
    instance) and arrival rate (per interval)."""

    name: str = ""

    def __init__(self, interval_seconds: float):
        finite = isinstance(interval_seconds, (int, float)) and math.isfinite(interval_seconds)
        if not finite or interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be a positive number, got {interval_seconds!r}")
        self.interval_seconds = float(interval_seconds)
        self._rates: tuple[np.ndarray, np.ndarray] | None = None  # per hour of day (24 values)

    def fit(self, history: IntervalEvents) -> "RateModel":
        self._rates = tuple(self._fit_series(history, events, exposure) for events, exposure in history.series())
        return self

    @abc.abstractmethod
    def _fit_series(self, history: IntervalEvents, events: np.ndarray, exposure: np.ndarray) -> np.ndarray:
        """The rate per unit of exposure for each of the 24 hours of day."""

    def rates(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Preemptions per instance and arrivals per interval, for intervals starting at ``starts``."""
        if self._rates is None:
            raise ValueError(f"{self.name}: fit() before asking for rates")
        hours = (np.asarray(starts, dtype=np.float64) % _DAY // _HOUR).astype(np.int64)
        return self._rates[0][hours], self._rates[1][hours]

    def expected(self, starts: np.ndarray, instances: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected preemptions and arrivals of intervals starting at ``starts`` with
        ``instances`` running (the arrivals expected in an interval can be preempted in it)."""
        preemption_rate, arrival_rate = self.rates(starts)
        return preemption_rate * (np.asarray(instances, dtype=np.float64) + arrival_rate), arrival_rate

    def log_likelihood(self, observed: IntervalEvents) -> tuple[np.ndarray, np.ndarray]:
        """Per interval, the Poisson log-likelihood of its preemptions and of its arrivals."""
        rates = self.rates(observed.starts)
        return tuple(poisson_log_pmf(events, rate * exposure)
                     for rate, (events, exposure) in zip(rates, observed.series()))


def _pooled_rate(events: np.ndarray, exposure: np.ndarray) -> float:
    """Events per unit of exposure after half an event over one unit before any data
    (so the first event is never impossible)."""
    return (float(events.sum()) + 0.5) / (float(exposure.sum()) + 1.0)


class ConstantRates(RateModel):
    """One rate for every interval: the history's events over its exposure."""

    name = "constant"

    def _fit_series(self, history: IntervalEvents, events: np.ndarray, exposure: np.ndarray) -> np.ndarray:
        return np.full(24, _pooled_rate(events, exposure))


class SeasonalRates(RateModel):
    """A rate for each hour of day, learnt from the whole clock hours of the history (the
    part of the hour under way would make this hour of day's rate a rate of the last few
    minutes).

    Once the history spans ``prophet_seconds`` (two days by default: every hour of day
    seen at least twice), Prophet with a flat trend and daily seasonality is fitted to
    the rate of each clock hour; a flat trend, so that what differs from the constant
    model is the daily cycle alone. Each hour's rate is first shrunk towards the
    constant rate as if it had also seen one average interval at that rate, so that an
    hour with one instance running weighs less than one with sixteen. Prophet's daily
    profile is floored at ``floor_share`` of the constant rate (a Gaussian fit can reach
    zero at a quiet hour, where an event would then be impossible), then scaled so that
    its mean over the history's exposure is the constant rate: Prophet gives the shape of
    the day, the history's events and exposure its level (a plain mean of hourly rates
    would over-weigh the hours with few instances).

    On a shorter history, or when a Prophet fit fails (Stan failures depend on the data;
    a warning is logged), each hour of day's rate is its events over its exposure, shrunk
    towards the constant rate as if it had also seen one average hour (nothing else
    smooths an hour of day seen once or twice): an hour of day not seen yet has the
    constant rate, so on less than a day of history this model is the constant one.
    Prophet is a declared dependency, imported (as ``ProphetForecaster`` does, through
    ``forecast.prophet_class``) at the first fit that uses it; without it that fit raises
    ImportError rather than silently becoming a different model.
    """

    name = "seasonal"

    def __init__(self, interval_seconds: float, *, prophet_seconds: float = 2 * _DAY, floor_share: float = 0.1):
        if not (prophet_seconds >= _DAY and 0 < floor_share <= 1):
            raise ValueError("prophet_seconds must be at least a day and floor_share in (0, 1]")
        super().__init__(interval_seconds)
        self._prophet_intervals = math.ceil(prophet_seconds / self.interval_seconds)
        self._floor_share = floor_share

    def _fit_series(self, history: IntervalEvents, events: np.ndarray, exposure: np.ndarray) -> np.ndarray:
        constant = _pooled_rate(events, exposure)
        whole = history.starts < (history.starts[-1] + self.interval_seconds) // _HOUR * _HOUR
        starts, events, exposure = history.starts[whole], events[whole], exposure[whole]
        if not exposure.sum():
            return np.full(24, constant)
        hours = (starts % _DAY // _HOUR).astype(np.int64)
        if len(starts) >= self._prophet_intervals:
            clock_hours = (starts // _HOUR).astype(np.int64)
            hourly_exposure = np.bincount(clock_hours, exposure)
            seen = np.flatnonzero(hourly_exposure > 0)
            interval_prior = float(exposure.sum()) / len(starts)
            shrunk = ((np.bincount(clock_hours, events)[seen] + interval_prior * constant)
                      / (hourly_exposure[seen] + interval_prior))
            try:
                shape = np.maximum(_prophet_daily(seen, shrunk), self._floor_share * constant)
            except (RuntimeError, ValueError) as exc:
                log.warning("prophet rate fit failed on %d intervals (%s); using hour-of-day means", len(starts), exc)
            else:
                return shape * constant * float(exposure.sum()) / float((exposure * shape[hours]).sum())
        hour_prior = float(exposure.sum()) / max(len(starts) * self.interval_seconds / _HOUR, 1.0)
        hourly_events = np.bincount(hours, events, minlength=24)
        hourly_exposure = np.bincount(hours, exposure, minlength=24)
        return (hourly_events + hour_prior * constant) / (hourly_exposure + hour_prior)


def _prophet_daily(clock_hours: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """Prophet's rate at each of the 24 hours of day, fitted to the rates of clock hours
    counted from the trace start (flat trend: every day alike)."""
    import pandas as pd

    if np.ptp(rates) == 0:
        return np.full(24, float(rates[0]))

    def stamps(hours: np.ndarray) -> np.ndarray:
        return PROPHET_EPOCH + (hours * 3600 + 1800).astype("timedelta64[s]")

    model = prophet_class()(growth="flat", daily_seasonality=True, weekly_seasonality=False,
                       yearly_seasonality=False, uncertainty_samples=0)
    next_day = (clock_hours[-1] // 24 + 1) * 24
    with warnings.catch_warnings():  # pandas deprecations inside Prophet are not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        model.fit(pd.DataFrame({"ds": stamps(clock_hours), "y": rates}))
        return model.predict(pd.DataFrame({"ds": stamps(next_day + np.arange(24))}))["yhat"].to_numpy()


RATE_MODELS: tuple[type[RateModel], ...] = (SeasonalRates, ConstantRates)

RATES: tuple[str, ...] = ("none", *(model.name for model in RATE_MODELS))
"""What a config or flag may name: "none" keeps the forecaster's expected events."""


class ForecastRates:
    """A forecast's expected preemptions and arrivals from a rate model, in place of the
    forecaster's (liveput draws each coming interval's preemptions around them); the
    forecast's counts stay the forecaster's.

    The history is one row per interval, [instances, preemptions, arrivals] as a
    forecaster observes them (the events at the interval's start), the last one starting
    at ``last_start`` seconds of a clock whose hour of day the seasonal model learns (a
    trace's, or the coordinator's boundaries). At the first forecast of every hour of that
    clock the model is refitted on the whole history (a Prophet fit each interval would
    cost more than the decision), first once the history spans an hour: on fewer
    intervals the rates' prior of half an event would outweigh the evidence, and the
    forecaster's expectations stand.
    """

    def __init__(self, model: RateModel):
        self.model = model
        self._fitted: float | None = None  # the clock hour of the last fit

    def apply(self, forecast: AvailabilityForecast, history: Sequence[Sequence[int]] | np.ndarray,
              last_start: float) -> AvailabilityForecast:
        """``forecast`` of the intervals after the history's last, with the model's means:
        step i's events happen at the end of the interval starting ``i`` intervals after
        ``last_start``, on the instances of the step before (the history's last count
        first, then the forecast's expected counts)."""
        interval = self.model.interval_seconds
        if forecast.interval_seconds != interval:
            raise ValueError(f"a forecast of {forecast.interval_seconds:g} s intervals, rates of {interval:g} s")
        hour = last_start // _HOUR
        if self._fitted != hour:
            if (len(history) - 1) * interval < _HOUR:
                return forecast
            rows = np.asarray(history, dtype=np.int64)
            starts = last_start - interval * np.arange(len(rows) - 1, 0, -1)
            self.model.fit(IntervalEvents(starts, rows[:-1, 0], rows[1:, 1], rows[1:, 2]))
            self._fitted = hour
        starts = last_start + interval * np.arange(forecast.horizon)
        instances = np.concatenate(([history[-1][0]], forecast.expected[:-1]))
        preemptions, arrivals = self.model.expected(starts, instances)
        return dataclasses.replace(forecast, preemptions=preemptions, arrivals=arrivals)


def make_rates(name: str, interval_seconds: float) -> ForecastRates | None:
    """The rates a config or flag names (``RATES``); None for "none"."""
    if name not in RATES:
        raise ValueError(f"unknown rate model {name!r}; known: {', '.join(RATES)}")
    models = {model.name: model for model in RATE_MODELS}
    return None if name == "none" else ForecastRates(models[name](interval_seconds))
