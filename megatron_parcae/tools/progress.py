"""A status line for long work, on stderr, so that stdout keeps only the result (a
`--json` report stays exactly the JSON).

On a terminal the line is redrawn in place (carriage return) every `LIVE_SECONDS`;
otherwise it is written as a plain line every `PLAIN_SECONDS`, so logs of batch jobs
show progress without a line per step. Every line starts with the time elapsed since
the work began. A daemon ticker (`with Progress(...)`) draws on wall time: the line
moves on while the caller blocks in a long step, and callers never have to call in at
any rate.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

LIVE_SECONDS = 0.5
PLAIN_SECONDS = 5.0
DEFAULT_COLUMNS = 80


def hms(seconds: float) -> str:
    """'m:ss', or 'h:mm:ss' from an hour on."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def counted(done: float, total: float, what: str, elapsed: float | None = None) -> str:
    """'12/50 runs (24%), 0:31 left': with `elapsed`, the time left at the rate so far
    (for work done at an even rate)."""
    text = f"{done:g}/{total:g} {what} ({done / total:.0%})" if total > 0 else f"{done:g} {what}"
    if elapsed is not None and 0 < done < total:
        text += f", {hms(elapsed * (total - done) / done)} left"
    return text


def _columns(stream: TextIO) -> int:
    """The terminal's width; a pseudo-terminal nobody sized reports 0."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or DEFAULT_COLUMNS
    except (OSError, ValueError):
        return DEFAULT_COLUMNS


class Progress:
    """`label: elapsed status` on `stream` (stderr by default), at most every `every` seconds.

    The status is what the caller last gave `update`, or what `status` returns, given
    the seconds elapsed (for state that changes where the caller cannot call `update`);
    `status` is called from the ticker's thread, so it must only read. `live`: redraw in
    place; by default when `stream` is a terminal. `clock` is for tests."""

    def __init__(self, label: str, status: Callable[[float], str] | None = None, stream: TextIO | None = None,
                 every: float | None = None, live: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.status = label, status
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty() if live is None else live
        self.every = (LIVE_SECONDS if self.live else PLAIN_SECONDS) if every is None else every
        self.clock = clock
        self.started = self._last = clock()  # the first line comes `every` after the start
        self._text = ""
        self._drawn = 0  # width of the live line on screen
        self._columns = _columns(self.stream) if self.live else 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def update(self, text: str) -> None:
        """Set the status; draws it if a line is due."""
        self._text = text
        self.tick()

    def line(self) -> str:
        elapsed = self.elapsed
        text = self.status(elapsed) if self.status is not None else self._text
        return f"{self.label}: {hms(elapsed)}" + (f" {text}" if text else "")

    def tick(self, force: bool = False) -> None:
        """Draw the line if `every` has passed since the last one (or if `force`)."""
        with self._lock:
            now = self.clock()
            if not force and now - self._last < self.every:
                return
            self._last = now
            line = self.line()
            if self.live:
                line = line[:self._columns - 1]
                self.stream.write("\r" + line.ljust(self._drawn))
                self._drawn = len(line)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def print(self, *values: object, file: TextIO | None = None) -> None:
        """`print` to `file` (stdout by default) above the live line, which the ticker redraws."""
        with self._lock:
            if self._drawn:
                self.stream.write("\r" + " " * self._drawn + "\r")
                self.stream.flush()
                self._drawn = 0
            print(*values, file=sys.stdout if file is None else file, flush=True)

    def start(self) -> Progress:
        """Draw from a daemon thread on wall time until `close`."""
        self._ticker = threading.Thread(target=self._tick_until_closed, name=f"progress: {self.label}", daemon=True)
        self._ticker.start()
        return self

    def _tick_until_closed(self) -> None:
        while not self._stop.wait(min(self.every, 1.0) / 2):
            self.tick()

    def close(self) -> None:
        """Stop the ticker; a live line is drawn once more as it ends and kept."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self.live and self._drawn:
            self.tick(force=True)
            with self._lock:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = 0

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

