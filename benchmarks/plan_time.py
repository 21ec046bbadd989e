"""Time migration planning at 1,024 ranks (issue 3, acceptance 4: under 1 s).

GPT-1.5B-like shape (48 layers, hidden 1600, 32 heads so T can be 1..8). Each scenario
is planned `--repeats` times in this process; the first (cold) and median wall times are
printed with the plan's size. Exits 1 if any single plan took 1 s or more.

    python -m benchmarks.plan_time [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from reconfig.layout import Layout, ModelShape, Parallelism
from reconfig.plan import MigrationRequest, plan_migration

GPT_1_5B = ModelShape("gpt", num_layers=48, hidden_size=1600, num_attention_heads=32, ffn_hidden_size=6400,
                      vocab_size=50304, max_position_embeddings=1024)
LIMIT_S = 1.0


def request(old: Parallelism, lose: int = 0, leave: int = 0, join: int = 0, distributed_optimizer: bool = False,
            seed: int = 0) -> MigrationRequest:
    """Old layout on workers 0..N-1; `lose` die without notice, `leave` with notice; one per column
    at most, so no state is lost."""
    rng = random.Random(seed)
    layout = Layout(old, tuple(range(old.world_size)))
    columns = list(range(old.pp * old.tp))
    rng.shuffle(columns)
    victims = []
    for column in columns[:lose + leave]:  # one worker of a distinct (stage, tp) column each
        stage, tp = divmod(column, old.tp)
        victims.append(layout.slots[tp + old.tp * old.dp * stage])
    lost, leaving = set(victims[:lose]), frozenset(victims[lose:])
    survivors = frozenset(layout.slots) - lost - leaving
    joining = frozenset(range(old.world_size, old.world_size + join))
    return MigrationRequest(layout, survivors, leaving, joining, distributed_optimizer)


def scenarios() -> list[tuple[str, MigrationRequest, Parallelism]]:
    even = lambda t, p, d: Parallelism.even(48, t, p, d)  # noqa: E731
    p32 = lambda t, d: Parallelism(t, 32, d, (9,) + (1,) * 30 + (9,))  # noqa: E731  (48 layers: uneven only)
    return [
        ("intra-stage: 8 of 1024 lost, D 16->15", request(even(4, 16, 16), lose=8), even(4, 16, 15)),
        ("inter-stage: 8 leave, 8 join, same layout", request(even(4, 16, 16), leave=8, join=8), even(4, 16, 16)),
        ("growth: 512 -> 1024 ranks (512 join)", request(even(4, 16, 8), join=512), even(4, 16, 16)),
        ("pipeline: P 16 -> 24, 4 lost", request(even(4, 16, 16), lose=4), even(4, 24, 8)),
        ("pipeline: P 16 -> 32 (9, 1 x 30, 9)", request(even(4, 16, 16)), p32(4, 8)),
        ("tensor: T 8 -> 4, P 32 -> 16", request(p32(8, 4)), even(4, 16, 16)),
        ("tensor: T 1 -> 8, P 32 -> 16, 8 leave, 8 join", request(p32(1, 32), leave=8, join=8), even(8, 16, 8)),
        ("pipeline, distributed optimizer: P 16 -> 32, 16 leave",
         request(even(4, 16, 16), leave=16, distributed_optimizer=True), p32(4, 7)),
        ("tensor, distributed optimizer: T 2 -> 4, 512 join",
         request(even(2, 16, 16), join=512, distributed_optimizer=True), even(4, 16, 16)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="plans per scenario (default 3)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    worst = 0.0
    print(f"{'scenario':55} {'kind':12} {'ranks':>5} {'transfers':>9} {'GB moved':>9} {'first s':>7} "
          f"{'median s':>8}")
    for name, migration, target in scenarios():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = plan_migration(migration, target, GPT_1_5B)
            times.append(time.perf_counter() - start)
        worst = max(worst, *times)
        print(f"{name:55} {plan.kind:12} {target.world_size:5} {len(plan.transfers):9} "
              f"{plan.bytes_total() / 1e9:9.2f} {times[0]:7.3f} {statistics.median(times):8.3f}")
    print(f"slowest plan: {worst:.3f} s (limit {LIMIT_S} s): {'ok' if worst < LIMIT_S else 'TOO SLOW'}")
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    sys.exit(main())
