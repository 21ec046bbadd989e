"""`--parcae-layout-schedule`: layout changes at fixed iterations, without a coordinator.

The standalone driver for users, tests and benchmarks. The text
``"ITER:T,P,D[:leave=W1,W2][:join=K];..."`` means: once ITER iterations are done, move
the job to T x P x D; workers W1, W2 leave with notice (they send their state, then
exit) and K new workers join. Workers are named by their torchrun rank (their id for
the whole run); joining workers are the highest torchrun ranks, started with the job and
idle until their change. Every process derives the same plans from the same text, so
no process has to tell another what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reconfig.layout import Layout, ModelShape, Parallelism
from reconfig.plan import MigrationPlan, MigrationRequest, plan_migration

_ENTRY = re.compile(r"^(\d+):(\d+),(\d+),(\d+)((?::(?:leave=\d+(?:,\d+)*|join=\d+))*)$")


@dataclass(frozen=True)
class LayoutChange:
    """One entry of the schedule."""

    iteration: int
    tp: int
    pp: int
    dp: int
    leave: tuple[int, ...] = ()
    join: int = 0


@dataclass(frozen=True)
class ScheduledMigration:
    """A change turned into a plan: generation `generation` starts after `iteration` steps."""

    generation: int
    iteration: int
    plan: MigrationPlan


def parse_layout_schedule(text: str) -> tuple[LayoutChange, ...]:
    """Parse the schedule; ValueError names the bad entry and says what is wrong."""
    changes: list[LayoutChange] = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        match = _ENTRY.match(entry)
        if not match:
            raise ValueError(f"entry {entry!r}: expected ITER:T,P,D[:leave=W1,W2][:join=K]")
        iteration, tp, pp, dp = (int(match.group(i)) for i in range(1, 5))
        leave: tuple[int, ...] = ()
        join = 0
        for option in filter(None, match.group(5).split(":")):
            key, value = option.split("=")
            if key == "leave":
                if leave:
                    raise ValueError(f"entry {entry!r}: leave= given twice")
                leave = tuple(int(w) for w in value.split(","))
                if len(set(leave)) != len(leave):
                    raise ValueError(f"entry {entry!r}: a worker leaves twice")
            else:
                join += int(value)
        if iteration < 1:
            raise ValueError(f"entry {entry!r}: changes come after at least one iteration (the job starts in "
                             "the layout its flags give)")
        if min(tp, pp, dp) < 1:
            raise ValueError(f"entry {entry!r}: T, P and D must be positive")
        if changes and iteration <= changes[-1].iteration:
            raise ValueError(f"entry {entry!r}: iterations must increase (previous {changes[-1].iteration})")
        changes.append(LayoutChange(iteration, tp, pp, dp, leave, join))
    if not changes:
        raise ValueError("no layout change given")
    return tuple(changes)


def joining_workers(changes: tuple[LayoutChange, ...]) -> int:
    """Processes the job starts idle, to join later."""
    return sum(c.join for c in changes)


def plan_schedule(changes: tuple[LayoutChange, ...], initial: Parallelism, total_workers: int,
                  shape: ModelShape, distributed_optimizer: bool) -> list[ScheduledMigration]:
    """The migration plan of every change, in order; ValueError names an impossible change.

    Workers 0..initial.world_size-1 start in rank order; the next ids join in order.
    Workers a plan leaves on standby hold nothing and join again at a later change.
    """
    layout = Layout(initial, tuple(range(initial.world_size)))
    next_fresh = initial.world_size
    standby: frozenset[int] = frozenset()
    out: list[ScheduledMigration] = []
    for generation, change in enumerate(changes, start=1):
        where = f"change at iteration {change.iteration}"
        stray = sorted(set(change.leave) - layout.workers)
        if stray:
            raise ValueError(f"{where}: worker(s) {stray} cannot leave, they hold no slot")
        if next_fresh + change.join > total_workers:
            raise ValueError(f"{where}: {change.join} worker(s) join, but only {total_workers - next_fresh} "
                             f"idle process(es) remain (start the job with more processes)")
        fresh = frozenset(range(next_fresh, next_fresh + change.join))
        next_fresh += change.join
        request = MigrationRequest(layout, layout.workers - set(change.leave), frozenset(change.leave),
                                   standby | fresh, distributed_optimizer)
        try:
            target = Parallelism.even(shape.num_layers, change.tp, change.pp, change.dp)
            plan = plan_migration(request, target, shape)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        out.append(ScheduledMigration(generation, change.iteration, plan))
        layout, standby = plan.new, plan.standby
    return out
