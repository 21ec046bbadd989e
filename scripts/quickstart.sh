#!/usr/bin/env bash
# The main job: GPT-tiny on real text (the Python documentation), 4 CPU processes,
# tensor x pipeline parallel 2 x 2, with megatron-core's real model and schedules.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 scripts/pretrain_gpt.py \
  --config configs/gpt-tiny.yaml --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --train-iters 50 "$@"
