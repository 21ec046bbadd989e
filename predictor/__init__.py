"""Spot availability: trace loading, forecasting and back-testing."""

from predictor.forecast import FORECASTERS, AvailabilityForecast, Forecaster, make_forecaster
from predictor.traces import AvailabilityTrace, TraceFormatError

__all__ = ["AvailabilityForecast", "AvailabilityTrace", "FORECASTERS", "Forecaster", "TraceFormatError", "make_forecaster"]
