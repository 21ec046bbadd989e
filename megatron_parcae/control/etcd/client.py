"""A small etcd v3 client: with keepalive.py, the only code that talks gRPC to etcd.

It uses etcd's protocol as the `etcd3` package ships it (protocol.py) but not its
high-level client: that client sends the auth token as call credentials, which gRPC
refuses on plaintext channels ("Established channel does not have a sufficient security
level"), lets most gRPC errors through untranslated, and reopens a broken watch stream
in a loop without pause. Here every call has a short deadline and every failure becomes
one of four exceptions whose message says what to check: `EtcdUnavailable`,
`EtcdAuthError`, `LeaseExpired`, or `EtcdError`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

# gRPC's fork handlers can abort a child forked while a channel reconnects (seen when
# EtcdServer.restart() forks etcd, whose parent-death signal needs a fork, not a spawn);
# no process here forks to use gRPC in the child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import grpc._common  # noqa: E402

from megatron_parcae.control.etcd.keepalive import KeepAliveStream  # noqa: E402
from megatron_parcae.control.etcd.protocol import Stub, rpc  # noqa: E402

log = logging.getLogger(__name__)

# gRPC's blocking waits (a stream's next message, a call's answer) wake every 0.1 s so that
# a signal handler is not held up where a wait cannot be interrupted. CPython on Linux runs
# handlers during a wait, and every stream a process holds (watches, keep-alives) waking
# ten times a second takes the GIL from the training step beside it. A private setting:
# changed only where this gRPC has it.
if hasattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT"):
    grpc._common.MAXIMUM_WAIT_TIMEOUT = 2.0

DEFAULT_TIMEOUT_S = 5.0
# Reconnect quickly after an etcd restart instead of gRPC's default backoff (up to 120 s);
# never route etcd traffic through an HTTP proxy taken from the environment.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_http_proxy", 0),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class EtcdError(RuntimeError):
    """An etcd operation failed; the message says which and why."""


class EtcdUnavailable(EtcdError):
    """etcd cannot be reached (down, wrong endpoint, TLS mismatch, or too slow)."""


class EtcdGone(EtcdUnavailable):
    """etcd stayed unreachable longer than the client's outage bound: waiting it out is
    over, and the caller gives up (a restart of etcd takes less)."""


class EtcdAuthError(EtcdError):
    """etcd refused the credentials, or credentials and server auth settings disagree."""


class LeaseExpired(EtcdError):
    """The lease a write was attached to no longer exists: its holder is fenced."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for TLS: the CA that signed the server, optionally a client cert/key."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd TLS: give both a client certificate and its key, or neither")
        for label, path in (("CA", self.ca), ("client certificate", self.cert), ("client key", self.key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"etcd TLS: {label} file {path!r} does not exist")

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """Return (ca, key, cert) file contents as gRPC wants them."""

        def load(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return load(self.ca), load(self.key), load(self.cert)  # type: ignore[return-value]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split 'HOST:PORT' (an optional http:// or https:// prefix is accepted)."""
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r} is not HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class KeyValue:
    """One key as stored; `lease` is 0 when the key has none."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


CompareTarget = Literal["value", "version", "create", "mod", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """A transaction condition on one key, e.g. Compare(k, "version", "==", 0): k is absent."""

    key: str
    target: CompareTarget
    op: CompareOp
    operand: int | bytes


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


TxnOp = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    """Whether the conditions held, and the keys read by each Get of the branch taken."""

    succeeded: bool
    reads: list[list[KeyValue]]


@dataclass(frozen=True)
class WatchEvent:
    """A key changed; `value` is None when it was deleted (or its lease expired)."""

    key: str
    value: bytes | None
    revision: int


_OPS = {"==": 0, ">": 1, "<": 2, "!=": 3}  # etcdserverpb.Compare.CompareResult
_TARGETS = {"version": 0, "create": 1, "mod": 2, "value": 3, "lease": 4}


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with `prefix` (etcd range_end)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def _range_request(key: str, prefix: bool) -> rpc.RangeRequest:
    req = rpc.RangeRequest(key=key.encode())
    if prefix:
        req.range_end = prefix_end(key)
    return req


def _to_kv(kv) -> KeyValue:
    return KeyValue(kv.key.decode(errors="replace"), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.version, kv.lease)


class EtcdClient:
    """Connection to one etcd endpoint; thread-safe (gRPC channels are).

    Connecting authenticates (if a user is given) and checks the server answers, so a
    wrong endpoint or password fails here, within `timeout` seconds, not at first use.
    Afterwards the client tracks how long etcd has been unreachable (every call since
    the first unanswered one failed): `check_reachable()` raises `EtcdGone` once that
    exceeds `outage_seconds` (long-running processes set it: see etcd/options.py).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        tls: TLSFiles | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        outage_seconds: float = math.inf,
    ) -> None:
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both a user and a password")
        if timeout <= 0:
            raise ValueError(f"etcd timeout must be positive, got {timeout}")
        if not outage_seconds > timeout:
            raise ValueError(f"etcd outage bound must exceed the timeout ({timeout:g} s), got {outage_seconds}")
        host, port = parse_endpoint(endpoint)
        self.endpoint = f"{host}:{port}"
        self.timeout = timeout
        self.outage_seconds = outage_seconds
        self._unreachable_since: float | None = None  # monotonic time of the first failure in a row
        self._user = user
        self._password = password
        self._tls = tls
        target = f"[{host}]:{port}" if ":" in host else self.endpoint
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(*tls.read()), options=_CHANNEL_OPTIONS)
        self._kv = Stub(self._channel, "KV")
        self._lease = Stub(self._channel, "Lease")
        self._watch = Stub(self._channel, "Watch")
        self._maintenance = Stub(self._channel, "Maintenance")
        self._auth = Stub(self._channel, "Auth")
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._auth_lock = threading.Lock()
        self._keep_alives = KeepAliveStream(self._open_keep_alives, self._answered, self._keep_alives_failed)
        try:
            self._connect()
            if user is not None:
                self._authenticate()
            self.server_version = self._call("status", self._maintenance.Status, rpc.StatusRequest()).version
            if user is None and (tls is None or tls.cert is None):
                self._check_anonymous_access()
        except BaseException:
            self._channel.close()
            raise

    def _connect(self) -> None:
        """Wait for the channel to be up; gRPC retries transient failures meanwhile.

        Every call afterwards waits for the channel too (up to its deadline), so clients
        ride out an etcd restart instead of failing while gRPC reconnects.
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            tls = "with TLS" if self._tls is not None else "without TLS"
            raise EtcdUnavailable(
                f"cannot connect to etcd at {self.endpoint} {tls} within {self.timeout:g} s: is etcd running "
                "there, and do the client's TLS settings match the server's?"
            ) from None

    # -- reachability ----------------------------------------------------------------

    @property
    def unreachable_seconds(self) -> float:
        """How long every call has failed for want of an answer (0 while etcd answers)."""
        since = self._unreachable_since
        return 0.0 if since is None else time.monotonic() - since

    def check_reachable(self) -> None:
        """Raise EtcdGone once etcd has been unreachable longer than the outage bound."""
        if self.unreachable_seconds > self.outage_seconds:
            raise EtcdGone(f"etcd at {self.endpoint} has not answered for {self.unreachable_seconds:.0f} s, more "
                           f"than the outage bound of {self.outage_seconds:g} s (an etcd restart takes less): giving up")

    def _answered(self) -> None:
        self._unreachable_since = None

    def _failed(self, error: EtcdError) -> EtcdError:
        if isinstance(error, EtcdUnavailable) and self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
        return error

    # -- errors and authentication -------------------------------------------------

    def _error(self, what: str, exc: grpc.RpcError, timeout: float | None = None) -> EtcdError:
        code, details = exc.code(), (exc.details() or "").strip()
        where = f"etcd {what} at {self.endpoint}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = "is etcd running there, and do the client's TLS settings match the server's?"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"no answer within {timeout or self.timeout:g} s"
            return EtcdUnavailable(f"{where} failed: {details}; {hint}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or any(
                s in details for s in ("authentication", "auth token", "user name is empty")):
            hint = "check the etcd user and password" if self._user else "the server requires a user and password"
            return EtcdAuthError(f"{where} refused: {details}; {hint}")
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return LeaseExpired(f"{where} failed: {details} (the lease expired or was revoked)")
        return EtcdError(f"{where} failed: {code.name} {details}")

    def _authenticate(self) -> None:
        request = rpc.AuthenticateRequest(name=self._user, password=self._password)
        try:
            token = self._auth.Authenticate(request, self.timeout, wait_for_ready=True).token
        except grpc.RpcError as exc:
            error = self._error("authentication", exc)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                error = EtcdAuthError(f"etcd at {self.endpoint} has authentication disabled but a user was given: {exc.details()}")
            raise error from None
        self._metadata = (("token", token),)

    def _check_anonymous_access(self) -> None:
        """One read without credentials: a server with authentication on refuses it here,
        at connect, instead of at the caller's first use (status needs no credentials)."""
        self._call("read", self._kv.Range, rpc.RangeRequest(key=b"/", count_only=True))

    def _call(self, what: str, method, request, timeout: float | None = None):
        """Run one unary RPC with the deadline (`timeout`, default the client's);
        re-authenticate once if the token expired."""
        for attempt in range(2):
            try:
                response = method(request, timeout or self.timeout, metadata=self._metadata, wait_for_ready=True)
            except grpc.RpcError as exc:
                if attempt == 0 and self._user is not None and "invalid auth token" in (exc.details() or ""):
                    with self._auth_lock:
                        self._authenticate()
                    continue
                raise self._failed(self._error(what, exc, timeout)) from None
            self._answered()
            return response
        raise AssertionError("unreachable")

    # -- key/value -------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        kvs = self._call(f"get {key}", self._kv.Range, _range_request(key, False)).kvs
        return _to_kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys starting with `prefix`, in key order."""
        return [_to_kv(kv) for kv in self._call(f"get {prefix}*", self._kv.Range, _range_request(prefix, True)).kvs]

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys starting with `prefix`, in key order, without their values."""
        req = _range_request(prefix, True)
        req.keys_only = True
        return [kv.key.decode(errors="replace") for kv in self._call(f"list {prefix}*", self._kv.Range, req).kvs]

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self._call(f"put {key}", self._kv.Put, rpc.PutRequest(key=key.encode(), value=value, lease=lease))

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete a key (or every key under a prefix); return how many were deleted."""
        req = rpc.DeleteRangeRequest(key=key.encode())
        if prefix:
            req.range_end = prefix_end(key)
        return self._call(f"delete {key}", self._kv.DeleteRange, req).deleted

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = (),
            timeout: float | None = None) -> TxnResult:
        """Atomically: if every condition holds run `success`, else `failure`."""
        response = self._call("transaction", self._kv.Txn, self._txn_request(compare, success, failure), timeout)
        reads = [[_to_kv(kv) for kv in r.response_range.kvs] for r in response.responses if r.WhichOneof("response") == "response_range"]
        return TxnResult(response.succeeded, reads)

    def start_txn(self, compare: Sequence[Compare], success: Sequence[TxnOp], timeout: float | None = None) -> StartedTxn:
        """`txn` sent now and answered later: the caller does other work (a collective)
        while etcd commits it, then asks `StartedTxn.succeeded()`. No Get in `success`."""
        future = self._kv.Txn.future(self._txn_request(compare, success, ()), timeout or self.timeout,
                                     metadata=self._metadata, wait_for_ready=True)
        return StartedTxn(self, future, timeout)

    def _txn_request(self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp]):
        return rpc.TxnRequest(compare=[self._compare_message(c) for c in compare],
                              success=[self._op_message(op) for op in success],
                              failure=[self._op_message(op) for op in failure])

    @staticmethod
    def _compare_message(c: Compare):
        message = rpc.Compare(key=c.key.encode(), result=_OPS[c.op], target=_TARGETS[c.target])
        if c.target == "value":
            if not isinstance(c.operand, bytes):
                raise TypeError(f"compare on the value of {c.key} needs bytes, got {type(c.operand).__name__}")
            message.value = c.operand
        else:
            if not isinstance(c.operand, int) or isinstance(c.operand, bool):
                raise TypeError(f"compare on the {c.target} of {c.key} needs an int, got {type(c.operand).__name__}")
            setattr(message, {"version": "version", "create": "create_revision", "mod": "mod_revision", "lease": "lease"}[c.target], c.operand)
        return message

    @staticmethod
    def _op_message(op: TxnOp):
        if isinstance(op, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease))
        if isinstance(op, Get):
            return rpc.RequestOp(request_range=_range_request(op.key, op.prefix))
        req = rpc.DeleteRangeRequest(key=op.key.encode())
        if op.prefix:
            req.range_end = prefix_end(op.key)
        return rpc.RequestOp(request_delete_range=req)

    # -- leases ----------------------------------------------------------------------

    def grant_lease(self, ttl_seconds: float) -> tuple[int, int]:
        """Grant a lease of at least `ttl_seconds` (rounded up to whole seconds); return (id, ttl)."""
        response = self._call("lease grant", self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=max(1, int(-(-ttl_seconds // 1)))))
        if response.error:
            raise EtcdError(f"etcd lease grant at {self.endpoint} failed: {response.error}")
        return response.ID, response.TTL

    def refresh_lease(self, lease_id: int, timeout: float | None = None) -> int:
        """Send one keep-alive on a stream of its own (waiting `timeout` s, default the
        client's); return the remaining TTL in seconds, 0 if the lease is gone. `KeptLease`
        uses the client's shared stream instead, and this only to check an overdue lease."""
        request = rpc.LeaseKeepAliveRequest(ID=lease_id)
        responses = self._lease.LeaseKeepAlive(iter([request]), timeout or self.timeout, metadata=self._metadata,
                                               wait_for_ready=True)
        try:
            ttl = next(responses).TTL
        except grpc.RpcError as exc:
            raise self._failed(self._error("lease keep-alive", exc, timeout)) from None
        except StopIteration:
            raise self._failed(EtcdUnavailable(f"etcd lease keep-alive at {self.endpoint} got no answer")) from None
        finally:
            responses.cancel()
        self._answered()
        return ttl

    def _open_keep_alives(self, requests: Iterator) -> Iterator:
        return self._lease.LeaseKeepAlive(requests, metadata=self._metadata, wait_for_ready=True)

    def _keep_alives_failed(self, exc: grpc.RpcError | None, waited: float) -> EtcdError:
        """Count a failure of the keep-alive stream (`exc`, or no answer for `waited` s)
        against the outage bound; re-authenticate if the token expired."""
        if exc is None:
            return self._failed(EtcdUnavailable(f"etcd lease keep-alive at {self.endpoint} failed: no answer within "
                                                f"{waited:.1f} s; is etcd running there?"))
        if self._user is not None and "invalid auth token" in (exc.details() or ""):
            try:
                with self._auth_lock:
                    self._authenticate()
            except EtcdError as error:
                return self._failed(error)
        return self._failed(self._error("lease keep-alive", exc))

    def revoke_lease(self, lease_id: int) -> bool:
        """Revoke a lease (its keys are deleted); False if it was already gone."""
        try:
            self._call("lease revoke", self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except LeaseExpired:
            return False
        return True

    # -- watch -----------------------------------------------------------------------

    def watch(self, key: str, on_change: Callable[[list[WatchEvent]], None], *, prefix: bool = False) -> "Watch":
        """Call `on_change` from a background thread whenever `key` (or a key under it) changes.

        `on_change([])` is called each time the watch is (re-)established, including the
        first time: events may have been missed while disconnected, so re-read the state.
        """
        return Watch(self, key, prefix, on_change)

    def _open_watch(self, requests: Iterator) -> Iterator:
        return self._watch.Watch(requests, metadata=self._metadata, wait_for_ready=True)

    def close(self) -> None:
        self._keep_alives.stop()
        self._channel.close()

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class Watch:
    """A watch kept open across disconnects (see `EtcdClient.watch`); `stop()` ends it."""

    def __init__(self, client: EtcdClient, key: str, prefix: bool, on_change: Callable[[list[WatchEvent]], None]) -> None:
        self._client = client
        self._create = rpc.WatchCreateRequest(key=key.encode())
        if prefix:
            self._create.range_end = prefix_end(key)
        self._on_change = on_change
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Not tenacity: its waits count attempts, and this backoff restarts mid-attempt, once a stream is created.
        backoff = 0.1
        while not self._stopped.is_set():
            requests: queue.Queue = queue.Queue()
            requests.put(rpc.WatchRequest(create_request=self._create))
            try:
                with self._lock:
                    if self._stopped.is_set():
                        return
                    try:
                        self._call = self._client._open_watch(iter(requests.get, None))
                    except ValueError:  # the client was closed: nothing left to watch
                        log.debug("etcd watch ends: its client was closed")
                        return
                for response in self._call:
                    if response.created:
                        backoff = 0.1
                        self._deliver([])
                    if response.canceled:
                        break
                    if response.events:
                        self._deliver([
                            WatchEvent(e.kv.key.decode(errors="replace"), bytes(e.kv.value) if e.type == 0 else None, e.kv.mod_revision)
                            for e in response.events
                        ])
            except grpc.RpcError as exc:
                if not self._stopped.is_set():
                    log.debug("etcd watch interrupted (%s), reconnecting", exc.code())
            finally:
                requests.put(None)
            self._stopped.wait(backoff)
            backoff = min(2.0, backoff * 2)

    def _deliver(self, events: list[WatchEvent]) -> None:
        try:
            self._on_change(events)
        except Exception:  # a failing callback must not kill the watch
            log.exception("etcd watch callback failed")

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class StartedTxn:
    """A transaction in flight (`EtcdClient.start_txn`)."""

    def __init__(self, client: EtcdClient, future, timeout: float | None) -> None:
        self._client, self._future, self._timeout = client, future, timeout

    def succeeded(self) -> bool:
        """Wait for etcd's answer: whether the conditions held; EtcdError if none came."""
        try:
            response = self._future.result()
        except grpc.RpcError as exc:
            raise self._client._failed(self._client._error("transaction", exc, self._timeout)) from None
        self._client._answered()
        return response.succeeded


class KeptLease:
    """A lease kept alive on its client's keep-alive stream (keepalive.py), one keep-alive
    every third of its TTL.

    `lost` becomes true, for good, once etcd says the lease is gone (it expired while this
    process was stalled, or someone revoked it to fence the holder); `on_lost` is called
    once then, on whichever thread noticed. While etcd is merely unreachable the lease is
    not declared lost: etcd extends every lease when it comes back.
    """

    def __init__(self, client: EtcdClient, ttl_seconds: float, on_lost: Callable[[], None] | None = None) -> None:
        requested_at = time.monotonic()
        self.id, self.ttl = client.grant_lease(ttl_seconds)
        self._client = client
        self._on_lost = on_lost
        self._valid_until = requested_at + self.ttl
        self._failed_at = -float("inf")
        self._lost = False
        self._lock = threading.Lock()  # guards _valid_until and _lost; never held while waiting for etcd
        self._checking = threading.Lock()  # one check of an overdue lease at a time
        client._keep_alives.add(self)

    def _keep_alive_answered(self, sent_at: float, ttl: int) -> None:
        if ttl <= 0:
            self._declare_lost()
            return
        with self._lock:
            self._valid_until = max(self._valid_until, sent_at + ttl)

    def _declare_lost(self) -> None:
        with self._lock:
            if self._lost:
                return
            self._lost = True
        self._client._keep_alives.remove(self.id)
        if self._on_lost is not None:
            self._on_lost()

    @property
    def lost(self) -> bool:
        """True once etcd confirmed the lease is gone; asks etcd itself when overdue.

        A process resumed after a stall longer than the TTL must not act on a stale view
        before the stream has answered, so an overdue lease is checked here, with a
        keep-alive of its own (but not while etcd does not answer, or within a third of
        the TTL of a failed check, so an etcd outage does not slow the caller down).
        """
        if not self._lost and time.monotonic() > self._valid_until and self._client.unreachable_seconds == 0:
            with self._checking:
                sent = time.monotonic()
                if not self._lost and sent > self._valid_until and sent - self._failed_at > self.ttl / 3:
                    try:
                        ttl = self._client.refresh_lease(self.id, timeout=max(1.0, self.ttl / 3))
                    except EtcdError:
                        self._failed_at = sent
                    else:
                        self._keep_alive_answered(sent, ttl)
        return self._lost

    def revoke(self) -> None:
        """Stop the keep-alives and revoke the lease, deleting the keys attached to it."""
        self._client._keep_alives.remove(self.id)
        with self._lock:
            if self._lost:
                return
            self._lost = True
        if self._client.unreachable_seconds > 0:  # do not wait out a deadline on the way out
            log.warning("lease %x not revoked: etcd is unreachable (it expires in %d s)", self.id, self.ttl)
            return
        try:
            self._client.revoke_lease(self.id)
        except EtcdError as exc:
            log.warning("could not revoke lease %x (it expires in %d s anyway): %s", self.id, self.ttl, exc)
