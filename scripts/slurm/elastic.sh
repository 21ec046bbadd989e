# shellcheck shell=bash
# What control.sbatch and elastic-worker.sbatch run: the elastic mode (README.md beside this
# file), in which every instance is its own element of a job array, so that SLURM preempts
# and requeues instances one by one while the job moves in place to the ones left.
#
#   parcae_control_run REPO           etcd (unless PARCAE_ETCD names one) and the coordinator,
#                                     on a partition that is never preempted
#   parcae_element_run REPO FLAGS...  one instance: its workers through srun; then it stays
#                                     up until a preemption's grace time is over
#
# They meet in $PARCAE_RUN_DIR/control-CONTROL_JOB_ID/ (a shared file system): the control
# job writes `etcd-endpoint` (HOST:PORT) once etcd serves and `done` once training has
# ended. `parcae slurm submit` fills in the PARCAE_* variables; the table is in README.md.

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

readonly CONTROL_WAIT_SECONDS=600 # an element waits this long for the control job's etcd
readonly ELEMENTS_END_SECONDS=120 # once training has ended, the elements have this long to end
# slurmctld finds ended grace times on a 30 s timer and kills KillWait later: an element
# whose workers left waits out its grace time plus this before it gives up on a requeue.
readonly GRACE_SLACK_SECONDS=60
readonly POLL_SECONDS=1

control_dir=""
etcd_data=""
terminated=0

require_env() { # NAME WHAT
  [[ -n ${!1:-} ]] || die "$1 is not set: $2 (parcae slurm submit sets it)"
}

require_slurm_job() {
  [[ -n ${SLURM_JOB_ID:-} ]] || die "not in a SLURM job (SLURM_JOB_ID is unset): submit with parcae slurm submit or sbatch"
  require_count SLURM_JOB_ID "$SLURM_JOB_ID"
}

# A port P with P and P+1 free on this host (etcd's client and peer ports).
free_port_pair() { # PYTHON
  "$1" -c '
import socket
for _ in range(100):
    with socket.socket() as a:
        a.bind(("", 0))
        port = a.getsockname()[1]
        try:
            with socket.socket() as b:
                b.bind(("", port + 1))
        except OSError:
            continue
    print(port)
    break
else:
    raise SystemExit("no two free ports in a row")
' || die "found no free ports for etcd: set PARCAE_ETCD_PORT"
}

# -- the control job ---------------------------------------------------------------------

# The other jobs of this name and user: the worker array (one id for all its elements).
other_jobs() {
  [[ -n ${SLURM_JOB_NAME:-} ]] || return 0
  squeue -h -u "$(id -un)" -n "$SLURM_JOB_NAME" -o %F | sort -u | grep -vx "$SLURM_JOB_ID" || true
}

cancel_elements() {
  local jobs
  jobs=$(other_jobs) || return 0
  [[ -z $jobs ]] && return 0
  note "cancelling the job's elements: $(echo "$jobs" | tr '\n' ' ')"
  # shellcheck disable=SC2086 # one word per job id
  scancel $jobs || note "scancel $jobs failed"
}

control_cleanup() {
  local status=$?
  trap '' TERM INT
  # First: after scancel, SLURM's SIGKILL comes KillWait seconds later, maybe mid-cleanup.
  [[ -z $etcd_data ]] || rm -rf "$etcd_data"
  if ! dry_run; then
    [[ -z $control_dir ]] || rm -f "$control_dir/etcd-endpoint"
    # Training did not end: the elements would wait for an etcd that is gone.
    [[ -n $control_dir && -e $control_dir/done ]] || cancel_elements
  fi
  stop_process "$coordinator_pid" "$SERVICE_STOP_SECONDS" "the coordinator"
  stop_process "$etcd_pid" "$SERVICE_STOP_SECONDS" "etcd"
  exit "$status"
}

# Training has ended: pending elements have nothing left to do, running ones end by
# themselves (their workers see the end in etcd, which keeps serving until then).
finish_elements() {
  [[ -n ${SLURM_JOB_NAME:-} ]] || return 0
  scancel --state=PENDING -u "$(id -un)" -n "$SLURM_JOB_NAME" 2>/dev/null || true
  local waited=0
  while [[ -n $(other_jobs) ]]; do
    if ((waited >= ELEMENTS_END_SECONDS)); then
      note "elements still queued ${ELEMENTS_END_SECONDS} s after the end of training"
      cancel_elements
      return 0
    fi
    sleep "$POLL_SECONDS"
    waited=$((waited + POLL_SECONDS))
  done
}

# Until the coordinator exits: 0 when training ended, else the failure's status.
supervise_control() { # PARCAE ENDPOINT JOB
  local parcae=$1 endpoint=$2 job=$3 status=0
  while kill -0 "$coordinator_pid" 2>/dev/null; do
    if [[ -n $etcd_pid ]] && ! kill -0 "$etcd_pid" 2>/dev/null; then
      note "error: etcd exited: stopping the job"
      return 1
    fi
    sleep "$POLL_SECONDS" || true
  done
  wait "$coordinator_pid" || status=$?
  coordinator_pid=""
  if ((status != 0)); then
    note "error: the coordinator exited with status $status: stopping the job"
    return "$status"
  fi
  if ! "$parcae" slurm ended --etcd "$endpoint" --job "$job" "${etcd_flags[@]}"; then
    note "error: the coordinator exited before the end of training: stopping the job"
    return 1
  fi
  touch "$control_dir/done"
  finish_elements
}

parcae_control_run() {
  local repo
  repo=$(cd "$1" && pwd) || die "no repository directory '$1'"
  prog=control.sbatch
  require_bash
  require_slurm_job
  # From here on, however this job ends before training does, it cancels the elements.
  trap control_cleanup EXIT
  trap 'note "SIGTERM: stopping the job"; exit 143' TERM
  trap 'exit 130' INT
  require_env PARCAE_JOB "the job's name in etcd"
  require_env PARCAE_RUN_DIR "the job's directory on a shared file system"
  local job=$PARCAE_JOB run_dir=$PARCAE_RUN_DIR
  control_dir=$run_dir/control-$SLURM_JOB_ID
  local config=${PARCAE_COORDINATOR_CONFIG:-$repo/scripts/slurm/coordinator.yaml}
  require_file "PARCAE_COORDINATOR_CONFIG (coordinator config)" "$config"
  local python parcae
  python=$(require_command python "activate the megatron-parcae environment before submitting (sbatch passes it on)")
  parcae=$(require_command parcae "install megatron-parcae into the environment (pip install -e .)")
  collect_etcd_flags
  local endpoint=${PARCAE_ETCD:-} port=""
  if [[ -z $endpoint ]]; then
    port=${PARCAE_ETCD_PORT:-}
    [[ -n $port ]] || port=$(free_port_pair "$python")
    require_count PARCAE_ETCD_PORT "$port"
    ((port < 65535)) || die "PARCAE_ETCD_PORT is $port: it and the next port (etcd's peer port) must be below 65536"
    endpoint=$(hostname):$port
  fi

  run mkdir -p "$control_dir" "$run_dir/events"
  if [[ -n $port ]]; then
    # By default node-local and new (removed at the end): etcd is fast there, and no
    # earlier job's state is found in it.
    local data=${PARCAE_ETCD_DATA:-${TMPDIR:-/tmp}/parcae-etcd-$SLURM_JOB_ID.XXXXXX}
    if [[ -z ${PARCAE_ETCD_DATA:-} ]] && ! dry_run; then
      etcd_data=$(mktemp -d "$data")
      data=$etcd_data
    fi
    start_etcd "$python" "$endpoint" "$port" "$data" "$control_dir/etcd.log"
  fi
  note "job $job: etcd $endpoint; follow it with: parcae status --etcd $endpoint --job $job"
  start_background coordinator_pid "" "$parcae" coordinator --etcd "$endpoint" --job "$job" --config "$config" \
    --events "$run_dir/events/coordinator.jsonl" "${etcd_flags[@]}"
  dry_run && return 0
  # Written whole, then renamed: an element never reads half an endpoint.
  echo "$endpoint" >"$control_dir/etcd-endpoint.new"
  mv "$control_dir/etcd-endpoint.new" "$control_dir/etcd-endpoint"
  supervise_control "$parcae" "$endpoint" "$job"
}

# -- an element of the worker array -----------------------------------------------------

# etcd's HOST:PORT from the control job, into `endpoint`; exits 0 if training ends meanwhile.
wait_for_endpoint() {
  local waited=0
  until [[ -s $control_dir/etcd-endpoint ]]; do
    [[ ! -e $control_dir/done ]] || { note "training has ended"; exit 0; }
    ((waited < CONTROL_WAIT_SECONDS)) ||
      die "no etcd endpoint in $control_dir after ${CONTROL_WAIT_SECONDS} s: is the control job ($PARCAE_CONTROL_JOB) running?"
    ((waited % 30 != 0)) || note "waiting for the control job ($PARCAE_CONTROL_JOB) to start etcd"
    sleep "$POLL_SECONDS"
    waited=$((waited + POLL_SECONDS))
  done
  endpoint=$(<"$control_dir/etcd-endpoint")
}

# The workers are gone. If training ended, so does the element. Otherwise they left on a
# notice (a preemption, the time limit) or failed: stay up until SLURM ends the element,
# since SLURM requeues a preempted job only if it still runs when the grace time ends.
outlive_grace() { # STATUS GRACE
  local status=$1 waited=0 most=$(($2 + GRACE_SLACK_SECONDS))
  while [[ ! -e $control_dir/done ]]; do
    if ((waited == 0)); then
      note "the workers exited (status $status): waiting for the end of training, or for SLURM to end this" \
        "element (a preemption requeues it), at most $most s"
    fi
    if ((terminated)); then
      note "SIGTERM: ending (a preempted element is requeued)"
      exit "$status"
    fi
    if ((waited >= most)); then
      note "no preemption ended this element within $most s: ending"
      exit $((status == 0 ? 1 : status))
    fi
    sleep "$POLL_SECONDS" || true
    waited=$((waited + POLL_SECONDS))
  done
  note "training has ended"
  exit "$status"
}

parcae_element_run() {
  local repo
  repo=$(cd "$1" && pwd) || die "no repository directory '$1'"
  shift
  prog=elastic-worker.sbatch
  require_bash
  require_slurm_job
  require_env PARCAE_JOB "the job's name in etcd"
  require_env PARCAE_RUN_DIR "the job's directory on a shared file system"
  require_env PARCAE_CONTROL_JOB "the control job's id"
  require_count PARCAE_CONTROL_JOB "$PARCAE_CONTROL_JOB"
  local tasks=${SLURM_NTASKS_PER_NODE:-1} restart=${SLURM_RESTART_COUNT:-0} task=${SLURM_ARRAY_TASK_ID:-0}
  require_count "SLURM_NTASKS_PER_NODE (one task per GPU)" "$tasks"
  [[ $restart =~ ^(0|[1-9][0-9]{0,8})$ ]] || die "SLURM_RESTART_COUNT is '$restart', expected a count"
  local model=${PARCAE_MODEL:-gpt}
  [[ $model == gpt || $model == bert ]] || die "PARCAE_MODEL is '$model', expected gpt or bert"
  local train_script=$repo/scripts/pretrain_$model.py job=$PARCAE_JOB run_dir=$PARCAE_RUN_DIR
  local grace=${PARCAE_GRACE_SECONDS:-120} save=${PARCAE_SAVE-$PARCAE_RUN_DIR/checkpoints}
  local save_interval=${PARCAE_SAVE_INTERVAL:-500}
  require_count PARCAE_GRACE_SECONDS "$grace"
  require_count PARCAE_SAVE_INTERVAL "$save_interval"
  require_file "training script" "$train_script"
  local python
  python=$(require_command python "activate the megatron-parcae environment before submitting (sbatch passes it on)")
  collect_etcd_flags
  control_dir=$run_dir/control-$PARCAE_CONTROL_JOB

  [[ ! -e $control_dir/done ]] || { note "training has ended"; exit 0; }
  local endpoint=${PARCAE_ETCD:-}
  if [[ -z $endpoint ]]; then
    if dry_run; then endpoint=ETCD_HOST:PORT; else wait_for_endpoint; fi
  fi
  # Names this run of the element: a requeued element is a new instance of new workers.
  local array=${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}
  local instance=${array}_$task.$restart@${SLURMD_NODENAME:-$(hostname)}
  local worker=(bash "$repo/scripts/slurm/worker.sh" etcd "$python" "$train_script" --parcae
    --parcae-etcd "$endpoint" --parcae-job "$job" --parcae-grace-seconds "$grace" --parcae-instance "$instance"
    --parcae-events "$run_dir/events/element-${array}_$task.$restart.jsonl" "${worker_etcd_flags[@]}")
  [[ -z $save ]] || worker+=(--save "$save" --save-interval "$save_interval")
  worker+=("$@")
  local srun=(srun --nodes=1 --ntasks-per-node="$tasks" --kill-on-bad-exit=0 --wait=0 --no-kill --label)
  note "job $job: element $task (requeue $restart) of array $array, $tasks workers as instance $instance, etcd $endpoint"
  if dry_run; then
    show "${srun[@]}" "${worker[@]}"
    show_tasks 1 "$tasks" "${worker[@]}"
    return 0
  fi
  mkdir -p "$run_dir/events"
  # A SIGTERM to this shell (the grace time's end, scancel) reaches the workers from SLURM too.
  trap 'terminated=1' TERM
  "${srun[@]}" "${worker[@]}" &
  srun_pid=$!
  while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid" 2>/dev/null || true # returns early when a signal is trapped
  done
  local status=0
  wait "$srun_pid" || status=$?
  srun_pid=""
  outlive_grace "$status" "$grace"
}
