#!/usr/bin/env bash
# The main job: GPT-tiny trains on real text (the Python documentation) while 24 minutes
# of the real aws-p3 spot trace (hours 0.85-1.25, scaled to 6 instances: preemptions in
# minutes 2-8, arrivals in minutes 10-20) are replayed with real processes, SIGTERM and
# SIGKILL. First with --parcae (real etcd, `parcae coordinator`, one worker per instance;
# no profile: the coordinator starts from `parcae profile --analytic` and learns the
# layouts' step times as they run), then with the checkpoint-restart baseline users run
# today; both summaries side by side, each against the ideal (every change free), the
# samples ratio, a timeline in replay/timeline.png and everything in replay/summary.json.
# The trace runs 6x faster than the wall clock, a restart does not: a checkpoint-restart
# restart takes 6-8 s on 2 cores, 36-48 trace seconds, 0.6-0.8 of the 60 s planning
# interval, about as on a real cluster (Parcae measured 29-43 s restarts). At 20x: 2-3.
# AWS's 120 s notice is 20 s at 6x. Two replays of 240 s each: about 9 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/parcae replay --trace traces/aws-p3/p3-trace.csv --start-hour 0.85 --end-hour 1.25 \
  --max-instances 6 --speedup 6 --grace-seconds 20 \
  --baseline checkpoint-restart --workdir replay --json replay/summary.json --plot replay/timeline.png \
  -- scripts/pretrain_gpt.py --config configs/gpt-tiny.yaml --train-iters 100000 "$@"
