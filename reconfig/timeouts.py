"""How long a collective may wait for its peers, by what it waits for.

Liveness is not a collective's business: a worker that dies is noticed through its etcd
lease, which stays short, and the process groups of a layout it leaves behind are
aborted (reconfig.world.World.watch). A collective's timeout only has to outlast the
slowest healthy peer, and that depends on what the peers are doing:

- a running layout's step: one lease period (`World.collective_timeout`);
- a layout's first step: compiled kernels, NCCL communicators formed at their first use,
  a first snapshot pinning host memory; minutes (`--parcae-first-step-timeout`);
- an exchange of state (a migration's, a snapshot copy's, a recovery's): its bytes over
  the link's rate, with a margin (`exchange_timeout`);
- a checkpoint: the slowest writer (megatron_parcae.training.device.SAVE_TIMEOUT).

reconfig.world.patient gives a group the longer timeout for the length of a block.
"""

from __future__ import annotations

from datetime import timedelta

# A transfer waits for its peers to post theirs and, on NCCL, for the pair's communicator
# to form before its first byte moves; and a link's measured rate is a best case.
EXCHANGE_FLOOR = timedelta(minutes=1)
EXCHANGE_MARGIN = 4.0


def exchange_timeout(nbytes: int, bytes_per_second: float, margin: float = EXCHANGE_MARGIN,
                     floor: timedelta = EXCHANGE_FLOOR) -> timedelta:
    """How long the collectives of an exchange of `nbytes` (the most any one worker sends
    or receives in it) may wait, over a link of `bytes_per_second` (measured, or the
    profile's): `margin` times the transfer's time, at least `floor`."""
    if nbytes < 0:
        raise ValueError(f"an exchange cannot move {nbytes} bytes")
    if not bytes_per_second > 0:
        raise ValueError(f"a link's rate must be positive, got {bytes_per_second} bytes/s")
    if not margin >= 1:
        raise ValueError(f"the margin must be at least 1, got {margin}")
    return max(floor, timedelta(seconds=margin * nbytes / bytes_per_second))
