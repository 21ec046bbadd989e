"""Memory through each kind of layout change: GPT-tiny on 4 processes, every kind of
change in one schedule, with plain and with distributed Adam; the figures are rank 0's
`layout_change` events (device peak beside the old and new steady state, host copies
beside one copy of the worker's state; on CPU, the executor's own counts).

    python -m benchmarks.change_memory [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_parcae.events import LayoutChange, read_events

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--log-interval", "1", "--pipeline-model-parallel-size", "2",
         "--train-iters", "12", "--parcae"]
SCHEDULE = "3:2,2,1;5:1,4,1;7:1,2,2;9:1,2,1:leave=1,3"


def run(distributed: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="parcae-change-memory-") as tmp:
        events = Path(tmp) / "events.jsonl"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   str(REPO / "scripts" / "pretrain_gpt.py"), *MODEL, "--parcae-layout-schedule", SCHEDULE,
                   "--parcae-events", str(events), *(["--use-distributed-optimizer"] if distributed else [])]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": tmp})
        return [{"optimizer": "distributed" if distributed else "plain", "kind": e.kind,
                 "layout": f"T{e.tp}P{e.pp}D{e.dp}", "steady_mib": e.steady_device_peak_mib,
                 "new_mib": e.new_device_mib, "device_peak_mib": e.device_peak_mib, "host_peak_mib": e.host_peak_mib,
                 "state_mib": e.state_mib} for e in read_events(events) if isinstance(e, LayoutChange)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    rows = run(False) + run(True)
    print(f"{'optimizer':<12}{'kind':<13}{'to':<9}{'before':>8}{'after':>8}{'device':>8}{'host':>8}{'state':>8}"
          f"{'host/state':>12}  (MiB)")
    for r in rows:
        print(f"{r['optimizer']:<12}{r['kind']:<13}{r['layout']:<9}{r['steady_mib']:>8.3f}{r['new_mib']:>8.3f}"
              f"{r['device_peak_mib']:>8.3f}{r['host_peak_mib']:>8.3f}{r['state_mib']:>8.3f}"
              f"{r['host_peak_mib'] / r['state_mib']:>12.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
