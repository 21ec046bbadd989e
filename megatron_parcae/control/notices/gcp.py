"""GCP Compute Engine: the preemption notice of a spot (preemptible) VM, from the
metadata server.

- `GET http://metadata.google.internal/computeMetadata/v1/instance/preempted` with
  header `Metadata-Flavor: Google` (without it the server answers 403) answers `TRUE`
  once the VM is being preempted, `FALSE` before, with an `ETag` header.
- With `?wait_for_change=true` the GET hangs until the value changes; `last_etag=E`
  makes it answer at once if the value no longer has ETag E (so a change between two
  requests is not missed), and `timeout_sec=N` ends the hang after N seconds with the
  current value. On FALSE or a timeout, hang again.
- The VM gets ACPI shutdown at the same moment and is stopped 30 seconds later by
  default, so the deadline is the time the answer was seen plus `grace_seconds`.
"""

from __future__ import annotations

import http.client
import math
import threading
import time
import urllib.parse
from collections.abc import Callable

from megatron_parcae.control.notices.base import (
    POLL_SECONDS,
    REQUEST_TIMEOUT_S,
    Malformed,
    Notice,
    NoticeWatcher,
    Unavailable,
    header_value,
)

ENDPOINT = "http://metadata.google.internal"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
HEADERS = {"Metadata-Flavor": "Google"}
GRACE_SECONDS = 30.0
HANG_SECONDS = 30  # how long one hanging GET may wait (and how long `stop` may wait for it)
_PAUSE_S = 0.1  # between hanging GETs: bounds the request rate should a server not hang


class GcpWatcher(NoticeWatcher):
    source = "gcp"

    def __init__(self, endpoint: str = ENDPOINT, poll_seconds: float = POLL_SECONDS,
                 grace_seconds: float = GRACE_SECONDS, hang_seconds: int = HANG_SECONDS) -> None:
        """`poll_seconds` is where back-off starts while the server cannot be reached."""
        super().__init__(endpoint, poll_seconds)
        if not 0 <= grace_seconds < math.inf:
            raise ValueError(f"grace_seconds must be a number >= 0, not {grace_seconds}")
        if not isinstance(hang_seconds, int) or hang_seconds < 1:
            raise ValueError(f"hang_seconds must be a whole number of seconds >= 1, not {hang_seconds}")
        self.grace_seconds = grace_seconds
        self.hang_seconds = hang_seconds
        self._etag: str | None = None
        self._asked = False

    def answers(self, timeout: float) -> bool:
        try:
            response = self.endpoint.request("GET", PREEMPTED_PATH, HEADERS, timeout)
        except (OSError, http.client.HTTPException, Malformed):
            return False
        return (response.status == 200 and response.headers.get("Metadata-Flavor") == "Google"
                and response.body.strip() in (b"TRUE", b"FALSE"))

    def _wait_for_notice(self, stop: threading.Event, on_hint: Callable[[Notice], None]) -> Notice | None:
        return self._poll(self._check, stop, _PAUSE_S)

    def _check(self) -> Notice | None:
        """One GET: plain the first time (the value now and its ETag), hanging after."""
        if self._asked:
            query = {"wait_for_change": "true", "timeout_sec": str(self.hang_seconds)}
            if self._etag is not None:
                query["last_etag"] = self._etag
            path, timeout = f"{PREEMPTED_PATH}?{urllib.parse.urlencode(query)}", self.hang_seconds + REQUEST_TIMEOUT_S
        else:
            path, timeout = PREEMPTED_PATH, REQUEST_TIMEOUT_S
        try:
            response = self.endpoint.request("GET", path, HEADERS, timeout)
        except TimeoutError:
            if self._asked:
                return None  # a hang the server did not end itself: hang again
            raise
        received_at = time.time()
        self._asked = True
        if response.status != 200:
            raise Unavailable(f"GET {PREEMPTED_PATH} answered {response.status}")
        # The ETag first: after a bad value the next GET must still hang.
        self._etag, etag = None, response.headers.get("ETag")
        if etag is not None:
            self._etag = header_value(etag, "the ETag")
        value = response.body.strip()
        if value == b"TRUE":
            return Notice(self.source, "preempt", received_at + self.grace_seconds, received_at)
        if value != b"FALSE":
            raise Malformed(f"preempted is neither TRUE nor FALSE: {value[:20]!r}")
        return None
