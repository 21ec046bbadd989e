#!/bin/bash
# One training process of the job: srun runs this once per task (one task per GPU).
#
#   worker.sh RESTART_COUNT|etcd COMMAND [ARGS...]
#
# Replaces itself with COMMAND ARGS --parcae-worker-id ID, so that the SIGTERM SLURM sends
# the task reaches the training process (its agent turns it into a preemption notice).
#
# ID = RESTART_COUNT x 100000 + SLURM_PROCID. SLURM_PROCID is unique within one run of the
# batch script and RESTART_COUNT (SLURM_RESTART_COUNT) grows with every requeue, so no id
# is used twice over the job's life: a requeued worker is a new worker, never mistaken for
# one that held state before the requeue. With `etcd` instead of a restart count (the
# elastic mode, where every array element runs its own srun and SLURM_PROCIDs repeat) no
# id is added: etcd hands each process a new one.
#
# LOCAL_RANK picks this task's GPU: SLURM_LOCALID among the GPUs the task sees, or 0 when
# SLURM bound one GPU to the task (CUDA_VISIBLE_DEVICES lists one).
#
# On a cluster with SLURM's tree topology, srun sets SLURM_TOPOLOGY_ADDR to the switches
# above the node and the node (e.g. top.leaf3.node17): the node's leaf switch, the last
# switch before the node, is its failure domain (--parcae-failure-domain, unless COMMAND
# names one), so buddies keep their copies behind another switch.
set -euo pipefail

# shellcheck disable=SC2034  # common.sh names us with it
prog="worker.sh (task ${SLURM_PROCID:-?})"
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

readonly IDS_PER_RUN=100000
readonly MAX_WORKER_ID=2147483647  # megatron_parcae.control.etcd.keys.MAX_WORKER_ID

(($# >= 2)) || die "usage: worker.sh RESTART_COUNT|etcd COMMAND [ARGS...]"
restart_count=$1
shift
[[ $restart_count =~ ^(0|[1-9][0-9]{0,8}|etcd)$ ]] || die "restart count '$restart_count' is not a count (or 'etcd')"
for variable in SLURM_PROCID SLURM_LOCALID; do
  [[ ${!variable:-} =~ ^(0|[1-9][0-9]{0,8})$ ]] || die "$variable is '${!variable:-}', not a task number: run this under srun"
done
id_flags=()
if [[ $restart_count != etcd ]]; then
  ((SLURM_PROCID < IDS_PER_RUN)) || die "at most $IDS_PER_RUN tasks per job: worker ids are RESTART_COUNT x $IDS_PER_RUN + SLURM_PROCID"
  ((restart_count * IDS_PER_RUN + IDS_PER_RUN - 1 <= MAX_WORKER_ID)) \
    || die "requeue $restart_count: worker ids would pass $MAX_WORKER_ID; submit the job again under a new PARCAE_JOB"
  id_flags=(--parcae-worker-id "$((restart_count * IDS_PER_RUN + SLURM_PROCID))")
fi

local_rank=$SLURM_LOCALID
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
  if ((${#gpus[@]} == 1)); then
    local_rank=0
  elif ((local_rank >= ${#gpus[@]})); then
    die "local task $local_rank on $(hostname) sees ${#gpus[@]} GPUs ($CUDA_VISIBLE_DEVICES): start one task per GPU"
  fi
fi

domain_flags=()
if [[ ${SLURM_TOPOLOGY_ADDR:-} == *.* && " $* " != *" --parcae-failure-domain "* ]]; then
  domain_flags=(--parcae-failure-domain "${SLURM_TOPOLOGY_ADDR%.*}")
fi

command=("$@" "${id_flags[@]}" "${domain_flags[@]}")
if dry_run; then
  show env "LOCAL_RANK=$local_rank" "${command[@]}"
  exit 0
fi
export LOCAL_RANK=$local_rank
exec "${command[@]}"
