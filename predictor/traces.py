"""Spot-instance availability traces: one in-memory form for every file format we meet.

Supported formats, detected from the file's first non-blank line:

- event CSV, one event per row: ``ms,add|remove,node`` (milliseconds from trace start;
  the cluster is empty before the first event; Windows line endings are fine);
- ``ms,count``: the instance count from that millisecond on (the trace starts at its
  first row);
- ``YYYY-MM-DD, HH:MM:SS, count``: wall-clock samples (the trace starts at the earliest);
- SkyPilot JSON ``{"metadata": {"gap_seconds": G}, "data": [count, ...]}``: one count
  every G seconds.

Rows of the sampled formats may come in any order: they are sorted by time, and of two
rows with the same time the one written later wins (it is the correction). Events
(arrivals and preemptions) are explicit in the event CSV and derived from count changes
in the other formats.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

__all__ = ["AvailabilityTrace", "TraceFormatError"]

# A resampled trace longer than this is a mistake (an interval far too small), not a plan.
_MAX_SAMPLES = 5_000_000
_DATE_ROW = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_DIGITS = re.compile(r"[0-9]+")


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message is ``file:line: reason``."""

    def __init__(self, path: str | Path, line: int, reason: str):
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")


@dataclass(frozen=True, eq=False)
class AvailabilityTrace:
    """Instance counts over time with the arrival and preemption events behind them.

    Sample ``i`` says that ``counts[i]`` instances run from ``times[i]`` on;
    ``arrivals[i]`` and ``preemptions[i]`` are the events after sample ``i - 1`` up to and
    including ``times[i]``, so ``counts[i] - counts[i-1] == arrivals[i] - preemptions[i]``.
    Sample 0's events are those at the trace's first instant (only event files have any).
    ``interval_seconds`` is set when the samples are evenly spaced (after ``resample``).
    """

    times: np.ndarray
    counts: np.ndarray
    arrivals: np.ndarray
    preemptions: np.ndarray
    interval_seconds: float | None = None
    source: str = "<memory>"

    def __post_init__(self) -> None:
        arrays = {}
        dtypes = {"times": np.float64, "counts": np.int64, "arrivals": np.int64, "preemptions": np.int64}
        for name, dtype in dtypes.items():
            array = np.array(getattr(self, name), dtype=dtype)
            array.setflags(write=False)
            object.__setattr__(self, name, array)
            arrays[name] = array
        n = len(self.times)
        if n == 0 or any(a.ndim != 1 or len(a) != n for a in arrays.values()):
            raise ValueError(f"{self.source}: times, counts, arrivals, preemptions must be equal non-empty 1-D arrays")
        if self.times[0] != 0 or not np.all(np.isfinite(self.times)) or np.any(np.diff(self.times) <= 0):
            raise ValueError(f"{self.source}: times must start at 0, be finite and strictly increase")
        if np.any(self.counts < 0) or np.any(self.arrivals < 0) or np.any(self.preemptions < 0):
            raise ValueError(f"{self.source}: counts and events must be non-negative")
        if np.any(np.diff(self.counts) != self.arrivals[1:] - self.preemptions[1:]):
            raise ValueError(f"{self.source}: count changes do not match arrivals minus preemptions")

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_counts(
        cls, times, counts, source: str = "<memory>", interval_seconds: float | None = None
    ) -> "AvailabilityTrace":
        """A trace from sampled counts; events are the count changes."""
        counts = np.asarray(counts, dtype=np.int64)
        delta = np.diff(counts, prepend=counts[:1])
        return cls(times, counts, np.maximum(delta, 0), np.maximum(-delta, 0), interval_seconds, source)

    @classmethod
    def load(cls, path: str | Path) -> "AvailabilityTrace":
        """Read a trace file in any supported format (see the module docstring)."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise TraceFormatError(path, 0, f"cannot read: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise TraceFormatError(path, line, "not UTF-8 text") from None
        if text.lstrip().startswith("{"):
            return _parse_skypilot_json(text, str(path))
        rows = [(number, line.strip()) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
        if not rows:
            raise TraceFormatError(path, 1, "empty trace")
        number, first = rows[0]
        fields = [field.strip() for field in first.split(",")]
        if len(fields) == 3 and fields[1].lower() in ("add", "remove"):
            return _parse_event_csv(rows, str(path))
        if len(fields) == 3 and _DATE_ROW.fullmatch(fields[0]):
            return _parse_date_time_count(rows, str(path))
        if len(fields) == 2:
            return _parse_ms_count(rows, str(path))
        raise TraceFormatError(
            path, number,
            "unrecognised trace format: expected 'ms,add|remove,node', 'ms,count', "
            "'YYYY-MM-DD, HH:MM:SS, count' or SkyPilot JSON",
        )

    # ---- views --------------------------------------------------------------------

    @property
    def duration_seconds(self) -> float:
        return float(self.times[-1])

    @property
    def peak(self) -> int:
        return int(self.counts.max())

    def count_at(self, seconds: float) -> int:
        """Instances running at ``seconds`` (the last sample at or before it)."""
        index = int(np.searchsorted(self.times, seconds, side="right")) - 1
        return int(self.counts[max(index, 0)])

    def resample(self, interval_seconds: float) -> "AvailabilityTrace":
        """Counts at 0, interval, 2*interval, ... with each step's events summed into it."""
        if not (math.isfinite(interval_seconds) and interval_seconds > 0):
            raise ValueError(f"interval must be a positive number of seconds, got {interval_seconds}")
        steps = int(math.floor(self.duration_seconds / interval_seconds + 1e-9)) + 1
        if steps > _MAX_SAMPLES:
            raise ValueError(
                f"{self.source}: interval {interval_seconds} s cuts a {self.duration_seconds:.0f} s trace "
                f"into {steps} steps; use a larger interval"
            )
        grid = np.arange(steps, dtype=np.float64) * interval_seconds
        last = np.searchsorted(self.times, grid, side="right") - 1  # grid[0] == 0 == times[0]
        arrivals = np.cumsum(self.arrivals)[last]
        preemptions = np.cumsum(self.preemptions)[last]
        return AvailabilityTrace(
            grid, self.counts[last],
            np.diff(arrivals, prepend=0), np.diff(preemptions, prepend=0),
            float(interval_seconds), self.source,
        )

    def cut(self, start_hour: float, end_hour: float) -> "AvailabilityTrace":
        """The part between two hours from the trace start, re-based to start at 0.

        The first sample is the count running at ``start_hour`` (with no events of its own);
        the cut lasts until ``end_hour`` or the trace's end, whichever comes first.
        """
        start, end = start_hour * 3600.0, end_hour * 3600.0
        if not (0 <= start < end and start < self.duration_seconds) or not math.isfinite(end):
            raise ValueError(
                f"{self.source}: cannot cut hours {start_hour}-{end_hour} from a "
                f"{self.duration_seconds / 3600:.2f} h trace (need 0 <= start < end and start inside it)"
            )
        inside = (self.times > start) & (self.times <= end)
        times = np.concatenate(([0.0], self.times[inside] - start))
        counts = np.concatenate(([self.count_at(start)], self.counts[inside]))
        arrivals = np.concatenate(([0], self.arrivals[inside]))
        preemptions = np.concatenate(([0], self.preemptions[inside]))
        if end < self.duration_seconds and times[-1] < end - start:  # the last count holds until the end
            times, counts = np.append(times, end - start), np.append(counts, counts[-1])
            arrivals, preemptions = np.append(arrivals, 0), np.append(preemptions, 0)
        regular = self.interval_seconds is not None and math.isclose(start % self.interval_seconds, 0.0, abs_tol=1e-6)
        interval = self.interval_seconds if regular else None
        return AvailabilityTrace(times, counts, arrivals, preemptions, interval, self.source)

    def scale(self, max_instances: int) -> "AvailabilityTrace":
        """The same shape on a cluster of at most ``max_instances`` (for local replay).

        Counts are scaled by ``max_instances / peak`` and rounded half up; events become the
        scaled count changes, so a loss too small to show at the smaller scale disappears.
        """
        if not isinstance(max_instances, (int, np.integer)) or max_instances < 1:
            raise ValueError(f"max_instances must be a positive integer, got {max_instances!r}")
        factor = max_instances / max(self.peak, 1)
        counts = np.floor(self.counts * factor + 0.5).astype(np.int64)
        return AvailabilityTrace.from_counts(self.times, counts, self.source, self.interval_seconds)


# ---- parsers ----------------------------------------------------------------------


def _number(text: str, path: str, line: int, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(path, line, f"{what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceFormatError(path, line, f"{what} {text!r} must be a finite non-negative number")
    return value


def _count(text: str, path: str, line: int) -> int:
    if not _DIGITS.fullmatch(text):
        raise TraceFormatError(path, line, f"instance count {text!r} is not a non-negative integer")
    return int(text)


def _fields(row: str, expected: int, layout: str, path: str, line: int) -> list[str]:
    fields = [field.strip() for field in row.split(",")]
    if len(fields) != expected:
        raise TraceFormatError(path, line, f"expected {expected} comma-separated fields ({layout}), got {len(fields)}")
    return fields


def _from_samples(samples: list[tuple[float, int]], path: str, seconds_per_unit: float) -> AvailabilityTrace:
    """Sort (time, count) samples, let the later row win on equal times, start at 0."""
    ordered = sorted(range(len(samples)), key=lambda i: samples[i][0])  # stable: file order on ties
    times: list[float] = []
    counts: list[int] = []
    for i in ordered:
        time, count = samples[i]
        if times and time == times[-1]:
            counts[-1] = count
        else:
            times.append(time)
            counts.append(count)
    return AvailabilityTrace.from_counts((np.array(times) - times[0]) * seconds_per_unit, counts, path)


def _parse_event_csv(rows: list[tuple[int, str]], path: str) -> AvailabilityTrace:
    events = []
    for line, row in rows:
        ms, action, node = _fields(row, 3, "ms,add|remove,node", path, line)
        action = action.lower()
        if action not in ("add", "remove"):
            raise TraceFormatError(path, line, f"event {action!r} is neither 'add' nor 'remove'")
        if not node:
            raise TraceFormatError(path, line, "empty node name")
        events.append((_number(ms, path, line, "time (ms)") / 1000.0, action, node, line))
    events.sort(key=lambda event: event[0])  # stable: file order within one millisecond
    running: set[str] = set()
    times, counts, arrivals, preemptions = [0.0], [0], [0], [0]
    for time, action, node, line in events:
        if action == "add":
            if node in running:
                raise TraceFormatError(path, line, f"add of {node}, which is already running")
            running.add(node)
        else:
            if node not in running:
                raise TraceFormatError(path, line, f"remove of {node}, which is not running")
            running.discard(node)
        if time != times[-1]:
            times.append(time)
            counts.append(counts[-1])
            arrivals.append(0)
            preemptions.append(0)
        counts[-1] = len(running)
        if action == "add":
            arrivals[-1] += 1
        else:
            preemptions[-1] += 1
    return AvailabilityTrace(times, counts, arrivals, preemptions, None, path)


def _parse_ms_count(rows: list[tuple[int, str]], path: str) -> AvailabilityTrace:
    samples = []
    for line, row in rows:
        ms, count = _fields(row, 2, "ms,count", path, line)
        samples.append((_number(ms, path, line, "time (ms)"), _count(count, path, line)))
    return _from_samples(samples, path, 0.001)


def _parse_date_time_count(rows: list[tuple[int, str]], path: str) -> AvailabilityTrace:
    samples = []
    for line, row in rows:
        date, clock, count = _fields(row, 3, "YYYY-MM-DD, HH:MM:SS, count", path, line)
        if not _DATE_ROW.fullmatch(date):
            raise TraceFormatError(path, line, f"date {date!r} is not YYYY-MM-DD")
        try:
            stamp = datetime.strptime(f"{date} {clock}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        except ValueError:
            raise TraceFormatError(path, line, f"'{date}, {clock}' is not a valid date and HH:MM:SS time") from None
        samples.append((stamp.timestamp(), _count(count, path, line)))
    return _from_samples(samples, path, 1.0)


def _parse_skypilot_json(text: str, path: str) -> AvailabilityTrace:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, exc.lineno, f"invalid JSON: {exc.msg}") from None
    if not isinstance(document, dict):
        raise TraceFormatError(path, 1, "SkyPilot trace must be a JSON object")
    metadata = document.get("metadata")
    gap = metadata.get("gap_seconds") if isinstance(metadata, dict) else None
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap) or gap <= 0:
        reason = f"metadata.gap_seconds must be a positive number, got {gap!r}"
        raise TraceFormatError(path, _json_line(text, "metadata"), reason)
    data = document.get("data")
    if not isinstance(data, list) or not data:
        raise TraceFormatError(path, _json_line(text, "data"), "'data' must be a non-empty list of instance counts")
    for index, count in enumerate(data):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            reason = f"data[{index}] = {count!r} is not a non-negative integer"
            raise TraceFormatError(path, _json_line(text, "data", index), reason)
    return AvailabilityTrace.from_counts(np.arange(len(data)) * float(gap), data, path)


def _json_line(text: str, key: str, index: int | None = None) -> int:
    """Line of a top-level key's value (or of one item of it) in a valid JSON object.

    Walks the document with the json scanner itself, so nested keys and strings cannot
    be mistaken for the one we look for. Only called to point an error at its line.
    """
    decoder = json.JSONDecoder()
    whitespace = re.compile(r"[ \t\n\r]*")

    def skip(position: int, punctuation: str = "") -> int:
        position = whitespace.match(text, position).end()
        if punctuation and text.startswith(punctuation, position):
            position = whitespace.match(text, position + 1).end()
        return position

    position = skip(text.index("{") + 1)
    while position < len(text) and text[position] == '"':
        name, position = decoder.raw_decode(text, position)
        position = skip(position, ":")
        if name == key:
            if index is not None and text.startswith("[", position):
                position = skip(position + 1)
                for _ in range(index):
                    _, position = decoder.raw_decode(text, position)
                    position = skip(position, ",")
            return text.count("\n", 0, position) + 1
        _, position = decoder.raw_decode(text, position)
        position = skip(position, ",")
    return 1
