"""Progress on long work (issue 37): the status line's rules on a fake clock, and
`parcae simulate`, `plan` and `replay` on a pseudo-terminal: a line at least every 10 s,
stdout exactly the result."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import selectors
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from helpers import ANCHORS, REPO, TRACES
from megatron_parcae.tools.progress import Progress, counted, hms
from megatron_parcae.tools.replay import JobLog, ReplayStep, replay_status

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
MOST_SECONDS_BETWEEN_LINES = 10  # the bound


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- the status line -------------------------------------------------------------------


def test_off_a_terminal_a_plain_line_every_few_seconds_whatever_the_callers_rate():
    clock, out = Clock(), io.StringIO()
    progress = Progress("work", stream=out, clock=clock)
    assert not progress.live and progress.every == 5.0
    for step in range(1, 121):  # 12 s of updates every 0.1 s
        clock.now = 100 + step / 10
        progress.update(f"{step} steps")
    assert out.getvalue() == "work: 0:05 50 steps\nwork: 0:10 100 steps\n"
    progress.close()
    assert out.getvalue().count("\n") == 2 and "\r" not in out.getvalue()


def test_on_a_terminal_the_line_is_redrawn_in_place_and_kept_at_the_end():
    clock, out = Clock(), Terminal()
    progress = Progress("work", stream=out, clock=clock)
    assert progress.live and progress.every == 0.5
    progress.update("a long status")
    assert out.getvalue() == ""  # nothing for work that ends at once
    clock.now = 100.5
    progress.tick()
    clock.now = 100.75
    progress.update("short")  # not due yet
    clock.now = 101
    progress.tick()
    # a shorter line blanks what is left of the longer one, and there is no newline
    assert out.getvalue() == "\rwork: 0:00 a long status" + "\r" + "work: 0:01 short".ljust(24)
    clock.now = 162
    progress.close()
    assert out.getvalue().endswith("\rwork: 1:02 short\n")


def test_a_quick_job_on_a_terminal_prints_nothing():
    progress = Progress("work", stream=Terminal(), clock=Clock())
    progress.update("done")
    progress.close()
    assert progress.stream.getvalue() == ""


def test_the_status_function_is_given_the_time_elapsed_and_overrides_updates():
    clock, out = Clock(), io.StringIO()
    progress = Progress("work", status=lambda elapsed: f"{elapsed:.0f} s in", stream=out, every=1, clock=clock)
    clock.now += 3
    progress.update("ignored")
    assert out.getvalue() == "work: 0:03 3 s in\n"


def test_a_line_printed_to_stdout_clears_the_live_line_first():
    clock, out, stdout = Clock(), Terminal(), io.StringIO()
    progress = Progress("work", stream=out, clock=clock)
    clock.now += 1
    progress.update("busy")
    progress.print("result", file=stdout)
    assert out.getvalue() == "\rwork: 0:01 busy" + "\r" + " " * len("work: 0:01 busy") + "\r"
    assert stdout.getvalue() == "result\n"
    progress.close()  # nothing on screen any more: nothing to keep
    assert out.getvalue().endswith("\r")


def test_a_live_line_is_cut_to_the_terminal_width():
    clock, out = Clock(), Terminal()
    progress = Progress("work", stream=out, clock=clock)  # a StringIO has no size: 80 columns
    clock.now += 1
    progress.update("x" * 200)
    assert len(out.getvalue()) == 1 + 79


def test_counts_and_times():
    assert hms(59.9) == "0:59" and hms(61) == "1:01" and hms(3 * 3600 + 62) == "3:01:02"
    assert counted(12, 48, "intervals") == "12/48 intervals (25%)"
    assert counted(12, 48, "runs", elapsed=30) == "12/48 runs (25%), 1:30 left"
    assert counted(0, 48, "runs", elapsed=30) == "0/48 runs (0%)"
    assert counted(3, 0, "runs") == "3 runs"


def test_the_ticker_draws_while_the_caller_blocks_and_stops_on_close():
    out = io.StringIO()
    with Progress("work", stream=out, every=0.05) as progress:
        progress.update("waiting")
        deadline = time.monotonic() + 30
        while out.getvalue().count("\n") < 3:  # the caller never calls in
            assert time.monotonic() < deadline, "the ticker drew nothing"
            time.sleep(0.01)
    lines = out.getvalue()
    assert not any(t.name == "progress: work" for t in threading.enumerate())
    time.sleep(0.2)
    assert out.getvalue() == lines


def test_a_replays_status_says_where_it_is():
    log = JobLog()
    log.trained_samples = 640
    log.changes.append({"layout": [1, 2, 1]})
    steps = [ReplayStep(0.0, 1), ReplayStep(10.0, 2), ReplayStep(20.0, 1)]
    assert replay_status(steps, log, 12.0, 30.0, 120.0) == \
        "trace 24:00/1:00:00, instances 2, layout T1P2D1, samples 640, changes 1, 0:18 left"
    assert replay_status(steps, JobLog(), 40.0, 30.0, 120.0) == \
        "trace 1:00:00/1:00:00, instances 1, layout none yet, samples 0, changes 0, 0:00 left"


# -- the commands on a pseudo-terminal -------------------------------------------------


def on_terminal(args: list[str], timeout: float) -> tuple[int, str, str]:
    """`parcae *args` with stderr on a pseudo-terminal 200 columns wide: the exit code,
    stdout, and what the terminal showed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "megatron_parcae.cli", *args], cwd=REPO, env=ENV,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out = proc.stdout.fileno()
    received = {master: bytearray(), out: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in received:
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while selector.get_map():
            assert time.monotonic() < deadline, f"parcae {args[0]} ran over {timeout} s"
            for key, _ in selector.select(1.0):
                try:
                    data = os.read(key.fd, 65536)
                except OSError:  # EIO: the terminal's last writer has gone
                    data = b""
                if not data:
                    selector.unregister(key.fd)
                received[key.fd] += data
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        os.close(master)
    return code, received[out].decode(), received[master].decode(errors="replace")


def progress_times(screen: str, label: str) -> list[int]:
    """The elapsed seconds of each progress line `label` drew."""
    pattern = re.compile(rf"{re.escape(label)}: (?:(\d+):)?(\d+):(\d\d)(?: |$)")
    times = []
    for piece in re.split(r"[\r\n]+", screen):
        if m := pattern.match(piece):
            hours, minutes, seconds = (int(g or 0) for g in m.groups())
            times.append(hours * 3600 + minutes * 60 + seconds)
    return times


def assert_progress_every_10_s(screen: str, label: str) -> list[str]:
    """Progress lines were drawn in place, from the start and at most 10 s apart (by the
    times they show); returns their texts."""
    times = progress_times(screen, label)
    assert times, f"no progress line of {label!r} on the terminal:\n{screen[-3000:]}"
    assert "\r" + label in screen, "the line is not redrawn in place"
    gaps = [b - a for a, b in zip([0, *times], times)]
    assert max(gaps) <= MOST_SECONDS_BETWEEN_LINES, f"{label}: progress lines at {times}"
    return [p for p in re.split(r"[\r\n]+", screen) if p.startswith(label)]


def test_simulate_shows_progress_on_a_terminal_and_stdout_is_exactly_the_json():
    # Half a day of forecaster history, then two hours of 16 nodes: a few seconds.
    code, stdout, screen = on_terminal(
        ["simulate", "--trace", str(TRACES / "aws-v100-16node" / "us-east-2b_v100_1.json"), "--start-hour", "12",
         "--end-hour", "14", "--profile", str(ANCHORS / "gpt-1.5b.csv"), "--json"], timeout=300)
    assert code == 0, screen[-3000:]
    report = json.loads(stdout)  # one document, nothing around it
    assert report["intervals"] == 120
    lines = assert_progress_every_10_s(screen, "parcae simulate")
    assert lines[-1].rstrip().endswith("480/480 intervals replayed (100%)"), lines[-3:]


def test_plan_shows_progress_on_a_terminal_and_stdout_is_exactly_the_json():
    code, stdout, screen = on_terminal(
        ["plan", "--profile", str(ANCHORS / "gpt-1.5b.csv"), "--samples", "5e5", "--deadline", "4",
         "--trace", str(TRACES / "aws-p3" / "p3-trace.csv"), "--json"], timeout=300)
    assert code == 0, screen[-3000:]
    answer = json.loads(stdout)
    assert answer["recommendation"]["hours"] <= 4
    lines = assert_progress_every_10_s(screen, "parcae plan")
    simulated = [int(m.group(1)) for line in lines if (m := re.search(r"(\d+) intervals replayed", line))]
    assert simulated[-1] > 0 and simulated == sorted(simulated), simulated


@pytest.mark.slow
def test_replay_shows_progress_on_a_terminal_and_keeps_it_off_stdout(tiny_data, tmp_path):
    # One instance for a trace hour at 120x: etcd, the coordinator and one worker for 30 s.
    trace = tmp_path / "one-instance.csv"
    trace.write_text("0,1\n3600000,1\n")
    code, stdout, screen = on_terminal(
        ["replay", "--trace", str(trace), "--max-instances", "1", "--speedup", "120", "--grace-seconds", "2",
         "--profile", str(REPO / "configs" / "profiles" / "gpt-tiny-cpu.json"), "--workdir", str(tmp_path / "replay"),
         "--json", str(tmp_path / "summary.json"), "--", "scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml",
         "--train-iters", "100000"], timeout=400)
    assert code == 0, f"{stdout[-2000:]}\n{screen[-3000:]}"
    lines = assert_progress_every_10_s(screen, "parcae replay: parcae")
    assert any(re.search(r"trace \d+:\d\d(:\d\d)?/1:00:00, instances 1, layout \S+, samples \d+, changes \d+, "
                         r"\d+:\d\d left", line) for line in lines), lines[-5:]
    assert not progress_times(stdout, "parcae replay: parcae") and "\r" not in stdout
    assert json.loads((tmp_path / "summary.json").read_text())["parcae"]["max_instances"] == 1
