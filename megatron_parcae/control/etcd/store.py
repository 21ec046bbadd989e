"""A torch.distributed Store whose keys live in etcd.

Workers are started one per spot instance, without torchrun, and form a new WORLD for
every generation while processes come and go; the job's etcd is the only service all of
them reach, so it is also where gloo and NCCL exchange their connection details.

What torch 2.13 calls on a Python store (recorded over three gloo ranks):
init_process_group, new_group and megatron-core's initialize_model_parallel use only
`set`, `get` and `wait(keys, timeout)`; TORCH_DIST_INIT_BARRIER=1 adds `add`; `append`,
`multi_get` and `multi_set` fall back in C++ to `compare_set`, `get` and `set`. Through a
C++ wrapper such as `PrefixStore` the trampoline looks up `delete_key` and `num_keys` by
their C++ names (`deleteKey`, `getNumKeys`), and it cannot reach a Python `clone`, so
none is offered. A timeout raises `DistStoreError`, as TCPStore does; torch's store
barrier catches it as the RuntimeError it is.

Blocking calls poll with a short backoff. A prefix watch that wakes waiters was measured
no faster (the ~1 ms cost of each etcd call dominates), and a poll needs no thread and
cannot miss an event across an etcd reconnect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch.distributed as dist
from tenacity import RetryCallState, Retrying, retry_if_exception, retry_if_result, stop_after_delay, wait_exponential

from megatron_parcae.control.etcd.client import Compare, EtcdAuthError, EtcdClient, EtcdError, Put

T = TypeVar("T")
_BACKOFF = wait_exponential(multiplier=0.001, max=0.02)  # 1 ms, doubling up to 20 ms


def _as_bytes(value: str | bytes) -> bytes:
    """Values are bytes; Python callers may pass str, as torch's own stores accept."""
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """Keys under `prefix` in etcd (the job's prefix + "store/")."""

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _retry(self, what: str, attempt: Callable[[], T | None], timeout: timedelta | None = None) -> T:
        """Repeat `attempt` until it returns something other than None, or time out.

        etcd errors count as "not yet" (etcd may be restarting or electing a leader),
        except refused credentials, which no amount of waiting fixes, and an etcd gone
        longer than the client's outage bound (EtcdGone). A zero timeout waits forever,
        as torch's kNoTimeout does.
        """
        limit = (self.timeout if timeout is None else timeout).total_seconds()
        bound = limit if limit > 0 else math.inf
        last_error = ""

        def not_yet(exc: BaseException) -> bool:
            nonlocal last_error
            if isinstance(exc, EtcdAuthError) or not isinstance(exc, EtcdError):
                return False
            self._client.check_reachable()
            last_error = f"; last etcd error: {exc}"
            return True

        def timed_out(retry_state: RetryCallState) -> NoReturn:
            raise dist.DistStoreError(
                f"etcd store {self._prefix!r} at {self._client.endpoint}: {what} timed out after {limit:g} s{last_error}"
            )

        return Retrying(
            retry=retry_if_result(lambda result: result is None) | retry_if_exception(not_yet),
            stop=stop_after_delay(bound),
            # the last sleep ends at the deadline, for one more attempt there
            wait=lambda retry_state: min(_BACKOFF(retry_state), bound - retry_state.seconds_since_start),
            retry_error_callback=timed_out,
        )(attempt)

    def _replace(self, key: str, mod_revision: int, value: bytes) -> bool:
        """Write `value` if the key is unchanged since `mod_revision` (0: still absent)."""
        return self._client.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, value)]).succeeded

    # -- the Store API -----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        k, v = self._key(key), _as_bytes(value)

        def put() -> bool:
            self._client.put(k, v)
            return True

        self._retry(f"set {key!r}", put)

    def get(self, key: str) -> bytes:
        """The key's value, once it exists (blocks up to the store's timeout)."""
        kv = self._retry(f"get {key!r}", lambda: self._client.get(self._key(key)))
        return kv.value

    def add(self, key: str, amount: int) -> int:
        """Add to a counter kept as decimal ASCII (absent or empty counts as 0, as in
        HashStore); return the new total."""
        k = self._key(key)

        def attempt() -> int | None:
            kv = self._client.get(k)
            try:
                total = int(kv.value if kv is not None and kv.value else 0) + amount
            except ValueError:
                raise ValueError(f"etcd store key {k!r} holds {kv.value[:40]!r}, not a decimal counter; cannot add to it") from None
            return total if self._replace(k, kv.mod_revision if kv is not None else 0, str(total).encode()) else None

        return self._retry(f"add to {key!r}", attempt)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's semantics: set `desired` if the value is `expected` (or the key is
        absent and `expected` is empty); return the value the key has afterwards, or
        `expected` when the key is absent and `expected` is not empty."""
        k, expected, desired = self._key(key), _as_bytes(expected), _as_bytes(desired)

        def attempt() -> bytes | None:
            kv = self._client.get(k)
            if kv is None and expected:
                return expected
            if kv is not None and kv.value != expected:
                return kv.value
            return desired if self._replace(k, kv.mod_revision if kv is not None else 0, desired) else None

        return self._retry(f"compare-and-set {key!r}", attempt)

    def _all_exist(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, up to `timeout` (default: the store's)."""
        self._retry(f"wait for {keys!r}", lambda: self._all_exist(keys) or None, timeout)

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists now."""
        return self._retry(f"check {keys!r}", lambda: self._all_exist(keys))

    def delete_key(self, key: str) -> bool:
        return self._retry(f"delete {key!r}", lambda: self._client.delete(self._key(key)) > 0)

    def num_keys(self) -> int:
        return self._retry("count keys", lambda: len(self._client.get_prefix(self._prefix)))

    deleteKey = delete_key  # the names torch's C++ trampoline looks up (see module docstring)
    getNumKeys = num_keys

    def delete_prefix(self, sub: str) -> int:
        """Drop every key under `sub` (a finished generation's, e.g. "parcae/g3/"); return how many."""
        return self._retry(f"delete {sub!r}*", lambda: self._client.delete(self._key(sub), prefix=True))
