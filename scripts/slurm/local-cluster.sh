#!/usr/bin/env bash
# A real SLURM 22.05 cluster on this one machine, for the tests and for trying the batch
# scripts: munged, slurmctld and several slurmd "nodes" on 127.0.0.1 (own ports), and four
# partitions: `spot` (preemptible: requeue after a grace time) and `prio` (preempts spot) on
# the same nodes, `control` (never preempted) on nodes of its own, for the elastic mode's
# control job (etcd and the coordinator), and `ondemand` (never preempts, never preempted)
# on nodes of its own, for the on-demand instances a deadline job buys.
#
#   local-cluster.sh start     install SLURM if missing, write the config, start the
#                              daemons, wait until every node is idle (already up: fine)
#   local-cluster.sh stop      cancel every job, stop every daemon started here
#   local-cluster.sh status    sinfo of the cluster
#   local-cluster.sh install   install the Debian packages if missing (scripts/setup.sh)
#
# Clients need SLURM_CONF=$PARCAE_SLURM_DIR/slurm.conf (start prints the line).
#
# Environment (read by `start` when it writes the config):
#   PARCAE_SLURM_DIR      everything: config, state, logs, pid files (/tmp/parcae-slurm)
#   PARCAE_SLURM_NODES    slurmd nodes of spot and prio, node1..nodeN (4)
#   PARCAE_SLURM_CONTROL_NODES  slurmd nodes of control, ctl1..ctlM (1; 0: no control partition)
#   PARCAE_SLURM_ONDEMAND_NODES slurmd nodes of ondemand, od1..odK (0: no ondemand partition)
#   PARCAE_SLURM_CPUS     CPUs each node declares; more than the machine has is fine (4)
#   PARCAE_SLURM_PORT     slurmctld's port; nodeI listens on PORT+I, ctlJ on PORT+N+J,
#                         odL on PORT+N+M+L (16817)
#   PARCAE_SLURM_GRACE    GraceTime of `spot`, seconds (10)
#   PARCAE_SLURM_TIMEOUT  seconds to wait for idle nodes, a drained queue (60)
#
# Exit status: 0 done, 1 failed, 2 usage, 3 SLURM cannot be had here (not root, no
# apt-get, the install failed): a caller may skip rather than fail.
set -euo pipefail

readonly PACKAGES=(slurmctld slurmd slurm-client munge)
readonly DAEMON_STOP_SECONDS=10 # then SIGKILL

base=${PARCAE_SLURM_DIR:-/tmp/parcae-slurm}
conf=$base/slurm.conf
timeout=${PARCAE_SLURM_TIMEOUT:-60}
prog=local-cluster.sh

fail() {
  echo "$prog: error: $*" >&2
  exit 1
}

unavailable() {
  echo "$prog: SLURM is not available here: $*" >&2
  exit 3
}

have_slurm() {
  command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged
} >/dev/null

install_slurm() {
  have_slurm && return 0
  [[ $(id -u) == 0 ]] || unavailable "it is not installed and installing it needs root"
  command -v apt-get >/dev/null || unavailable "it is not installed and there is no apt-get"
  local log
  log=$(mktemp)
  # Two callers at once (pytest workers): one installs, the other waits and finds it done.
  # The lock is the machine's, not in $TMPDIR, which may differ between the callers.
  if ! (
    flock 9
    have_slurm && exit 0
    "$(dirname "${BASH_SOURCE[0]}")/../apt-install.sh" "${PACKAGES[@]}"
  ) 9>/run/lock/parcae-slurm-install.lock >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    rm -f "$log"
    unavailable "apt-get install ${PACKAGES[*]} failed"
  fi
  rm -f "$log"
  have_slurm || unavailable "apt-get installed ${PACKAGES[*]} but a daemon or sbatch is still missing"
}

# The pid in FILE if that process is alive and is NAME: a pid file can outlive its daemon,
# and its pid can be reused.
running_pid() {
  local file=$1 name=$2 pid
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
  echo "$pid"
}

nodes() { sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$conf"; }

write_config() {
  local n=${PARCAE_SLURM_NODES:-4} cpus=${PARCAE_SLURM_CPUS:-4} port=${PARCAE_SLURM_PORT:-16817}
  local grace=${PARCAE_SLURM_GRACE:-10} control=${PARCAE_SLURM_CONTROL_NODES:-1}
  local ondemand=${PARCAE_SLURM_ONDEMAND_NODES:-0} i
  [[ $n =~ ^[1-9][0-9]*$ && $cpus =~ ^[1-9][0-9]*$ && $port =~ ^[1-9][0-9]*$ && $grace =~ ^[0-9]+$ &&
    $control =~ ^[0-9]+$ && $ondemand =~ ^[0-9]+$ ]] ||
    fail "PARCAE_SLURM_NODES, _CPUS, _PORT, _GRACE, _CONTROL_NODES and _ONDEMAND_NODES must be whole numbers"
  {
    cat <<EOF
# Written by scripts/slurm/local-cluster.sh: a test cluster on one machine, everything as root.
ClusterName=parcae
SlurmctldHost=localhost
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job is held cred_expire + 1 seconds before it may run again (121 by default).
AuthInfo=socket=$base/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool/%n
SlurmctldPidFile=$base/run/slurmctld.pid
SlurmdPidFile=$base/run/slurmd-%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Nodes may declare more CPUs than the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
# Preemption: a job of a higher PriorityTier partition preempts spot jobs, which are
# requeued. At the grace start the preempted job's steps get SIGCONT + SIGTERM; at its
# end (checked every 30 s) everything gets SIGTERM, then SIGKILL KillWait seconds later.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# A job's --signal is sent at the grace start too (22.05 spelling; 23.02 moved it to
# PreemptParameters=send_user_signal, which 22.05 refuses).
SlurmctldParameters=preempt_send_user_signal
JobRequeue=1
KillWait=5
# A preemptor still pending KillWait + MessageTimeout after its last preemption preempts
# again, signalling jobs it does not need. Its nodes come free up to GraceTime + 30 s (the
# grace timer) + KillWait after it preempted: MessageTimeout leaves 20 s more for a busy machine.
MessageTimeout=$((grace + 50))
# Finished jobs stay in \`scontrol show job\` for 10 minutes (there is no accounting).
MinJobAge=600
InactiveLimit=0
EOF
    local workers=() controls=() ondemands=() node
    for ((i = 1; i <= n + control + ondemand; i++)); do
      if ((i <= n)); then
        node=node$i
        workers+=("$node")
      elif ((i <= n + control)); then
        node=ctl$((i - n))
        controls+=("$node")
      else
        node=od$((i - n - control))
        ondemands+=("$node")
      fi
      echo "NodeName=$node NodeHostname=$node NodeAddr=127.0.0.1 Port=$((port + i))" \
        "CPUs=$cpus RealMemory=1000 State=UNKNOWN"
    done
    local IFS=,
    echo "PartitionName=spot Nodes=${workers[*]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" \
      "PriorityTier=1 PreemptMode=REQUEUE GraceTime=$grace"
    echo "PartitionName=prio Nodes=${workers[*]} Default=NO MaxTime=INFINITE State=UP OverSubscribe=NO" \
      "PriorityTier=10 PreemptMode=OFF"
    # Never preempted, and no node shared with spot: the elastic mode's control job.
    ((control == 0)) || echo "PartitionName=control Nodes=${controls[*]} Default=NO MaxTime=INFINITE State=UP" \
      "OverSubscribe=NO PriorityTier=1 PreemptMode=OFF"
    # On-demand instances: spot's tier, so they preempt nothing; no node shared, so nothing
    # preempts them.
    ((ondemand == 0)) || echo "PartitionName=ondemand Nodes=${ondemands[*]} Default=NO MaxTime=INFINITE" \
      "State=UP OverSubscribe=NO PriorityTier=1 PreemptMode=OFF"
  } >"$conf.new"
  mv "$conf.new" "$conf"
}

# Poll until COMMAND succeeds, at most $timeout seconds.
wait_until() {
  local deadline=$((SECONDS + timeout))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

all_idle() {
  local states
  states=$(sinfo -h -N -o %T 2>/dev/null | sort -u) && [[ $states == idle ]]
}

queue_empty() {
  local jobs
  jobs=$(squeue -h -o %i 2>/dev/null) && [[ -z $jobs ]]
}

# Ctrl-C or a failure half way through a start: stop what was started rather than leave it running.
abort_start() {
  local status=$?
  ((status == 0)) || stop_cluster >&2
  exit "$status"
}

start_cluster() {
  [[ $(id -u) == 0 ]] || unavailable "the daemons run as root here (SlurmUser=root)"
  install_slurm
  if ! running_pid "$base/run/slurmctld.pid" slurmctld >/dev/null; then
    trap 'exit 130' INT TERM
    trap abort_start EXIT
  fi
  mkdir -p "$base"/{munge,state,spool,run,log}
  # munged refuses a socket whose directories others cannot search, or can write to.
  chmod 755 "$base" "$base/munge"
  running_pid "$base/run/slurmctld.pid" slurmctld >/dev/null && [[ -s $conf ]] || write_config
  # Daemons inherit it: their job steps then carry it, which is how `stop` finds strays.
  export SLURM_CONF=$conf

  local key=$base/munge/munge.key
  if [[ ! -s $key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$key")
  fi
  if ! running_pid "$base/munge/munged.pid" munged >/dev/null; then
    munged --socket="$base/munge/munge.socket.2" --key-file="$key" --pid-file="$base/munge/munged.pid" \
      --seed-file="$base/munge/munged.seed" --log-file="$base/log/munged.log" \
      </dev/null >>"$base/log/daemons.out" 2>&1 || fail "munged did not start: see $base/log/munged.log"
  fi
  if ! running_pid "$base/run/slurmctld.pid" slurmctld >/dev/null; then
    # -c: a cluster started again begins empty (stop cancelled its jobs anyway).
    slurmctld -f "$conf" -c </dev/null >>"$base/log/daemons.out" 2>&1 ||
      fail "slurmctld did not start: see $base/log/slurmctld.log"
  fi
  local node
  for node in $(nodes); do
    running_pid "$base/run/slurmd-$node.pid" slurmd >/dev/null && continue
    mkdir -p "$base/spool/$node"
    slurmd -f "$conf" -N "$node" </dev/null >>"$base/log/daemons.out" 2>&1 ||
      fail "slurmd $node did not start: see $base/log/slurmd-$node.log"
  done
  if ! wait_until all_idle; then
    sinfo -N >&2 || true
    fail "the nodes are not all idle after ${timeout}s: see $base/log/"
  fi
  trap - INT TERM EXIT
  echo "local SLURM cluster up ($(nodes | wc -l) nodes); clients need: export SLURM_CONF=$conf"
}

# PID and all its descendants, children first.
descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1"); do
    descendants "$child"
  done
  echo "$1"
}

# Stop the process in FILE (if it is NAME) with SIGTERM, SIGKILL after a while.
stop_daemon() {
  local file=$1 name=$2 pid deadline=$((SECONDS + DAEMON_STOP_SECONDS))
  pid=$(running_pid "$file" "$name") || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  while [[ -e /proc/$pid ]] && ((SECONDS < deadline)); do sleep 0.2; done
  [[ -e /proc/$pid ]] && kill -KILL "$pid" 2>/dev/null
  rm -f "$file"
}

stop_cluster() {
  trap '' INT # a half-done stop would leave daemons behind
  export SLURM_CONF=$conf
  if [[ -s $conf ]] && running_pid "$base/run/slurmctld.pid" slurmctld >/dev/null; then
    # slurmd going away does not end running jobs (their slurmstepd go on): cancel first.
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u) || true
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086 # one word per job id
      scancel --full $jobs 2>/dev/null || true
      wait_until queue_empty || echo "$prog: jobs still in the queue after ${timeout}s; killing them" >&2
    fi
  fi
  local file
  for file in "$base"/run/slurmd-*.pid; do
    [[ -e $file ]] && stop_daemon "$file" slurmd &
  done
  stop_daemon "$base/run/slurmctld.pid" slurmctld &
  wait
  stop_daemon "$base/munge/munged.pid" munged # last: the others talk through it until they end
  # Job steps the cancel missed: slurmstepd processes of this cluster and what they run.
  local dir pid
  for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    [[ $(cat "$dir/comm" 2>/dev/null) == slurmstepd ]] || continue
    tr '\0' '\n' <"$dir/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$conf" || continue
    # shellcheck disable=SC2046 # one word per pid
    kill -KILL $(descendants "$pid") 2>/dev/null || true
  done
  trap - INT
  echo "local SLURM cluster in $base stopped"
}

status_cluster() {
  if ! running_pid "$base/run/slurmctld.pid" slurmctld >/dev/null; then
    echo "local SLURM cluster in $base is not running"
    return 1
  fi
  SLURM_CONF=$conf sinfo
}

case ${1:-} in
  start) start_cluster ;;
  stop) stop_cluster ;;
  status) status_cluster ;;
  install) install_slurm ;;
  *)
    echo "usage: $prog start|stop|status|install (state in \$PARCAE_SLURM_DIR, default /tmp/parcae-slurm)" >&2
    exit 2
    ;;
esac
