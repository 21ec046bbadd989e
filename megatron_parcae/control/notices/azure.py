"""Azure: the eviction notice of a spot VM, from Scheduled Events in the instance
metadata service.

- `GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01` with
  header `Metadata: true` (without it the service answers 400) answers
  `{"DocumentIncarnation": N, "Events": [{"EventId": "...", "EventType": "Preempt",
  "ResourceType": "VirtualMachine", "Resources": ["vmname"], "EventStatus": "Scheduled",
  "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}, ...]}`.
- Only `Preempt` events are notices (the others are maintenance: reboot, redeploy,
  freeze, terminate of a scale set). `NotBefore` (RFC 1123) is the deadline; it is empty
  once the event has started, and then the deadline is now. A spot VM gets at least
  30 seconds.
- The document lists the events of every VM in the availability set or scale set, so a
  watcher only counts events whose `Resources` include its VM's name: `vm_name`, or
  what `GET /metadata/instance/compute/name?api-version=2021-02-01&format=text` (same
  header) answers, asked once before the first poll.
- The first request enables Scheduled Events on the VM and may take up to two minutes;
  until then requests time out and are retried.
- `GET /metadata/versions` (same header) answers `{"apiVersions": [...]}` at once: the
  probe of `auto`.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import threading
import time
from collections.abc import Callable

from megatron_parcae.control.notices.base import POLL_SECONDS, Malformed, Notice, NoticeWatcher, Unavailable

ENDPOINT = "http://169.254.169.254"
EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
VERSIONS_PATH = "/metadata/versions"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}


def parse_not_before(value: object, received_at: float) -> float:
    """An RFC 1123 date in unix seconds; `received_at` for the empty string."""
    if not isinstance(value, str):
        raise Malformed("a Preempt event's NotBefore is not a string")
    if not value:
        return received_at
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        raise Malformed(f"a Preempt event's NotBefore is not an RFC 1123 date: {value[:40]!r}") from None
    if moment.tzinfo is None:  # "-0000": UTC, says RFC 2822
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


class AzureWatcher(NoticeWatcher):
    source = "azure"

    def __init__(self, endpoint: str = ENDPOINT, poll_seconds: float = POLL_SECONDS, vm_name: str | None = None) -> None:
        super().__init__(endpoint, poll_seconds)
        self.vm_name = vm_name

    def answers(self, timeout: float) -> bool:
        try:
            response = self.endpoint.request("GET", VERSIONS_PATH, HEADERS, timeout)
            document = response.json() if response.status == 200 else None
        except (OSError, http.client.HTTPException, Malformed):
            return False
        return isinstance(document, dict) and isinstance(document.get("apiVersions"), list)

    def _wait_for_notice(self, stop: threading.Event, on_hint: Callable[[Notice], None]) -> Notice | None:
        return self._poll(self._check, stop, self.poll_seconds)

    def _own_name(self) -> str:
        response = self.endpoint.request("GET", NAME_PATH, HEADERS)
        if response.status != 200:
            raise Unavailable(f"GET {NAME_PATH} answered {response.status}")
        name = response.body.decode("utf-8", "replace").strip()
        if not name or len(name) > 64 or not name.isprintable():
            raise Malformed("the VM's name is empty, too long or not printable")
        return name

    def _check(self) -> Notice | None:
        if self.vm_name is None:
            self.vm_name = self._own_name()
        response = self.endpoint.request("GET", EVENTS_PATH, HEADERS)
        received_at = time.time()
        if response.status != 200:
            raise Unavailable(f"GET {EVENTS_PATH} answered {response.status}")
        document = response.json()
        if not isinstance(document, dict) or type(document.get("DocumentIncarnation")) is not int:
            raise Malformed("the scheduled events are not an object with an integer DocumentIncarnation")
        events = document.get("Events")
        if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
            raise Malformed("Events is not a list of objects")
        deadlines = []
        for event in events:
            if not isinstance(event.get("EventType"), str):
                raise Malformed("an event's EventType is not a string")
            if event["EventType"] != "Preempt":
                continue
            resources = event.get("Resources")
            if not isinstance(resources, list) or not all(isinstance(name, str) for name in resources):
                raise Malformed("a Preempt event's Resources is not a list of strings")
            if self.vm_name in resources:
                deadlines.append(parse_not_before(event.get("NotBefore"), received_at))
        return Notice(self.source, "preempt", min(deadlines), received_at) if deadlines else None
