"""The keep-alives of every lease of one etcd client, on one LeaseKeepAlive stream.

A stream opened for each keep-alive costs milliseconds of CPU, and a thread per lease
more: a process of hundreds of agents, or a machine of a thousand, then misses leases
under load. Here one long-lived bidirectional stream carries them all: a request per
lease every third of its TTL, and etcd answers each, in order, with the lease's
remaining TTL (0: the lease is gone). Two threads per client whatever the number of
leases: gRPC's, which pulls the requests (and so also schedules them and notices a
stream that stopped answering), and this module's, which reads the answers and re-opens
the stream after a disconnect or an etcd restart.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Iterator, Protocol

import grpc

from megatron_parcae.control.etcd.protocol import rpc

log = logging.getLogger(__name__)

_BACKOFF_S = (0.2, 2.0)  # between attempts to open the stream, doubling
_EARLY_S = 0.1  # keep-alives due this soon go with those due now: fewer wake-ups of gRPC's thread


class KeptAlive(Protocol):
    """A lease on the stream: `ttl` in whole seconds; told each answer etcd gives."""

    id: int
    ttl: int

    def _keep_alive_answered(self, sent_at: float, ttl: int) -> None:
        """etcd answered the keep-alive sent at `sent_at` (monotonic) with `ttl` (0: gone)."""


class _Stream:
    """One LeaseKeepAlive call: its requests stop once it `ended`; `stalled` when it was
    ended for want of answers (a failure already reported)."""

    def __init__(self) -> None:
        self.call: grpc.Call | None = None
        self.ended = False
        self.stalled = False


class KeepAliveStream:
    """Keeps the added leases alive until they are removed or etcd says they are gone.

    `open_stream(requests)` opens a LeaseKeepAlive call; `answered()` and `failed(exc,
    waited)` tell the client whether etcd answers (for its outage bound): `exc` is the
    gRPC error that ended the stream, or None when nothing came back for `waited` s. A
    keep-alive unanswered for a third of its lease's TTL (at least a second), with no
    other answer meanwhile, means the stream stopped answering: it is re-opened, and
    the keep-alives in flight are sent again on the new one.
    """

    def __init__(self, open_stream: Callable[[Iterator], grpc.Call], answered: Callable[[], None],
                 failed: Callable[[grpc.RpcError | None, float], Exception]) -> None:
        self._open_stream = open_stream
        self._answered = answered
        self._failed = failed
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._leases: dict[int, KeptAlive] = {}
        self._due: dict[int, float] = {}  # lease id -> monotonic time of its next keep-alive
        self._in_flight: collections.deque[tuple[int, float]] = collections.deque()  # (lease id, sent at), in order
        self._last_answer = -float("inf")
        self._stream: _Stream | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, lease: KeptAlive) -> None:
        """Send `lease`'s keep-alives from a third of its TTL from now on."""
        with self._lock:
            if self._stopped:
                raise ValueError("the etcd client was closed")
            self._leases[lease.id] = lease
            self._due[lease.id] = time.monotonic() + lease.ttl / 3
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-keep-alive", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def remove(self, lease_id: int) -> None:
        """Send no more keep-alives for this lease (an answer in flight is ignored)."""
        with self._lock:
            self._leases.pop(lease_id, None)
            self._due.pop(lease_id, None)

    def stop(self) -> None:
        """End the stream and its thread (the client is closing)."""
        with self._lock:
            self._stopped = True
            if self._stream is not None:
                self._end_locked(self._stream)
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _end_locked(self, stream: _Stream) -> None:
        stream.ended = True
        if stream.call is not None:
            stream.call.cancel()
        self._changed.notify_all()

    # -- the reading thread ----------------------------------------------------------

    def _run(self) -> None:
        # Not tenacity: its waits count attempts, and this backoff restarts mid-attempt, at each answer on the stream.
        backoff = _BACKOFF_S[0]
        answered_since_failure = True  # warn once an outage, not at every attempt
        while True:
            with self._lock:
                while not self._leases and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    return
                stream = self._stream = _Stream()
            try:
                call = self._open_stream(self._requests(stream))
            except ValueError:  # the client's channel was closed
                log.debug("etcd keep-alives end: the client was closed")
                return
            with self._lock:
                stream.call = call
                if stream.ended:
                    call.cancel()
            error: grpc.RpcError | None = None
            try:
                for response in call:
                    backoff, answered_since_failure = _BACKOFF_S[0], True
                    self._answer(response.ID, response.TTL)
            except grpc.RpcError as exc:
                error = exc
            with self._lock:
                self._end_locked(stream)
                self._stream = None
                now = time.monotonic()
                for lease_id, _ in self._in_flight:  # unanswered: sent again at once on the next stream
                    if lease_id in self._due:
                        self._due[lease_id] = now
                self._in_flight.clear()
                if self._stopped:
                    return
            if not stream.stalled:
                failure = self._failed(error, 0.0) if error is not None else None
                if answered_since_failure:
                    log.warning("etcd lease keep-alive stream ended (re-opening it until etcd answers): %s",
                                failure or "etcd closed it")
                answered_since_failure = False
            with self._lock:
                self._changed.wait_for(lambda: self._stopped, timeout=backoff)
            backoff = min(_BACKOFF_S[1], backoff * 2)

    def _answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            self._last_answer = time.monotonic()
            sent_at = None
            while self._in_flight:  # etcd answers in order: earlier ones without an answer got none
                in_flight_id, at = self._in_flight.popleft()
                if in_flight_id == lease_id:
                    sent_at = at
                    break
            lease = self._leases.get(lease_id)
            if lease is not None and ttl <= 0:
                del self._leases[lease_id], self._due[lease_id]
        self._answered()
        if lease is not None and sent_at is not None:
            lease._keep_alive_answered(sent_at, ttl)

    # -- the requests, pulled by gRPC's thread ---------------------------------------

    def _requests(self, stream: _Stream) -> Iterator[rpc.LeaseKeepAliveRequest]:
        """The keep-alives as they fall due, until `stream` ends; ends it when it
        stopped answering."""
        while True:
            with self._lock:
                while True:
                    if stream.ended:
                        return
                    now = time.monotonic()
                    due = [lease_id for lease_id, at in self._due.items() if at <= now + _EARLY_S]
                    if due:
                        break
                    wake = min(self._due.values(), default=now + 3600)
                    if self._in_flight:
                        lease_id, sent_at = self._in_flight[0]
                        waited = now - max(sent_at, self._last_answer)
                        bound = max(1.0, self._leases[lease_id].ttl / 3) if lease_id in self._leases else 1.0
                        if waited > bound:
                            stream.stalled = True
                            self._failed(None, waited)
                            log.warning("etcd lease keep-alive stream: no answer for %.1f s, re-opening it", waited)
                            self._end_locked(stream)
                            return
                        wake = min(wake, now + bound - waited)
                    self._changed.wait(max(0.01, wake - now))
                for lease_id in due:
                    self._due[lease_id] = now + self._leases[lease_id].ttl / 3
                    self._in_flight.append((lease_id, now))
            for lease_id in due:
                yield rpc.LeaseKeepAliveRequest(ID=lease_id)
