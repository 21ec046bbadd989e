#!/usr/bin/env bash
# The prepared check for a machine with one GPU, no network and its own torch (issue 35).
#
#   bash scripts/gpu_check.sh [--dry-run] [--tiny] [--only LETTERS] [--wheels DIR] [--results DIR]
#
# From the repository root's copy. The wheels megatron-parcae needs beside that torch, and
# an etcd binary, come from DIR (default gpu-wheels/, or $PARCAE_GPU_WHEELS), which
# scripts/gpu_wheels.sh fills on a machine with network; they are installed offline into
# a folder of their own. Then:
#   (a) same-layout rebuilds (--parcae-layout-schedule "3:1,1,1;6:1,1,1") of GPT-1.5B cut to
#       16 layers: the device peak before, during and after each; losses equal to a run without;
#   (b) fp16 with --use-distributed-optimizer through a change: losses and loss scales equal
#       to the uninterrupted run's;
#   (c) two processes on the one GPU (PARCAE_ONE_GPU=1): a data-parallel change, losses
#       equal to one process's; then a chaos run with the distributed optimizer, whose lost
#       moment shards come back from the workers' snapshots (a rollback);
#   (d) a snapshot's cost per iteration at K=10 on GPT-1.5B cut to 16 layers;
#   (e) that model's tokens/s and MFU beside plain PyTorch of the same shape, with a
#       torch.profiler top 10 of kernels (benchmarks/gpu_speed.py).
# Writes RESULTS/gpu_check_<gpu>.txt (default RESULTS: benchmarks/results): each command,
# its exit code and seconds, and what it concluded; the full logs, events and JSON in
# RESULTS/gpu_check_<gpu>/. A step that fails is recorded and the next runs; the exit code
# is 1 when any failed. --dry-run prints every command and runs none; --tiny runs the same
# checks on GPT-tiny (a quick trial, also on CPU); --only runs the checks named (--only c:
# (c) alone, its results in RESULTS/gpu_check_<gpu>-c.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
TINY=0
ONLY=abcde
WHEELS=${PARCAE_GPU_WHEELS:-gpu-wheels}
RESULTS=benchmarks/results
PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --tiny) TINY=1 ;;
    --only) ONLY=${2:?--only needs letters from abcde}; shift ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
    --results) RESULTS=${2:?--results needs a folder}; shift ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ ! "$ONLY" =~ ^[a-e]+$ ]]; then
  echo "gpu_check.sh: error: --only takes letters from abcde, not $ONLY" >&2
  exit 2
fi
wanted() { [[ "$ONLY" == *"$1"* ]]; }

gpu_name() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1
  fi
}

slug() {
  case "$1" in
    *H200*) echo h200 ;;
    *H100*) echo h100 ;;
    "") echo cpu ;;
    *) echo "$1" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/-$//' ;;
  esac
}

NAME=$(slug "$(gpu_name)")
[ "$TINY" = 1 ] && NAME="$NAME-tiny"
[ "$ONLY" = abcde ] || NAME="$NAME-$ONLY"
SUMMARY="$RESULTS/gpu_check_$NAME.txt"
LOGS="$RESULTS/gpu_check_$NAME"
SITE=${TMPDIR:-/tmp}/parcae-gpu-site
TORCHRUN=("$PY" -m torch.distributed.run --standalone)
FAILED=0
STARTED=$(date +%s)

say() {
  if [ "$DRY_RUN" = 1 ]; then echo "$*"; else echo "$*" | tee -a "$SUMMARY"; fi
}

# step NAME LIMIT_S CMD...: run CMD, its output in LOGS/NAME.log; the summary gets the
# command, exit code, seconds and the output lines that matter (all of a report's).
step() {
  local name=$1 limit=$2 start rc
  shift 2
  say "\$ $(printf '%q ' "$@")"
  [ "$DRY_RUN" = 1 ] && return 0
  start=$(date +%s)
  set +e
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  set -e
  if [[ "$name" == *report* || "$name" == *speed* || "$name" == *snapshot* ]]; then
    grep -v -i -E "warn|^\s*$|path_to_cache" "$LOGS/$name.log" | tail -n 40 | tee -a "$SUMMARY" || true
  else
    grep -E "layout change at|recover|rolled|Error|error:" "$LOGS/$name.log" | grep -v -i warn | tail -n 12 \
      | tee -a "$SUMMARY" || true
  fi
  say "rc=$rc seconds=$(($(date +%s) - start))"
  [ "$rc" = 0 ] || FAILED=1
}

if [ "$DRY_RUN" = 0 ]; then
  mkdir -p "$LOGS"
  : >"$SUMMARY"
fi

say "# gpu_check.sh (issue 35) on $(gpu_name || true), $(date -u +%Y-%m-%dT%H:%MZ)"
say "# commit: ${PARCAE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; $("$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__)' 2>/dev/null || echo "torch missing")"

say "## set-up: the wheels beside this torch, offline; the tiny datasets"
if [ "$DRY_RUN" = 1 ] || ! "$PY" -c "import megatron.core, tenacity, google.protobuf, grpc, prophet" 2>/dev/null; then
  step install 300 "$PY" -m pip install --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "$WHEELS" in /*) export PATH="$WHEELS/etcd:$PATH" ;; *) export PATH="$PWD/$WHEELS/etcd:$PATH" ;; esac
if [ "$DRY_RUN" = 1 ] || [ ! -f data/parcae-tiny-data.json ]; then
  step data 300 "$PY" -m megatron_parcae.training.data.corpus data
fi

if [ "$TINY" = 1 ]; then
  BIG=(--config configs/gpt-tiny.yaml --log-interval 1)
  HALF=(--config configs/gpt-tiny.yaml --log-interval 1 --fp16)
else
  BIG=(--config configs/gpt-1.5b.yaml --bf16 --mock-data --vocab-size 50257 --num-layers 16 --micro-batch-size 4
       --global-batch-size 16 --lr-warmup-iters 2 --log-interval 1)
  HALF=(--config configs/gpt-1.5b.yaml --fp16 --mock-data --vocab-size 50257 --num-layers 4 --micro-batch-size 4
        --global-batch-size 16 --lr-warmup-iters 2 --log-interval 1)
fi
TINY_FLAGS=(--config configs/gpt-tiny.yaml --log-interval 1 --train-iters 12)

if wanted a; then
say "## (a) same-layout rebuilds of ${BIG[*]}: device peaks, losses as without them"
step a_reference 240 "${TORCHRUN[@]}" --nproc_per_node=1 scripts/pretrain_gpt.py "${BIG[@]}" --train-iters 9 \
  --parcae-events "$LOGS/a_reference.events.jsonl"
step a_rebuilds 300 "${TORCHRUN[@]}" --nproc_per_node=1 -m benchmarks.memory_trace "$LOGS/a_memory.jsonl" \
  scripts/pretrain_gpt.py "${BIG[@]}" --train-iters 9 --parcae --parcae-layout-schedule "3:1,1,1;6:1,1,1" \
  --parcae-events "$LOGS/a_rebuilds.events.jsonl"
step a_report_losses 60 "$PY" -m benchmarks.gpu_check_report losses "$LOGS/a_reference.events.jsonl" \
  "$LOGS/a_rebuilds.events.jsonl"
step a_report_peaks 60 "$PY" -m benchmarks.gpu_check_report changes "$LOGS/a_rebuilds.events.jsonl" \
  --memory "$LOGS/a_memory.jsonl"
fi

if wanted b; then
say "## (b) fp16 with the distributed optimizer through a change: losses and loss scales as uninterrupted"
step b_reference 180 "${TORCHRUN[@]}" --nproc_per_node=1 scripts/pretrain_gpt.py "${HALF[@]}" \
  --use-distributed-optimizer --train-iters 10 --parcae-events "$LOGS/b_reference.events.jsonl"
step b_changed 180 "${TORCHRUN[@]}" --nproc_per_node=1 scripts/pretrain_gpt.py "${HALF[@]}" \
  --use-distributed-optimizer --train-iters 10 --parcae --parcae-layout-schedule "5:1,1,1" \
  --parcae-events "$LOGS/b_changed.events.jsonl"
step b_report_losses 60 "$PY" -m benchmarks.gpu_check_report losses "$LOGS/b_reference.events.jsonl" \
  "$LOGS/b_changed.events.jsonl" --loss-scale
fi

if wanted c; then
say "## (c) two processes on one GPU (PARCAE_ONE_GPU=1): a data-parallel change, then a snapshot rollback"
step c_reference 120 "${TORCHRUN[@]}" --nproc_per_node=1 scripts/pretrain_gpt.py "${TINY_FLAGS[@]}" \
  --parcae-events "$LOGS/c_reference.events.jsonl"
step c_one_gpu 180 env PARCAE_ONE_GPU=1 "${TORCHRUN[@]}" --nproc_per_node=2 scripts/pretrain_gpt.py \
  "${TINY_FLAGS[@]}" --parcae --parcae-layout-schedule "4:1,1,2:join=1;8:1,1,1:leave=1" \
  --parcae-events "$LOGS/c_one_gpu.events.jsonl"
step c_report_losses 60 "$PY" -m benchmarks.gpu_check_report losses "$LOGS/c_reference.events.jsonl" \
  "$LOGS/c_one_gpu.events.jsonl"
step c_chaos 300 env PARCAE_ONE_GPU=1 "$PY" -m benchmarks.chaos --runs 1 --kills 1 --iterations 20 --first-kill-at 8 \
  --save-interval 10 --copy-interval 5 --optimizer distributed --workdir "$LOGS/c_chaos" --json "$LOGS/c_chaos.json"
step c_report_rollback 60 "$PY" -m benchmarks.gpu_check_report rollback "$LOGS/c_chaos.json"
fi

if wanted d; then
say "## (d) a snapshot every K=10 steps: its cost per iteration"
step d_snapshot 240 "$PY" -m benchmarks.snapshot_cost --copy-interval 10 --json "$LOGS/d_snapshot.json" -- "${BIG[@]}"
fi

if wanted e; then
say "## (e) tokens/s and MFU beside plain PyTorch (scaled_dot_product_attention), top 10 kernels"
step e_speed 300 "$PY" -m benchmarks.gpu_speed --steps 8 --warmup 3 --json "$LOGS/e_speed.json" -- "${BIG[@]}"
fi

say "# done in $(($(date +%s) - STARTED)) s; $([ "$FAILED" = 0 ] && echo "every step passed" || echo "a step FAILED")"
exit "$FAILED"
