"""Trace loading: every format, malformed input, resampling, cutting and scaling."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from predictor.traces import AvailabilityTrace, TraceFormatError

import helpers

TRACES = helpers.TRACES
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def assert_consistent(trace: AvailabilityTrace) -> None:
    assert trace.times[0] == 0 and np.all(np.diff(trace.times) > 0)
    assert np.array_equal(np.diff(trace.counts), trace.arrivals[1:] - trace.preemptions[1:])


# ---- the real traces (traces/) ----------------------------------------------------


@pytest.mark.parametrize(
    "relative, hours, peak",
    [
        ("aws-p3/p3-trace.csv", 11.37, 32),
        ("aws-g4dn/g4dn-trace.csv", 10.77, 24),
        ("gcp-a100/a100x1-east1b.txt", 27.0, 64),
        ("aws-v100-16node/us-east-2b_v100_1.json", 270.5, 16),
    ],
)
def test_shared_traces_load(relative: str, hours: float, peak: int) -> None:
    trace = AvailabilityTrace.load(TRACES / relative)
    assert trace.duration_seconds / 3600 == pytest.approx(hours, abs=0.05)
    assert trace.peak == peak
    assert_consistent(trace)
    minute = trace.resample(60)
    assert_consistent(minute)
    assert minute.preemptions.sum() == trace.preemptions[1:].sum()  # resampling keeps every event


def test_p3_event_counts_match_the_file() -> None:
    trace = AvailabilityTrace.load(TRACES / "aws-p3/p3-trace.csv")
    assert trace.preemptions.sum() == 167 and trace.arrivals.sum() == 177  # 344 rows
    assert trace.counts[-1] == 10


# ---- one file per format ----------------------------------------------------------


def test_event_csv_with_crlf(tmp_path: Path) -> None:
    text = "0,add,node1\n0,add,node2\n60000,add,node3\n120000,remove,node1\n120000,add,node4\n180000,remove,node2\n"
    trace = AvailabilityTrace.load(write(tmp_path, "events.csv", text, "\r\n"))
    assert trace.times.tolist() == [0, 60, 120, 180]
    assert trace.counts.tolist() == [2, 3, 3, 2]
    assert trace.arrivals.tolist() == [2, 1, 1, 0]
    assert trace.preemptions.tolist() == [0, 0, 1, 1]


def test_event_csv_starts_empty_before_the_first_event(tmp_path: Path) -> None:
    trace = AvailabilityTrace.load(write(tmp_path, "late.csv", "480000,add,a\n540000,add,b\n"))
    assert trace.times.tolist() == [0, 480, 540]
    assert trace.counts.tolist() == [0, 1, 2]


def test_ms_count(tmp_path: Path) -> None:
    trace = AvailabilityTrace.load(write(tmp_path, "counts.csv", "5000,4\n65000,3\n125000,3\n185000,6\n"))
    assert trace.times.tolist() == [0, 60, 120, 180]  # starts at its first row
    assert trace.counts.tolist() == [4, 3, 3, 6]
    assert trace.preemptions.tolist() == [0, 1, 0, 0]
    assert trace.arrivals.tolist() == [0, 0, 0, 3]


def test_ms_count_later_row_wins_on_equal_times(tmp_path: Path) -> None:
    trace = AvailabilityTrace.load(write(tmp_path, "steps.csv", "0,0\n21529,0\n21529,4\n30000,4\n"))
    assert trace.counts.tolist() == [0, 4, 4]


def test_date_time_count_out_of_order(tmp_path: Path) -> None:
    text = "2021-12-11, 11:13:10, 55\n2021-12-11, 11:11:30, 54\n2021-12-12, 00:00:00, 60\n2021-12-11, 23:59:30, 58\n"
    trace = AvailabilityTrace.load(write(tmp_path, "gcp.txt", text))
    assert trace.times.tolist() == [0, 100, 46080, 46110]
    assert trace.counts.tolist() == [54, 55, 58, 60]


def test_skypilot_json(tmp_path: Path) -> None:
    document = {"metadata": {"gap_seconds": 300}, "data": [0, 3, 3, 16], "prices": [1]}  # extra keys are fine
    path = write(tmp_path, "sky.json", json.dumps(document))
    trace = AvailabilityTrace.load(path)
    assert trace.times.tolist() == [0, 300, 600, 900]
    assert trace.counts.tolist() == [0, 3, 3, 16]


# ---- malformed files: file:line: reason -------------------------------------------


@pytest.mark.parametrize(
    "name, text, line, reason",
    [
        ("empty.csv", "\n\n", 1, "empty trace"),
        ("unknown.csv", "hello world\n", 1, "unrecognised trace format"),
        ("action.csv", "0,add,a\n60000,boot,b\n", 2, "neither 'add' nor 'remove'"),
        ("unknown-node.csv", "0,add,a\n\n60000,remove,b\n", 3, "remove of b, which is not running"),
        ("twice.csv", "0,add,a\n1000,add,a\n", 2, "already running"),
        ("ms.csv", "0,add,a\nsoon,add,b\n", 2, "time (ms) 'soon' is not a number"),
        ("fields.csv", "0,add,a\n60000,add\n", 2, "expected 3 comma-separated fields"),
        ("negative.csv", "0,3\n1000,-1\n", 2, "is not a non-negative integer"),
        ("fraction.csv", "0,3\n1000,2.5\n", 2, "is not a non-negative integer"),
        ("nan.csv", "0,3\nnan,2\n", 2, "finite non-negative"),
        ("date.txt", "2021-12-11, 11:13:10, 55\n2021-13-40, 11:13:10, 55\n", 2, "not a valid date"),
        ("clock.txt", "2021-12-11, 11:13:10, 55\n2021-12-11, 25:00:00, 55\n", 2, "not a valid date"),
        ("broken.json", '{"metadata": {"gap_seconds": 300},\n "data": [1, 2,\n ]}', 3, "invalid JSON"),
        ("gap.json", '{"metadata": {},\n "data": [1]}', 1, "gap_seconds must be a positive number"),
        ("item.json", '{"metadata": {"gap_seconds": 60},\n "data": [1,\n 2,\n -3]}', 4, "data[2] = -3"),
        ("nested.json", '{"metadata": {"gap_seconds": 60, "data": [7]},\n "data": [1,\n -3]}', 3, "data[1] = -3"),
        ("nodata.json", '{"metadata": {"gap_seconds": 60},\n\n "data": []}', 3, "non-empty list"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path: Path, name: str, text: str, line: int, reason: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TraceFormatError) as caught:
        AvailabilityTrace.load(path)
    assert caught.value.line == line
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert reason in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        AvailabilityTrace.load(tmp_path / "absent.csv")


# ---- property tests on the parsers ------------------------------------------------


@st.composite
def event_logs(draw) -> list[tuple[int, str, str]]:
    """A valid event sequence: never removes a node that is not running."""
    running: list[str] = []
    events, time, serial = [], 0, 0
    for _ in range(draw(st.integers(1, 40))):
        time += draw(st.sampled_from([0, 0, 60_000, 120_000, 7_000]))
        if running and draw(st.booleans()):
            node = running.pop(draw(st.integers(0, len(running) - 1)))
            events.append((time, "remove", node))
        else:
            serial += 1
            running.append(f"node{serial}")
            events.append((time, "add", f"node{serial}"))
    return events


@FUZZ
@given(events=event_logs(), crlf=st.booleans(), seed=st.integers(0, 2**16))
def test_event_csv_property(tmp_path: Path, events, crlf: bool, seed: int) -> None:
    # Rows with different times may come in any order; within one time, file order holds.
    groups: dict[int, list[str]] = {}
    for time, action, node in events:
        groups.setdefault(time, []).append(f"{time},{action},{node}")
    blocks = list(groups.values())
    random.Random(seed).shuffle(blocks)
    text = "".join(row + "\n" for block in blocks for row in block)
    path = write(tmp_path, "events.csv", text, "\r\n" if crlf else "\n")
    trace = AvailabilityTrace.load(path)
    assert_consistent(trace)
    for time in groups:
        running = sum(+1 if action == "add" else -1 for t, action, _ in events if t <= time)
        assert trace.count_at(time / 1000) == running
    assert trace.arrivals.sum() == sum(action == "add" for _, action, _ in events)
    assert trace.preemptions.sum() == sum(action == "remove" for _, action, _ in events)


samples = st.dictionaries(st.integers(0, 10_000_000), st.integers(0, 500), min_size=1, max_size=40)


@FUZZ
@given(rows=samples, seed=st.integers(0, 2**16))
def test_ms_count_property(tmp_path: Path, rows: dict[int, int], seed: int) -> None:
    lines = [f"{ms},{count}" for ms, count in rows.items()]
    random.Random(seed).shuffle(lines)
    trace = AvailabilityTrace.load(write(tmp_path, "counts.csv", "\n".join(lines) + "\n"))
    ordered = sorted(rows.items())
    assert trace.times.tolist() == pytest.approx([(ms - ordered[0][0]) / 1000 for ms, _ in ordered])
    assert trace.counts.tolist() == [count for _, count in ordered]
    assert_consistent(trace)


@FUZZ
@given(rows=st.dictionaries(st.integers(0, 3 * 86400), st.integers(0, 99), min_size=1, max_size=30), seed=st.integers())
def test_date_time_count_property(tmp_path: Path, rows: dict[int, int], seed: int) -> None:
    start = datetime(2021, 12, 31, 22, 0, 0)
    lines = [f"{(start + timedelta(seconds=s)):%Y-%m-%d, %H:%M:%S}, {count}" for s, count in rows.items()]
    random.Random(seed).shuffle(lines)
    trace = AvailabilityTrace.load(write(tmp_path, "gcp.txt", "\n".join(lines)))
    ordered = sorted(rows.items())
    assert trace.times.tolist() == [s - ordered[0][0] for s, _ in ordered]
    assert trace.counts.tolist() == [count for _, count in ordered]


@FUZZ
@given(data=st.lists(st.integers(0, 64), min_size=1, max_size=200), gap=st.sampled_from([30, 300]), indent=st.booleans())
def test_skypilot_json_property(tmp_path: Path, data: list[int], gap: int, indent: bool) -> None:
    text = json.dumps({"metadata": {"gap_seconds": gap}, "data": data}, indent=1 if indent else None)
    trace = AvailabilityTrace.load(write(tmp_path, "sky.json", text))
    assert trace.counts.tolist() == data
    assert trace.times.tolist() == [i * gap for i in range(len(data))]


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list("0123456789,.-: \n\r{}[]\"adremovnx")), max_size=200))
def test_arbitrary_text_loads_or_fails_cleanly(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "fuzz.txt", text)
    try:
        trace = AvailabilityTrace.load(path)
    except TraceFormatError as error:
        assert str(error).startswith(f"{path}:{error.line}: ")
        assert 0 <= error.line <= text.count("\n") + text.count("\r") + 1
    else:
        assert_consistent(trace)


# ---- resample, cut, scale ---------------------------------------------------------


def _trace_from_steps(steps: list[tuple[int, int]]) -> AvailabilityTrace:
    times = np.cumsum([0] + [gap for gap, _ in steps[1:]])
    return AvailabilityTrace.from_counts(times, [count for _, count in steps])


traces = st.lists(st.tuples(st.integers(1, 900), st.integers(0, 40)), min_size=1, max_size=30).map(_trace_from_steps)


@settings(max_examples=80, deadline=None)
@given(trace=traces, interval=st.sampled_from([1.0, 30.0, 60.0, 300.0]))
def test_resample_holds_counts_and_keeps_events(trace: AvailabilityTrace, interval: float) -> None:
    resampled = trace.resample(interval)
    assert resampled.interval_seconds == interval
    assert_consistent(resampled)
    for time, count in zip(resampled.times, resampled.counts):
        assert count == trace.count_at(time)
    covered = trace.times <= resampled.times[-1]
    assert resampled.preemptions[1:].sum() == trace.preemptions[1:][covered[1:]].sum()


@settings(max_examples=80, deadline=None)
@given(trace=traces, start=st.floats(0, 1), length=st.floats(0.01, 2))
def test_cut_rebases_and_keeps_the_counts(trace: AvailabilityTrace, start: float, length: float) -> None:
    assume(trace.duration_seconds > 0)
    start_hour = start * trace.duration_seconds / 3600 * 0.999
    cut = trace.cut(start_hour, start_hour + length)
    assert_consistent(cut)
    assert cut.duration_seconds == pytest.approx(min(length * 3600, trace.duration_seconds - start_hour * 3600))
    for offset in np.linspace(0, cut.duration_seconds, 7):
        assert cut.count_at(offset) == trace.count_at(start_hour * 3600 + offset)


def test_cut_outside_the_trace_is_an_error() -> None:
    trace = AvailabilityTrace.from_counts([0, 3600], [1, 2])
    with pytest.raises(ValueError, match="cannot cut hours 2-3"):
        trace.cut(2, 3)
    with pytest.raises(ValueError, match="cannot cut"):
        trace.cut(0.5, 0.5)


def test_cut_of_a_resampled_trace_stays_regular() -> None:
    trace = AvailabilityTrace.from_counts(np.arange(0, 7200, 60), np.arange(120) % 7).resample(60)
    assert trace.cut(0.5, 1.0).interval_seconds == 60
    assert trace.cut(0.505, 1.0).interval_seconds is None


@settings(max_examples=80, deadline=None)
@given(trace=traces, size=st.integers(1, 16))
def test_scale_fits_the_smaller_cluster(trace: AvailabilityTrace, size: int) -> None:
    scaled = trace.scale(size)
    assert_consistent(scaled)
    assert scaled.peak == (size if trace.peak else 0)
    order = np.argsort(trace.counts, kind="stable")
    assert np.all(np.diff(scaled.counts[order]) >= 0)  # more instances never scale to fewer


def test_bad_arguments_are_value_errors() -> None:
    trace = AvailabilityTrace.from_counts([0, 60], [1, 2])
    with pytest.raises(ValueError, match="interval must be a positive"):
        trace.resample(0)
    with pytest.raises(ValueError, match="max_instances"):
        trace.scale(0)
    with pytest.raises(ValueError, match="start at 0"):
        AvailabilityTrace.from_counts([5, 60], [1, 2])
