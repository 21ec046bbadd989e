"""Coordinator leadership: one lease-backed key per job; only its holder may act.

A coordinator started by mistake, or restarted while the old one is stalled, must never
act alongside the leader. Holding the key is not enough (the holder may have stalled and
lost it without noticing yet), so every write a leader makes should be a transaction
guarded by `guard()`: it succeeds only while the leader key is still on this
coordinator's lease.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from megatron_parcae.control.etcd.client import Compare, EtcdClient, EtcdError, EtcdUnavailable, KeptLease, Put
from megatron_parcae.control.etcd.keys import JobKeys, LeaderRecord

log = logging.getLogger(__name__)


class NotLeader(EtcdError):
    """An action that needs the leader lease was attempted without it."""


class Leadership:
    """Campaign for, hold, and give up the leader lease of one job.

    Use as a context manager so the lease is revoked (and a standby takes over at once)
    when the coordinator exits; if it dies instead, the lease expires after
    `lease_seconds` and a standby takes over then.
    """

    def __init__(self, client: EtcdClient, job: str, candidate: str, lease_seconds: float) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"leader lease must be positive, got {lease_seconds}")
        self._client = client
        self._key = JobKeys(job).leader
        self.candidate = candidate
        self.lease_seconds = lease_seconds
        self._lease: KeptLease | None = None

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds the lease (checked with etcd when overdue)."""
        return self._lease is not None and not self._lease.lost

    def try_acquire(self) -> bool:
        """Take the leader key if nobody holds it; never waits."""
        if self.is_leader:
            return True
        if self._client.get(self._key) is not None:
            return False
        lease = KeptLease(self._client, self.lease_seconds)
        record = LeaderRecord(self.candidate, os.getpid(), time.time())
        if self._client.txn([Compare(self._key, "version", "==", 0)], [Put(self._key, record.encode(), lease.id)]).succeeded:
            self._lease = lease
            log.info("%s is now the leader (lease %x)", self.candidate, lease.id)
            return True
        lease.revoke()
        return False

    def wait_until_leader(self, stop: threading.Event | None = None) -> bool:
        """Block while another candidate holds the lease; True once this one does.

        Wakes on every change of the leader key, so a resignation is taken over at once
        and an expired lease within moments of etcd deleting the key. Returns False if
        `stop` is set first.
        """
        changed = threading.Event()
        watch = self._client.watch(self._key, lambda events: changed.set())
        try:
            while stop is None or not stop.is_set():
                changed.clear()
                try:
                    if self.try_acquire():
                        return True
                except EtcdUnavailable as exc:
                    self._client.check_reachable()
                    log.warning("%s: cannot campaign for leadership yet: %s", self.candidate, exc)
                changed.wait(timeout=min(1.0, self.lease_seconds / 3))
            return False
        finally:
            watch.stop()

    def guard(self) -> list[Compare]:
        """Transaction conditions that hold only while this candidate is the leader."""
        if not self.is_leader or self._lease is None:
            raise NotLeader(f"{self.candidate} does not hold the leader lease of {self._key}")
        return [Compare(self._key, "lease", "==", self._lease.id)]

    def resign(self) -> None:
        """Give up the lease (deleting the leader key) so a standby takes over now."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()

    def __enter__(self) -> "Leadership":
        return self

    def __exit__(self, *exc_info) -> None:
        self.resign()
