"""What a training process's start costs in CPU time, with the cyclic collector paused
while torch and megatron-core are imported and training is set up (as
scripts/pretrain_*.py do) and without.

Every worker that joins a live job, every restart and every process the tests start
pays for these imports. The runs alternate one by one (a shared machine's drift falls on
both alike): scripts/pretrain_gpt.py trains the tests' GPT for two iterations on one
process, as is, or with `gc.disable` made a no-op so that the collector runs throughout.
CPU time (user + system, the process and its children) and wall time per run, medians.

    python -m benchmarks.startup [--rounds 10] [--out benchmarks/results/startup_cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import provenance

REPO = Path(__file__).resolve().parents[1]
ARGV = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2", "--log-interval", "1"]
# The script as python runs it, from a wrapper that both arms share.
RUN_SCRIPT = ("import runpy, sys\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
COLLECTOR_ON = "import gc\ngc.disable = lambda: None\n"
ARMS = {"collector paused": RUN_SCRIPT, "collector on": COLLECTOR_ON + RUN_SCRIPT}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one training process started with `code`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts" / "pretrain_gpt.py"), *ARGV], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the training process exited {done.returncode}:\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/startup_cpu", help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    runs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for i in range(args.rounds):
        for arm, code in (ARMS.items() if i % 2 == 0 else reversed(ARMS.items())):
            runs[arm].append(run_once(code))
        print(f"startup: round {i + 1}/{args.rounds}: " + ", ".join(
            f"{arm} {runs[arm][-1][0]:.2f} s CPU" for arm in ARMS), file=sys.stderr, flush=True)
    rows = {arm: {"cpu_seconds": round(statistics.median(c for c, _ in r), 3),
                  "wall_seconds": round(statistics.median(w for _, w in r), 3),
                  "cpu_seconds_each": [round(c, 3) for c, _ in r]} for arm, r in runs.items()}
    paused, on = rows["collector paused"], rows["collector on"]
    saved = 1 - paused["cpu_seconds"] / on["cpu_seconds"]
    command = " ".join(["python -m benchmarks.startup", *argv])
    result = {"command": command, "commit": provenance.commit(), "cpu_cores": os.cpu_count(), "rounds": args.rounds,
              "runs": rows, "cpu_saved_percent": round(saved * 100, 1)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# command: {command}", f"# commit: {result['commit']}",
             f"# {os.cpu_count()} CPU cores, OMP_NUM_THREADS=1; scripts/pretrain_gpt.py, the tests' GPT, 2 iterations "
             f"on one process; {args.rounds} rounds, the two alternating; medians", ""]
    lines += [f"{arm}: {r['cpu_seconds']:.2f} s CPU, {r['wall_seconds']:.2f} s wall" for arm, r in rows.items()]
    lines.append(f"pausing the collector through imports and set-up saves {saved:.1%} of the process's CPU time")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
