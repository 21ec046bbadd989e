"""What every preemption-notice watcher shares: the `Notice`, the `NoticeWatcher`
interface, and HTTP to a metadata service.

A cloud warns an instance before it takes it back, but not always with a signal: AWS
only marks the instance in its metadata service. A watcher polls (or hangs on) one
provider's service and delivers at most one notice, with the provider's deadline. It
runs on its own thread and never raises for what the network does: connection errors
are retried with back-off, and responses outside the protocol are logged once per
distinct problem and ignored, so polling goes on.

Requests go straight to the service with `http.client` (no proxy from the environment,
no redirects), each with a short timeout; bodies are capped and validated by the caller.
"""

from __future__ import annotations

import abc
import http.client
import json
import logging
import math
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # default interval between polls; AWS suggests 5 s, a notice gives 30 s or more
REQUEST_TIMEOUT_S = 2.0  # a metadata service on the host answers in milliseconds
MAX_BODY_BYTES = 64 * 1024  # every documented answer is far smaller
MAX_BACKOFF_S = 10.0  # an AWS warning lasts two minutes: never sleep through much of it
_MAX_PROBLEMS = 64  # distinct problems remembered for logging once each


@dataclass(frozen=True)
class Notice:
    """A preemption notice (or, with `action` "rebalance", a hint of elevated risk).

    Times are unix seconds. `deadline` is when the provider takes the instance; a hint
    has none, so there it is when the provider issued the hint."""

    source: str
    action: str
    deadline: float
    received_at: float


class Malformed(ValueError):
    """A response outside the provider's protocol (bad JSON, wrong types, bad time)."""


class Unavailable(Exception):
    """The service answered with a status its protocol does not have here."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> object:
        try:
            return json.loads(self.body)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise Malformed(f"not JSON: {exc}") from None
        except RecursionError:
            raise Malformed("JSON nested too deeply") from None


class Endpoint:
    """The base URL of a metadata service: http://host[:port][/prefix]."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
            valid = parts.scheme == "http" and bool(parts.hostname) and not (parts.query or parts.fragment)
        except ValueError:  # a port that is no number in 0-65535
            valid = False
        if not valid:
            raise ValueError(f"endpoint must look like http://host[:port][/path], not {url!r}")
        self.url = url.rstrip("/")
        self._host, self._port, self._prefix = parts.hostname, port, parts.path.rstrip("/")

    def request(self, method: str, path: str, headers: Mapping[str, str], timeout: float = REQUEST_TIMEOUT_S) -> Response:
        """One request on a fresh connection; raises OSError or http.client.HTTPException
        when the service cannot be reached, Malformed when the body is too large."""
        connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            connection.request(method, self._prefix + path, headers=dict(headers))
            response = connection.getresponse()
            body = response.read(MAX_BODY_BYTES + 1)
        finally:
            connection.close()
        if len(body) > MAX_BODY_BYTES:
            raise Malformed(f"{method} {path}: answer longer than {MAX_BODY_BYTES} bytes")
        return Response(response.status, response.headers, body)


class NoticeWatcher(abc.ABC):
    """Watches one provider's metadata service for this instance's preemption notice."""

    source: ClassVar[str]

    def __init__(self, endpoint: str, poll_seconds: float = POLL_SECONDS) -> None:
        if not 0 < poll_seconds < math.inf:
            raise ValueError(f"poll_seconds must be a positive number, not {poll_seconds}")
        self.endpoint = Endpoint(endpoint)
        self.poll_seconds = poll_seconds
        self._problems: set[str] = set()
        self._running = threading.Lock()
        self._delivered = False

    def watch(self, on_notice: Callable[[Notice], None], stop: threading.Event,
              on_hint: Callable[[Notice], None] | None = None) -> None:
        """Blocks until the notice was delivered to `on_notice` (once per watcher) or
        `stop` is set. Hints go to `on_hint`, never to `on_notice`."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError(f"this {self.source} watcher is already watching")
        try:
            if self._delivered:
                return
            notice = self._wait_for_notice(stop, on_hint or (lambda hint: None))
            if notice is not None:
                self._delivered = True
                on_notice(notice)
        finally:
            self._running.release()

    def start(self, on_notice: Callable[[Notice], None], stop: threading.Event,
              on_hint: Callable[[Notice], None] | None = None) -> threading.Thread:
        """`watch` on a daemon thread (started and returned)."""
        thread = threading.Thread(target=self.watch, args=(on_notice, stop, on_hint),
                                  name=f"notice-watch-{self.source}", daemon=True)
        thread.start()
        return thread

    @abc.abstractmethod
    def answers(self, timeout: float) -> bool:
        """Whether this provider's service answers here, in its protocol (one request)."""

    @abc.abstractmethod
    def _wait_for_notice(self, stop: threading.Event, on_hint: Callable[[Notice], None]) -> Notice | None:
        """The notice once the service shows one; None once `stop` is set."""

    def _problem(self, message: str) -> None:
        """Logs a warning the first time this problem is met."""
        if message not in self._problems and len(self._problems) < _MAX_PROBLEMS:
            self._problems.add(message)
            log.warning("%s metadata service at %s: %s", self.source, self.endpoint.url, message)

    def _poll(self, check: Callable[[], Notice | None], stop: threading.Event, interval: float) -> Notice | None:
        """Calls `check` every `interval` seconds until it returns a notice or `stop` is
        set. While the service cannot be reached it backs off instead: `poll_seconds`,
        doubling up to MAX_BACKOFF_S."""
        failures = 0
        while not stop.is_set():
            try:
                notice = check()
            except (OSError, http.client.HTTPException, Unavailable) as exc:
                self._problem(str(exc) or type(exc).__name__)
                failures = min(failures + 1, 16)
            except Malformed as exc:
                self._problem(str(exc))
                failures = 0
            else:
                if notice is not None:
                    return notice
                failures = 0
            backoff = min(self.poll_seconds * 2 ** (failures - 1), max(MAX_BACKOFF_S, self.poll_seconds))
            stop.wait(backoff if failures else interval)
        return None


def header_value(body: bytes | str | None, what: str) -> str:
    """`body` as a value safe to send back in a header (printable ASCII, no spaces)."""
    text = body.decode("ascii", "replace") if isinstance(body, bytes) else body
    if not text or len(text) > 1024 or not all("!" <= c <= "~" for c in text):
        raise Malformed(f"{what} is not a short printable ASCII word")
    return text
