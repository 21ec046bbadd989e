"""Preemption notices from the clouds' metadata services.

SIGTERM is not the only notice, nor the first: an AWS spot instance is only marked in
its metadata service. A `NoticeWatcher` watches one provider's service and delivers one
`Notice` (source, action, deadline); `build_watcher` makes the one a `--source` names:

    watcher = build_watcher("auto")        # None: no metadata service, signals only
    if watcher is not None:
        watcher.start(on_notice, stop, on_hint=forecaster_hint)

`auto` asks the three services in parallel, once, and takes the first that answers in
its protocol. Unreachable services cost at most PROBE_SECONDS: an instance with no
metadata service falls back to signals in under two seconds. Probes still waiting then
(a DNS lookup of metadata.google.internal that hangs) are left to end on daemon threads.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Mapping

from megatron_parcae.control.notices.aws import AwsWatcher
from megatron_parcae.control.notices.azure import AzureWatcher
from megatron_parcae.control.notices.base import Notice, NoticeWatcher
from megatron_parcae.control.notices.gcp import GcpWatcher

__all__ = ["PROBE_SECONDS", "SOURCES", "WATCHERS", "AwsWatcher", "AzureWatcher", "GcpWatcher", "Notice",
           "NoticeWatcher", "build_watcher"]

log = logging.getLogger(__name__)

SOURCES = ("auto", "signal", "aws", "gcp", "azure")
WATCHERS: dict[str, type[NoticeWatcher]] = {"aws": AwsWatcher, "gcp": GcpWatcher, "azure": AzureWatcher}
PROBE_SECONDS = 1.5  # a metadata service answers in milliseconds; this leaves room under 2 s


def build_watcher(source: str, endpoint: str | None = None, *, endpoints: Mapping[str, str] | None = None,
                  **options: object) -> NoticeWatcher | None:
    """The watcher for `source`, or None for "signal" and for "auto" finding no service.

    `endpoint` replaces the provider's metadata address (under "auto", all three);
    `endpoints` ({"aws": url, ...}) replaces it per provider. `options` go to the
    watcher's constructor (poll_seconds, grace_seconds, hang_seconds, vm_name); under
    "auto", those the found provider does not take are dropped. Raises ValueError for an
    unknown source or a bad endpoint."""
    if source not in SOURCES:
        raise ValueError(f"unknown notice source {source!r}; choose from {', '.join(SOURCES)}")
    unknown = set(endpoints or {}) - set(WATCHERS)
    if unknown:
        raise ValueError(f"endpoints for unknown providers: {sorted(unknown)}")
    if source == "signal":
        return None
    urls = {name: (endpoints or {}).get(name, endpoint) for name in WATCHERS}
    if source != "auto":
        return _make(source, urls[source], options)
    accepted = {name: {key: value for key, value in options.items() if key in inspect.signature(cls).parameters}
                for name, cls in WATCHERS.items()}
    found = _first_answering([_make(name, urls[name], accepted[name]) for name in WATCHERS])
    if found is None:
        log.info("no metadata service answered: preemption notices come from signals only")
    else:
        log.info("preemption notices from the %s metadata service at %s", found.source, found.endpoint.url)
    return found


def _make(name: str, url: str | None, options: Mapping[str, object]) -> NoticeWatcher:
    return WATCHERS[name](**options) if url is None else WATCHERS[name](url, **options)


def _first_answering(watchers: list[NoticeWatcher]) -> NoticeWatcher | None:
    """The first watcher whose service answers within PROBE_SECONDS, asking all at once."""
    answers: queue.SimpleQueue[NoticeWatcher | None] = queue.SimpleQueue()
    deadline = time.monotonic() + PROBE_SECONDS
    for watcher in watchers:
        threading.Thread(target=lambda w=watcher: answers.put(w if w.answers(PROBE_SECONDS) else None),
                         name=f"notice-probe-{watcher.source}", daemon=True).start()
    for _ in watchers:
        try:
            found = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if found is not None:
            return found
    return None
