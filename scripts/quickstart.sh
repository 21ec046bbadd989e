#!/usr/bin/env bash
# The main job: GPT-tiny trains on real text (the Python documentation) while one hour of
# the real aws-p3 spot trace (hours 0.5-1.5, its busiest: 6 preemptions, 5 arrivals when
# scaled to 6 instances) is replayed 20x faster with real processes, SIGTERM and SIGKILL.
# First with --parcae (real etcd, `parcae coordinator`, one worker per instance), then
# with the checkpoint-restart baseline users run today; both summaries side by side, the
# samples ratio, a timeline in replay/timeline.png and everything in replay/summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/parcae replay --trace traces/aws-p3/p3-trace.csv --start-hour 0.5 --end-hour 1.5 \
  --max-instances 6 --speedup 20 --grace-seconds 10 --profile configs/profiles/gpt-tiny-cpu.json \
  --baseline checkpoint-restart --workdir replay --json replay/summary.json --plot replay/timeline.png \
  -- scripts/pretrain_gpt.py --config configs/gpt-tiny.yaml --train-iters 100000 "$@"
