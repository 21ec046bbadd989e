"""Preemption notices from the clouds' metadata services (megatron_parcae.control.notices).

The clouds cannot be reached here, so each provider's service is a local HTTP server
that follows its documented protocol: the required headers (a request without them gets
the provider's error status), IMDSv2 tokens with a TTL and 401 once expired, 404 until
the instance is marked; GCP's hanging GET with ETags; Azure's events document.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import logging
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import REPO, child_env, wait_for
from megatron_parcae.control.notices import (
    AwsWatcher,
    AzureWatcher,
    GcpWatcher,
    Notice,
    NoticeWatcher,
    build_watcher,
)

POLL_S = 0.2
NOTICE_WITHIN_S = 5.0  # the spec: a notice within 5 s of the metadata change
AUTO_WITHIN_S = 2.0  # the spec: `auto` falls back to signals within 2 s

AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS = "/metadata/scheduledevents"


# ---------------------------------------------------------------- fake metadata services

class FakeService:
    """A provider's metadata service on 127.0.0.1 (ThreadingHTTPServer on its own thread)."""

    def __init__(self, port: int = 0) -> None:
        self.changed = threading.Condition()
        self.closing = False
        self.requests: list[tuple[str, str, int]] = []  # (method, path without query, status)
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self.Handler)
        self.server.fake = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def served(self, method: str, path: str, status: int | None = None) -> int:
        with self.changed:
            return sum(1 for m, p, s in self.requests if (m, p) == (method, path) and status in (None, s))

    def close(self) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()  # ends hanging GETs
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    class Handler(BaseHTTPRequestHandler):
        fake: FakeService

        def setup(self) -> None:
            super().setup()
            self.fake = self.server.fake  # type: ignore[attr-defined]

        def log_message(self, format: str, *args: object) -> None:
            pass

        def reply(self, status: int, body: bytes = b"", content_type: str = "text/plain",
                  headers: dict[str, str] | None = None) -> None:
            with self.fake.changed:
                self.fake.requests.append((self.command, urllib.parse.urlsplit(self.path).path, status))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)


class FakeAws(FakeService):
    """IMDSv2 with tokens required: PUT /latest/api/token, then GETs with the token."""

    def __init__(self, port: int = 0) -> None:
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.ttls: list[int] = []
        self.bodies: dict[str, bytes] = {}  # path -> JSON answered; absent: 404
        super().__init__(port)

    def mark(self, path: str, body: bytes | dict) -> None:
        with self.changed:
            self.bodies[path] = body if isinstance(body, bytes) else json.dumps(body).encode()

    def expire_tokens(self) -> None:
        with self.changed:
            self.tokens = dict.fromkeys(self.tokens, 0.0)

    class Handler(FakeService.Handler):
        fake: FakeAws

        def do_PUT(self) -> None:
            if self.path != "/latest/api/token":
                return self.reply(404)
            if "X-Forwarded-For" in self.headers:
                return self.reply(403)
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.reply(400)
            token = "AQAEA" + secrets.token_urlsafe(40)
            with self.fake.changed:
                self.fake.tokens[token] = time.monotonic() + int(ttl)
                self.fake.ttls.append(int(ttl))
            self.reply(200, token.encode(), headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

        def do_GET(self) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            with self.fake.changed:
                valid = self.fake.tokens.get(token or "", 0.0) > time.monotonic()
                body = self.fake.bodies.get(self.path)
            if not valid:
                return self.reply(401)
            if body is None:
                return self.reply(404)
            self.reply(200, body, "application/json")


class FakeGcp(FakeService):
    """The GCE metadata server's `preempted`, with wait_for_change, last_etag and timeout_sec."""

    def __init__(self, port: int = 0, max_hang: float = 30.0) -> None:
        self.value = b"FALSE"
        self.version = 0
        self.max_hang = max_hang  # the server's own limit on a hanging GET
        super().__init__(port)

    @property
    def etag(self) -> str:
        return f"{self.version:016x}"

    def preempt(self, value: bytes = b"TRUE") -> None:
        with self.changed:
            self.value, self.version = value, self.version + 1
            self.changed.notify_all()

    class Handler(FakeService.Handler):
        fake: FakeGcp

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != GCP_PREEMPTED:
                return self.reply(404)
            if self.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in self.headers:
                return self.reply(403)
            query = urllib.parse.parse_qs(url.query)
            fake = self.fake
            with fake.changed:
                if query.get("wait_for_change") == ["true"] and query.get("last_etag", [fake.etag]) == [fake.etag]:
                    hang = min(float(query.get("timeout_sec", ["inf"])[0]), fake.max_hang)
                    version = fake.version
                    fake.changed.wait_for(lambda: fake.version != version or fake.closing, hang)
                value, etag = fake.value, fake.etag
            self.reply(200, value, "application/text", {"Metadata-Flavor": "Google", "ETag": etag})


class FakeAzure(FakeService):
    """Azure IMDS: Scheduled Events, the VM's name and the versions list, `Metadata: true` required."""

    def __init__(self, port: int = 0) -> None:
        self.document: bytes | dict = {"DocumentIncarnation": 0, "Events": []}
        self.vm_name = "vm-a"
        super().__init__(port)

    def schedule(self, *events: dict) -> None:
        with self.changed:
            incarnation = self.document["DocumentIncarnation"] + 1 if isinstance(self.document, dict) else 1
            self.document = {"DocumentIncarnation": incarnation, "Events": list(events)}

    def answer_raw(self, body: bytes) -> None:
        with self.changed:
            self.document = body

    class Handler(FakeService.Handler):
        fake: FakeAzure

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if self.headers.get("Metadata") != "true" or "X-Forwarded-For" in self.headers:
                return self.reply(400, b'{"error": "Bad request. Required metadata header not specified"}',
                                  "application/json")
            if url.path == "/metadata/versions":
                return self.reply(200, b'{"apiVersions": ["2019-08-01", "2020-07-01", "2021-02-01"]}',
                                  "application/json")
            if url.path == "/metadata/instance/compute/name":
                query = urllib.parse.parse_qs(url.query)
                if query.get("format") != ["text"] or query.get("api-version") != ["2021-02-01"]:
                    return self.reply(400)
                return self.reply(200, self.fake.vm_name.encode(), "text/plain")
            if url.path != AZURE_EVENTS:
                return self.reply(404)
            if urllib.parse.parse_qs(url.query).get("api-version") not in (["2019-08-01"], ["2020-07-01"]):
                return self.reply(400, b'{"error": "Bad request. api-version is invalid or was not specified"}',
                                  "application/json")
            with self.fake.changed:
                document = self.fake.document
            self.reply(200, document if isinstance(document, bytes) else json.dumps(document).encode(),
                       "application/json")


def preempt_event(vm: str, not_before: str, event_type: str = "Preempt") -> dict:
    return {"EventId": secrets.token_hex(8), "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": [vm], "EventStatus": "Scheduled", "NotBefore": not_before, "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1}


def iso(t: int) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def refused_url() -> str:
    """An address where nothing listens: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------- fixtures

class Recorder:
    """What one watcher delivered, and when (monotonic)."""

    def __init__(self) -> None:
        self.notices: list[tuple[float, Notice]] = []
        self.hints: list[tuple[float, Notice]] = []

    def notice(self, notice: Notice) -> None:
        self.notices.append((time.monotonic(), notice))

    def hint(self, notice: Notice) -> None:
        self.hints.append((time.monotonic(), notice))


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeService]]:
    """fakes(FakeAws, ...) starts a fake service; all are closed at the end."""
    started: list[FakeService] = []

    def start(kind: type[FakeService], **kwargs) -> FakeService:
        started.append(kind(**kwargs))
        return started[-1]

    try:
        yield start
    finally:
        for fake in started:
            fake.close()


@pytest.fixture
def watching() -> Iterator[Callable[[NoticeWatcher], tuple[Recorder, threading.Thread]]]:
    """watching(watcher) runs it on its thread; at the end all are stopped and joined, and
    no notice-* thread (watchers, auto's probes) may be left."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(watcher: NoticeWatcher) -> tuple[Recorder, threading.Thread]:
        recorder = Recorder()
        threads.append(watcher.start(recorder.notice, stop, on_hint=recorder.hint))
        return recorder, threads[-1]

    try:
        yield start
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("notice-")], 10,
                 "the watcher and probe threads to end")


@pytest.fixture
def notice_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="megatron_parcae.control.notices")
    return caplog


def warnings_about(caplog: pytest.LogCaptureFixture, fragment: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("megatron_parcae.control.notices")
            and r.levelno == logging.WARNING and fragment in r.getMessage()]


def delivered_once(recorder: Recorder, thread: threading.Thread, marked_at: float) -> Notice:
    """The one notice, delivered within NOTICE_WITHIN_S of `marked_at`."""
    wait_for(lambda: recorder.notices, NOTICE_WITHIN_S + 5, "the notice")
    thread.join(5)
    assert not thread.is_alive(), "the watcher goes on after its notice"
    [(seen_at, notice)] = recorder.notices
    assert seen_at - marked_at < NOTICE_WITHIN_S
    return notice


# ---------------------------------------------------------------- the fakes follow the protocols

def _status(url: str, method: str, path: str, headers: dict[str, str]) -> int:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        connection.request(method, path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_fakes_refuse_requests_without_the_documented_headers(fakes):
    aws, gcp, azure = fakes(FakeAws), fakes(FakeGcp), fakes(FakeAzure)
    assert _status(aws.url, "PUT", "/latest/api/token", {}) == 400
    assert _status(aws.url, "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21601"}) == 400
    assert _status(aws.url, "GET", AWS_ACTION, {}) == 401
    assert _status(aws.url, "GET", AWS_ACTION, {"X-aws-ec2-metadata-token": "forged"}) == 401
    assert _status(gcp.url, "GET", GCP_PREEMPTED, {}) == 403
    assert _status(gcp.url, "GET", GCP_PREEMPTED, {"Metadata-Flavor": "Google"}) == 200
    assert _status(azure.url, "GET", f"{AZURE_EVENTS}?api-version=2020-07-01", {}) == 400
    assert _status(azure.url, "GET", AZURE_EVENTS, {"Metadata": "true"}) == 400  # no api-version
    assert _status(azure.url, "GET", f"{AZURE_EVENTS}?api-version=2020-07-01", {"Metadata": "true"}) == 200


# ---------------------------------------------------------------- AWS

def test_aws_notice_with_the_instance_action_time(fakes, watching):
    aws = fakes(FakeAws)
    recorder, thread = watching(AwsWatcher(aws.url, poll_seconds=POLL_S))
    wait_for(lambda: aws.served("GET", AWS_ACTION, 404) >= 2, 10, "polls answered 404")
    assert not recorder.notices
    deadline = int(time.time()) + 120
    marked_at = time.monotonic()
    aws.mark(AWS_ACTION, {"action": "stop", "time": iso(deadline)})
    notice = delivered_once(recorder, thread, marked_at)
    assert (notice.source, notice.action, notice.deadline) == ("aws", "stop", float(deadline))
    assert abs(notice.received_at - time.time()) < NOTICE_WITHIN_S + 5
    assert aws.ttls == [21600]
    assert not recorder.hints


def test_aws_fetches_a_new_token_when_the_old_one_expired(fakes, watching):
    aws = fakes(FakeAws)
    recorder, thread = watching(AwsWatcher(aws.url, poll_seconds=POLL_S))
    wait_for(lambda: aws.served("GET", AWS_ACTION, 404) >= 1, 10, "a poll with the first token")
    aws.expire_tokens()
    wait_for(lambda: aws.served("GET", AWS_ACTION, 401) >= 1, 10, "a poll refused for the expired token")
    wait_for(lambda: len(aws.ttls) >= 2, 10, "a new token")
    deadline = int(time.time()) + 120
    marked_at = time.monotonic()
    aws.mark(AWS_ACTION, {"action": "terminate", "time": iso(deadline)})
    notice = delivered_once(recorder, thread, marked_at)
    assert (notice.action, notice.deadline) == ("terminate", float(deadline))


def test_aws_rebalance_recommendation_is_a_hint_not_a_notice(fakes, watching):
    aws = fakes(FakeAws)
    recorder, thread = watching(AwsWatcher(aws.url, poll_seconds=POLL_S))
    issued = int(time.time()) - 5
    marked_at = time.monotonic()
    aws.mark(AWS_REBALANCE, {"noticeTime": iso(issued)})
    wait_for(lambda: recorder.hints, NOTICE_WITHIN_S + 5, "the rebalance hint")
    [(seen_at, hint)] = recorder.hints
    assert seen_at - marked_at < NOTICE_WITHIN_S
    assert (hint.source, hint.action, hint.deadline) == ("aws", "rebalance", float(issued))
    served = aws.served("GET", AWS_ACTION)
    wait_for(lambda: aws.served("GET", AWS_ACTION) >= served + 3, 10, "more polls after the hint")
    assert not recorder.notices and thread.is_alive()
    assert len(recorder.hints) == 1  # the recommendation stays; the hint is given once
    deadline = int(time.time()) + 120
    marked_at = time.monotonic()
    aws.mark(AWS_ACTION, {"action": "terminate", "time": iso(deadline)})
    assert delivered_once(recorder, thread, marked_at).deadline == deadline
    assert len(recorder.hints) == 1


# ---------------------------------------------------------------- GCP

@pytest.mark.parametrize("max_hang", [0.3, 30.0], ids=["server-ends-hangs", "client-timeout_sec"])
def test_gcp_notice_after_hanging_gets(fakes, watching, max_hang):
    gcp = fakes(FakeGcp, max_hang=max_hang)
    recorder, thread = watching(GcpWatcher(gcp.url, poll_seconds=POLL_S, grace_seconds=25, hang_seconds=1))
    # the first GET, then two hanging GETs that ended FALSE (a timeout): the second hung again
    wait_for(lambda: gcp.served("GET", GCP_PREEMPTED) >= 3, 15, "hanging GETs answered FALSE")
    assert not recorder.notices
    marked_at, preempted_at = time.monotonic(), time.time()
    gcp.preempt()
    notice = delivered_once(recorder, thread, marked_at)
    assert (notice.source, notice.action) == ("gcp", "preempt")
    assert notice.deadline == notice.received_at + 25
    assert 0 <= notice.received_at - preempted_at < NOTICE_WITHIN_S


def test_gcp_sees_a_preemption_that_came_before_it_started(fakes, watching):
    gcp = fakes(FakeGcp)
    gcp.preempt()
    started_at = time.monotonic()
    recorder, thread = watching(GcpWatcher(gcp.url, poll_seconds=POLL_S))
    assert delivered_once(recorder, thread, started_at).deadline == recorder.notices[0][1].received_at + 30


# ---------------------------------------------------------------- Azure

def test_azure_counts_only_preempt_events_of_its_vm(fakes, watching):
    azure = fakes(FakeAzure)
    azure.vm_name = "vm-b"  # what a watcher given no name learns from the service
    deadline = int(time.time()) + 30
    not_before = email.utils.formatdate(deadline, usegmt=True)  # "Mon, 19 Sep 2016 18:29:47 GMT"
    mine = watching(AzureWatcher(azure.url, poll_seconds=POLL_S, vm_name="vm-a"))
    learned = watching(AzureWatcher(azure.url, poll_seconds=POLL_S))
    wait_for(lambda: azure.served("GET", AZURE_EVENTS) >= 4, 10, "polls of an empty document")
    marked_at = time.monotonic()
    azure.schedule(preempt_event("vm-a", not_before, "Freeze"), preempt_event("vm-b", not_before))
    notice = delivered_once(*learned, marked_at)
    assert (notice.source, notice.action, notice.deadline) == ("azure", "preempt", float(deadline))
    served = azure.served("GET", AZURE_EVENTS)
    wait_for(lambda: azure.served("GET", AZURE_EVENTS) >= served + 3, 10, "vm-a's watcher polling on")
    assert not mine[0].notices
    marked_at = time.monotonic()
    azure.schedule(preempt_event("vm-b", not_before), preempt_event("vm-a", not_before))
    assert delivered_once(*mine, marked_at).deadline == deadline


def test_azure_watcher_learns_its_vm_name_and_ignores_other_vms(fakes, watching):
    azure = fakes(FakeAzure)
    azure.vm_name = "vm-b"
    deadline = int(time.time()) + 30
    not_before = email.utils.formatdate(deadline, usegmt=True)
    recorder, thread = watching(AzureWatcher(azure.url, poll_seconds=POLL_S))
    azure.schedule(preempt_event("vm-a", not_before))  # a neighbour in the scale set
    served = azure.served("GET", AZURE_EVENTS)
    wait_for(lambda: azure.served("GET", AZURE_EVENTS) >= served + 3, 10, "polls of a neighbour's eviction")
    assert not recorder.notices and azure.served("GET", "/metadata/instance/compute/name") == 1
    marked_at = time.monotonic()
    azure.schedule(preempt_event("vm-a", not_before), preempt_event("vm-b", not_before))
    assert delivered_once(recorder, thread, marked_at).deadline == deadline


def test_azure_started_preemption_has_no_not_before(fakes, watching):
    azure = fakes(FakeAzure)
    event = {**preempt_event("vm-a", ""), "EventStatus": "Started"}
    azure.schedule(event)
    started_at = time.monotonic()
    recorder, thread = watching(AzureWatcher(azure.url, poll_seconds=POLL_S))
    notice = delivered_once(recorder, thread, started_at)
    assert notice.deadline == notice.received_at


# ---------------------------------------------------------------- malformed answers

def _aws_case(body: bytes | dict) -> tuple[type[FakeService], Callable, Callable]:
    def bad(fake: FakeAws, deadline: int) -> None:
        fake.mark(AWS_ACTION, body)

    def good(fake: FakeAws, deadline: int) -> None:
        fake.mark(AWS_ACTION, {"action": "terminate", "time": iso(deadline)})

    return FakeAws, bad, good


def _azure_case(document: bytes | dict) -> tuple[type[FakeService], Callable, Callable]:
    def bad(fake: FakeAzure, deadline: int) -> None:
        fake.answer_raw(document if isinstance(document, bytes) else json.dumps(document).encode())

    def good(fake: FakeAzure, deadline: int) -> None:
        fake.schedule(preempt_event("vm-a", email.utils.formatdate(deadline, usegmt=True)))

    return FakeAzure, bad, good


MALFORMED = {
    "aws-not-json": (*_aws_case(b'{"action": "terminate", "time"'), "not JSON"),
    "aws-no-time": (*_aws_case({"action": "terminate"}), "instance-action time is not a string"),
    "aws-action-not-a-string": (*_aws_case({"action": 7, "time": "2030-01-01T00:00:00Z"}), "no action word"),
    "aws-deep-json": (*_aws_case(b"[" * 60000), "nested too deeply"),
    "aws-bad-time": (*_aws_case({"action": "terminate", "time": "in two minutes"}), "not an ISO 8601 time"),
    "aws-not-an-object": (*_aws_case(b'["terminate"]'), "not a JSON object"),
    "azure-not-json": (*_azure_case(b"<html>"), "not JSON"),
    "azure-events-not-a-list": (*_azure_case({"DocumentIncarnation": 1, "Events": {}}), "Events is not a list"),
    "azure-bad-not-before": (*_azure_case({"DocumentIncarnation": 2, "Events": [preempt_event("vm-a", "soon")]}),
                             "not an RFC 1123 date"),
    "azure-resources-not-a-list": (*_azure_case({"DocumentIncarnation": 3, "Events": [
        {**preempt_event("vm-a", ""), "Resources": "vm-a"}]}), "Resources is not a list"),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_answers_are_logged_once_and_ignored(fakes, watching, notice_log, case):
    kind, bad, good, problem = case
    fake = fakes(kind)
    watcher_class = AwsWatcher if kind is FakeAws else AzureWatcher
    path = AWS_ACTION if kind is FakeAws else AZURE_EVENTS
    recorder, thread = watching(watcher_class(fake.url, poll_seconds=POLL_S))
    deadline = int(time.time()) + 60
    bad(fake, deadline)
    served = fake.served("GET", path, 200)
    wait_for(lambda: fake.served("GET", path, 200) >= served + 2, 10, "two malformed answers")
    assert not recorder.notices and thread.is_alive()
    marked_at = time.monotonic()
    good(fake, deadline)
    assert delivered_once(recorder, thread, marked_at).deadline == deadline
    assert len(warnings_about(notice_log, problem)) == 1, [r.getMessage() for r in notice_log.records]


def test_gcp_malformed_value_is_logged_and_ignored(fakes, watching, notice_log):
    gcp = fakes(FakeGcp)
    recorder, thread = watching(GcpWatcher(gcp.url, poll_seconds=POLL_S, hang_seconds=1))
    gcp.preempt(b"MAYBE")
    wait_for(lambda: warnings_about(notice_log, "neither TRUE nor FALSE"), 10, "the warning")
    served = gcp.served("GET", GCP_PREEMPTED)
    wait_for(lambda: gcp.served("GET", GCP_PREEMPTED) > served, 10, "a hang on the bad value ended by its timeout")
    assert not recorder.notices and thread.is_alive()
    marked_at = time.monotonic()
    gcp.preempt()
    delivered_once(recorder, thread, marked_at)
    assert len(warnings_about(notice_log, "neither TRUE nor FALSE")) == 1


def test_unreachable_service_is_retried_until_it_answers(fakes, watching, notice_log):
    url = refused_url()
    recorder, thread = watching(AwsWatcher(url, poll_seconds=POLL_S))
    wait_for(lambda: warnings_about(notice_log, "refused"), 10, "a warning about the refused connection")
    time.sleep(0.6)  # more refused attempts, backing off
    assert thread.is_alive() and len(warnings_about(notice_log, "refused")) == 1
    aws = fakes(FakeAws, port=urllib.parse.urlsplit(url).port)
    deadline = int(time.time()) + 120
    marked_at = time.monotonic()
    aws.mark(AWS_ACTION, {"action": "terminate", "time": iso(deadline)})
    assert delivered_once(recorder, thread, marked_at).deadline == deadline


def test_a_watcher_delivers_one_notice(fakes, watching):
    aws = fakes(FakeAws)
    aws.mark(AWS_ACTION, {"action": "terminate", "time": iso(int(time.time()) + 100)})
    watcher = AwsWatcher(aws.url, poll_seconds=POLL_S)
    recorder, thread = watching(watcher)
    delivered_once(recorder, thread, time.monotonic())
    served = aws.served("GET", AWS_ACTION)
    watcher.watch(recorder.notice, threading.Event())  # returns at once: its notice is given
    assert len(recorder.notices) == 1 and aws.served("GET", AWS_ACTION) == served


# ---------------------------------------------------------------- build_watcher and auto

def test_build_watcher_sources_and_errors():
    assert build_watcher("signal") is None
    watcher = build_watcher("gcp", "http://127.0.0.1:1", grace_seconds=12, poll_seconds=3)
    assert isinstance(watcher, GcpWatcher) and (watcher.grace_seconds, watcher.poll_seconds) == (12, 3)
    assert isinstance(build_watcher("azure", vm_name="vm-a"), AzureWatcher)
    with pytest.raises(ValueError, match="unknown notice source"):
        build_watcher("ec2")
    for url in ("ftp://127.0.0.1", "http://", "127.0.0.1:80", "http://127.0.0.1:99999", "http://h/?q=1"):
        with pytest.raises(ValueError, match="endpoint must look like"):
            build_watcher("aws", url)
    with pytest.raises(ValueError, match="poll_seconds"):
        build_watcher("aws", poll_seconds=0)
    with pytest.raises(TypeError):
        build_watcher("aws", grace_seconds=5)  # AWS gives its own deadline


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("where", ["refused", "silent", "unroutable"])
def test_auto_falls_back_to_signals_within_two_seconds(watching, silent_listener, where):
    urls = {"refused": {name: refused_url() for name in ("aws", "gcp", "azure")},
            "silent": dict.fromkeys(("aws", "gcp", "azure"), silent_listener),
            # TEST-NET-1 (RFC 5737): never routed; connecting fails at once or times out
            "unroutable": dict.fromkeys(("aws", "gcp", "azure"), "http://192.0.2.1")}[where]
    started = time.monotonic()
    assert build_watcher("auto", endpoints=urls) is None
    assert time.monotonic() - started < AUTO_WITHIN_S


@pytest.mark.parametrize("kind", [FakeAws, FakeGcp, FakeAzure], ids=["aws", "gcp", "azure"])
def test_auto_finds_the_service_that_answers_in_its_protocol(fakes, watching, kind):
    fake = fakes(kind)
    started = time.monotonic()
    # all three probes go to the one fake: only its own protocol may succeed there
    watcher = build_watcher("auto", fake.url, poll_seconds=POLL_S, grace_seconds=10, vm_name="vm-a")
    assert time.monotonic() - started < AUTO_WITHIN_S
    expected = {FakeAws: AwsWatcher, FakeGcp: GcpWatcher, FakeAzure: AzureWatcher}[kind]
    assert type(watcher) is expected and watcher.endpoint.url == fake.url and watcher.poll_seconds == POLL_S
    other = refused_url()
    assert type(build_watcher("auto", other, endpoints={watcher.source: fake.url})) is expected


# ---------------------------------------------------------------- parcae notice-watch

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_parcae.cli", "notice-watch", *args]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)


def _start(processes: list[subprocess.Popen], *args: str) -> subprocess.Popen:
    processes.append(subprocess.Popen(_cli(*args), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return processes[-1]


def _line(p: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, "no line printed"
    return p.stdout.readline()


def test_cli_prints_the_notice_as_json_and_exits(fakes, processes):
    aws = fakes(FakeAws)
    p = _start(processes, "--source", "aws", "--endpoint", aws.url, "--once", "--json", "--poll-seconds", str(POLL_S))
    wait_for(lambda: aws.served("GET", AWS_ACTION, 404) or p.poll() is not None, 20, "the command polling")
    deadline = int(time.time()) + 120
    aws.mark(AWS_REBALANCE, {"noticeTime": iso(deadline - 200)})
    aws.mark(AWS_ACTION, {"action": "terminate", "time": iso(deadline)})
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1] == {"source": "aws", "action": "terminate", "deadline": deadline}
    assert all(line["action"] == "rebalance" for line in lines[:-1])


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_cli_keeps_watching_until_interrupted(fakes, processes, sig, code):
    gcp = fakes(FakeGcp)
    p = _start(processes, "--source", "gcp", "--endpoint", gcp.url)
    wait_for(lambda: gcp.served("GET", GCP_PREEMPTED) or p.poll() is not None, 20, "the command asking")
    gcp.preempt()
    assert _line(p, 10).startswith("gcp preempt, deadline ")
    time.sleep(0.3)
    assert p.poll() is None
    p.send_signal(sig)
    out, err = p.communicate(timeout=5)
    assert p.returncode == code and "Traceback" not in err, err


def test_cli_errors():
    nothing = subprocess.run(_cli("--source", "auto", "--endpoint", refused_url()), cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=20)
    assert nothing.returncode == 1 and "no metadata service" in nothing.stderr and not nothing.stdout
    bad_url = subprocess.run(_cli("--source", "aws", "--endpoint", "ftp://x"), cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=20)
    assert bad_url.returncode == 2 and "endpoint must look like" in bad_url.stderr
    bad_source = subprocess.run(_cli("--source", "ec2"), cwd=REPO, env=child_env(), capture_output=True, text=True,
                                timeout=20)
    assert bad_source.returncode == 2 and "invalid choice" in bad_source.stderr
