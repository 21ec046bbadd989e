"""`parcae slurm submit|cancel`: an elastic job on a SLURM cluster, one command each.

The elastic mode is the one for preemptible (spot) partitions. Every instance (a node of
G GPUs) is its own element of a job array (scripts/slurm/elastic-worker.sbatch: one node,
G tasks, --exclusive, --requeue), so SLURM preempts and requeues instances one by one and
the job moves in place to the ones left; a requeued element comes back as new workers
that join. etcd and the coordinator run in a small job on a partition that is never
preempted (scripts/slurm/control.sbatch); with `--etcd`, the coordinator alone runs there
and everything uses that etcd.

`submit` checks what it can before anything is queued (the training flags, the
coordinator config against the instances, the partitions, no queued job of the same
name), submits the control job, then the array, which starts once the control job has,
and prints both ids. The scripts read what it fills in from the environment, which sbatch
passes on, so they can be submitted by hand too (`--dry-run` prints how). `cancel`
cancels the array, waits for its elements to end, then cancels the control job. `ended`
serves control.sbatch: whether training has ended (the job's done record in etcd).
scripts/slurm/README.md lists the SLURM settings the mode needs.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_parcae.control.etcd.options import PASSWORD_ENV, add_etcd_arguments

if TYPE_CHECKING:
    from megatron_parcae.control.coordinator import CoordinatorConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm"
CONTROL_SCRIPT = SCRIPTS / "control.sbatch"
ELEMENT_SCRIPT = SCRIPTS / "elastic-worker.sbatch"
COORDINATOR_CONFIGS = {"gpt": SCRIPTS / "coordinator.yaml", "bert": SCRIPTS / "coordinator-bert.yaml"}
# Worker flags the scripts set, and what sets them instead.
SET_BY_THE_SCRIPTS = {
    "--parcae-etcd": "--etcd, or the control job's etcd",
    "--parcae-job": "--job-name",
    "--parcae-worker-id": "etcd, a new id for every worker",
    "--parcae-instance": "the array element",
    "--parcae-grace-seconds": "--grace-seconds",
}
SLURM_COMMAND_SECONDS = 60
CANCEL_WAIT_SECONDS = 300  # elements hand over, or are killed KillWait after the cancel
POLL_SECONDS = 1.0


class UsageError(Exception):
    """Bad input: the message says what is wrong and how to fix it (exit 2)."""


class SlurmError(Exception):
    """A SLURM command failed (exit 1)."""


# -- SLURM -----------------------------------------------------------------------------


def slurm(*command: str, env: dict[str, str] | None = None) -> str:
    """Run a SLURM client command; its stdout."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=SLURM_COMMAND_SECONDS)
    except FileNotFoundError:
        raise UsageError(f"{command[0]} is not on PATH: run this where SLURM's commands are (a login node)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(command)} did not answer within {SLURM_COMMAND_SECONDS} s") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SlurmError(f"{shlex.join(command)} failed ({done.returncode}): {said[-1] if said else 'no message'}")
    return done.stdout


def records(text: str) -> dict[str, str]:
    """KEY=VALUE words of one line of `scontrol show ... -o` (values without spaces)."""
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def partition(name: str, flag: str) -> dict[str, str]:
    try:
        return records(slurm("scontrol", "show", "partition", "-o", name))
    except SlurmError as exc:
        if "not found" in str(exc):
            raise UsageError(f"{flag}: SLURM has no partition {name!r}") from None
        raise


def seconds(value: str) -> int:
    """A SLURM duration: SECONDS, or [[D-]HH:]MM:SS."""
    if value.isdigit():
        return int(value)
    days, _, clock = value.rpartition("-")
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total + 86400 * int(days or 0)


def kill_wait() -> int:
    """KillWait: seconds between SIGTERM and SIGKILL when SLURM ends a job."""
    found = re.search(r"^KillWait\s*=\s*(\d+)", slurm("scontrol", "show", "config"), re.M)
    return int(found.group(1)) if found else 30


def user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def queued(name: str) -> list[tuple[str, bool]]:
    """This user's jobs named `name` that SLURM still holds: (job id, whether an array)."""
    rows = slurm("squeue", "-h", "-u", user(), "-n", name, "-o", "%F %K").split()
    return sorted({(job, task != "N/A") for job, task in zip(rows[::2], rows[1::2])})


def sbatch(command: list[str], env: dict[str, str]) -> str:
    """Submit; the job id."""
    return slurm(*command, env=env).strip().split(";")[0]


# -- submit ----------------------------------------------------------------------------


def warn(message: str) -> None:
    print(f"parcae slurm: warning: {message}", file=sys.stderr)


def check_training_flags(flags: list[str], model: str, job: str, run_dir: Path) -> None:
    """Parse the workers' flags as an element passes them, before anything is queued."""
    from megatron_parcae.training.arguments import ArgumentError, parse_args

    for word in flags:
        name = word.split("=", 1)[0]
        if name in SET_BY_THE_SCRIPTS:
            raise UsageError(f"training flags: leave {name} out, {SET_BY_THE_SCRIPTS[name]} sets it")
        if name.startswith("--parcae-etcd-"):
            raise UsageError(f"training flags: leave {name} out, give --{name.removeprefix('--parcae-')} to "
                             "parcae slurm submit instead")
    given = ["--parcae", "--parcae-etcd", "localhost:2379", "--parcae-job", job]
    save = os.environ.get("PARCAE_SAVE", str(run_dir / "checkpoints"))
    if save:
        given += ["--save", save, "--save-interval", os.environ.get("PARCAE_SAVE_INTERVAL", "500")]
    given += flags
    try:
        parse_args(given, prog=f"pretrain_{model}.py", model=model)
    except ArgumentError as exc:
        raise UsageError(f"training flags: {exc}") from None


def check_coordinator_config(path: Path, workers: int, gpus: int) -> CoordinatorConfig:
    from megatron_parcae.control.coordinator import ConfigError, CoordinatorConfig

    try:
        config = CoordinatorConfig.load(path)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    where = f"--coordinator-config {path}"
    if config.gpus_per_instance != gpus:
        raise UsageError(f"{where}: gpus-per-instance is {config.gpus_per_instance}, but --gpus-per-instance is "
                         f"{gpus}: set them equal")
    if config.min_workers > workers:
        raise UsageError(f"{where}: min-workers is {config.min_workers}, more than the {workers} workers of "
                         "--instances x --gpus-per-instance: training would never start")
    if config.max_workers < workers:
        warn(f"{where}: max-workers is {config.max_workers}: {workers - config.max_workers} of the {workers} "
             "workers will stand by")
    return config


def grace_of(spot: dict[str, str], partition_name: str) -> int:
    """The grace time a preempted element's workers get: the partition's GraceTime, or
    KillWait where it has none (SLURM then sends SIGTERM and SIGKILL KillWait apart)."""
    grace = seconds(spot.get("GraceTime", "0"))
    if grace > 0:
        return grace
    grace = kill_wait()
    warn(f"partition {partition_name} has no GraceTime: a preempted element's workers get KillWait ({grace} s) "
         "to hand over; give --grace-seconds if a QOS sets a grace time")
    return grace


def check_partitions(args: argparse.Namespace) -> dict[str, str]:
    if args.partition == args.control_partition:
        raise UsageError("--control-partition must differ from --partition: etcd and the coordinator must not "
                         "be preempted with the workers")
    spot = partition(args.partition, "--partition")
    control = partition(args.control_partition, "--control-partition")
    mode = spot.get("PreemptMode", "OFF").upper()
    if "REQUEUE" not in mode and mode != "OFF":
        warn(f"partition {args.partition} has PreemptMode={mode}: preempted elements are not requeued, the job "
             "shrinks for good (PreemptMode=REQUEUE brings them back)")
    nodes = int(spot.get("TotalNodes", "0") or 0)
    if 0 < nodes < args.instances:
        warn(f"partition {args.partition} has {nodes} nodes: {args.instances - nodes} of the {args.instances} "
             "elements wait until others end")
    if control.get("PreemptMode", "OFF").upper() != "OFF":
        warn(f"partition {args.control_partition} has PreemptMode={control['PreemptMode']}: if the control job is "
             "preempted, the whole job stops")
    return spot


def submit(args: argparse.Namespace) -> int:
    flags = args.training[1:] if args.training[:1] == ["--"] else args.training
    from megatron_parcae.control.etcd.keys import JobKeys

    try:
        JobKeys(args.job_name)
    except ValueError as exc:
        raise UsageError(f"--job-name: {exc}") from None
    if args.instances < 1 or args.gpus_per_instance < 1:
        raise UsageError("--instances and --gpus-per-instance must be at least 1")
    if args.grace_seconds is not None and args.grace_seconds < 1:
        raise UsageError("--grace-seconds must be at least 1")
    for script in (CONTROL_SCRIPT, ELEMENT_SCRIPT):
        if not script.is_file():
            raise UsageError(f"no {script}: parcae slurm runs from a megatron-parcae checkout (pip install -e .)")
    config = (args.coordinator_config or COORDINATOR_CONFIGS[args.model]).resolve()
    run_dir = (args.run_dir or Path.cwd() / "parcae-runs" / args.job_name).resolve()
    etcd_files = {f"PARCAE_ETCD_{key.upper()}": getattr(args, f"etcd_{key}") for key in ("ca", "cert", "key")}
    etcd_files["PARCAE_ETCD_PASSWORD_FILE"] = args.etcd_password_file
    for variable, path in etcd_files.items():
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--{variable.removeprefix('PARCAE_').lower().replace('_', '-')}: no file {path}")
    if (any(etcd_files.values()) or args.etcd_user) and args.etcd is None:
        raise UsageError("--etcd-ca, --etcd-user and the like are for a running etcd: give its --etcd HOST:PORT")
    if args.etcd_user and not args.etcd_password_file and PASSWORD_ENV not in os.environ:
        raise UsageError(f"--etcd-user needs a password: --etcd-password-file, or ${PASSWORD_ENV} (passed on to the jobs)")
    coordinator = check_coordinator_config(config, args.instances * args.gpus_per_instance, args.gpus_per_instance)
    check_training_flags(flags, args.model, args.job_name, run_dir)

    spot = check_partitions(args)
    grace = args.grace_seconds or grace_of(spot, args.partition)
    if coordinator.grace_seconds is not None and coordinator.grace_seconds != grace:
        warn(f"--coordinator-config {config}: grace-seconds is {coordinator.grace_seconds:g}, but the workers get "
             f"{grace} s: the coordinator plans hand-overs with the wrong deadline")
    jobs = queued(args.job_name)
    if jobs:
        raise UsageError(f"jobs named {args.job_name} are queued already ({', '.join(j for j, _ in jobs)}): cancel "
                         f"them (parcae slurm cancel --job-name {args.job_name}) or choose another --job-name")

    # What the scripts read; sbatch passes the environment on. `python` and `parcae` on
    # PATH are this environment's.
    settings = {"PARCAE_REPO": str(REPO), "PARCAE_JOB": args.job_name, "PARCAE_RUN_DIR": str(run_dir),
                "PARCAE_MODEL": args.model, "PARCAE_COORDINATOR_CONFIG": str(config),
                "PARCAE_GRACE_SECONDS": str(grace), "PARCAE_TRAINING_FLAGS": json.dumps(flags)}
    if args.etcd is not None:
        settings["PARCAE_ETCD"] = args.etcd
        settings.update({k: str(Path(v).resolve()) for k, v in etcd_files.items() if v is not None})
        if args.etcd_user is not None:
            settings["PARCAE_ETCD_USER"] = args.etcd_user
    # Not what a shell left from another job says: which etcd, which control job, a dry run.
    inherited = {"PARCAE_ETCD", "PARCAE_ETCD_USER", "PARCAE_CONTROL_JOB", "PARCAE_DRY_RUN", *etcd_files}
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **settings)
    common = [f"--job-name={args.job_name}", *([f"--time={args.time}"] if args.time else [])]
    control = ["sbatch", "--parsable", *common, f"--partition={args.control_partition}",
               f"--output={run_dir}/control-%j.out", str(CONTROL_SCRIPT)]
    gres = [] if args.gres == "none" else [f"--gres={args.gres or f'gpu:{args.gpus_per_instance}'}"]

    def elements(control_job: str) -> list[str]:
        return ["sbatch", "--parsable", *common, f"--partition={args.partition}", f"--array=0-{args.instances - 1}",
                f"--ntasks-per-node={args.gpus_per_instance}", *gres, f"--signal=TERM@{grace}",
                f"--dependency=after:{control_job}", f"--output={run_dir}/element-%a.out", str(ELEMENT_SCRIPT),
                *flags]

    if args.dry_run:
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items()))
        print(shlex.join(control))
        print(shlex.join(["PARCAE_CONTROL_JOB=CONTROL_JOB_ID", *elements("CONTROL_JOB_ID")]))
        return 0
    (run_dir / "events").mkdir(parents=True, exist_ok=True)
    control_job = sbatch(control, env)
    try:
        array_job = sbatch(elements(control_job), {**env, "PARCAE_CONTROL_JOB": control_job})
    except BaseException:
        slurm("scancel", control_job)
        raise
    print(f"parcae slurm: job {args.job_name}: control job {control_job} on {args.control_partition}, worker array "
          f"{array_job} on {args.partition} ({args.instances} elements of {args.gpus_per_instance} "
          f"task{'s' if args.gpus_per_instance > 1 else ''}); files in {run_dir}")
    endpoint = args.etcd or f"$(cat {run_dir}/control-{control_job}/etcd-endpoint)"
    print(f"  follow it: parcae status --etcd {endpoint} --job {args.job_name}")
    print(f"  cancel it: parcae slurm cancel --job-name {args.job_name}")
    return 0


# -- cancel ----------------------------------------------------------------------------


def wait_gone(name: str, jobs: set[str]) -> None:
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    while left := jobs & {job for job, _ in queued(name)}:
        if time.monotonic() > deadline:
            raise SlurmError(f"jobs {', '.join(sorted(left))} are still queued {CANCEL_WAIT_SECONDS} s after scancel")
        time.sleep(POLL_SECONDS)


def cancel(args: argparse.Namespace) -> int:
    jobs = queued(args.job_name)
    if not jobs:
        raise UsageError(f"no queued job named {args.job_name} of user {user()}")
    arrays = {job for job, is_array in jobs if is_array}
    others = {job for job, _ in jobs} - arrays
    # The elements first, while etcd and the coordinator still serve them.
    for group in (arrays, others):
        if group:
            slurm("scancel", *sorted(group))
            wait_gone(args.job_name, group)
    print(f"parcae slurm: cancelled job {args.job_name}: "
          f"{', '.join([*(f'worker array {j}' for j in sorted(arrays)), *(f'job {j}' for j in sorted(others))])}")
    return 0


# -- ended -----------------------------------------------------------------------------


def ended(args: argparse.Namespace) -> int:
    from megatron_parcae.control.etcd import EtcdError, JobStore
    from megatron_parcae.control.etcd.options import connect

    try:
        with connect(args) as client:
            done = JobStore(client, args.job).done()
    except (ValueError, EtcdError) as exc:
        raise SlurmError(f"etcd {args.etcd}: {exc}") from None
    if done is None:
        print(f"job {args.job}: training has not ended")
        return 1
    print(f"job {args.job}: training ended at iteration {done.iteration}")
    return 0


# -- command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True, help="submit or cancel a job")
    p = actions.add_parser("submit", help="submit the control job and the worker array",
                           description="Submit an elastic job: a control job (etcd, coordinator) on "
                                       "--control-partition and a job array of --instances one-node elements on "
                                       "--partition. Arguments after -- go to every worker.")
    p.add_argument("--partition", required=True, help="the preemptible partition the workers run on")
    p.add_argument("--control-partition", required=True,
                   help="a partition that is never preempted, for etcd and the coordinator")
    p.add_argument("--instances", type=int, required=True, help="array elements: nodes, one instance each")
    p.add_argument("--gpus-per-instance", type=int, default=1, help="GPUs of a node: one worker each (default 1)")
    p.add_argument("--job-name", default=None, help="SLURM job name of both jobs and the job's name in etcd "
                                                    "(default parcae-MODEL); one queued job per name")
    p.add_argument("--model", choices=sorted(COORDINATOR_CONFIGS), default="gpt",
                   help="scripts/pretrain_MODEL.py trains (default gpt)")
    p.add_argument("--coordinator-config", type=Path, default=None,
                   help="parcae coordinator's config (default scripts/slurm/coordinator.yaml, coordinator-bert.yaml)")
    p.add_argument("--etcd", default=None, metavar="HOST:PORT",
                   help="a running etcd (a site's, or one on the login node); default: the control job starts one")
    for name in ("ca", "cert", "key"):
        p.add_argument(f"--etcd-{name}", default=None, metavar="PEM", help=f"TLS {name} file for --etcd")
    p.add_argument("--etcd-user", default=None, help="etcd user for --etcd")
    p.add_argument("--etcd-password-file", default=None, metavar="FILE", help="its password")
    p.add_argument("--grace-seconds", type=int, default=None,
                   help="seconds a preempted element's workers have to hand over (default: the partition's GraceTime)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the job's files on a shared file system: logs, checkpoints, events "
                        "(default ./parcae-runs/JOB_NAME)")
    p.add_argument("--time", default=None, help="sbatch --time of both jobs (default: the partitions')")
    p.add_argument("--gres", default=None,
                   help="sbatch --gres of an element (default gpu:GPUS_PER_INSTANCE; none: no --gres)")
    p.add_argument("--dry-run", action="store_true", help="check, print the sbatch commands, submit nothing")
    p.add_argument("training", nargs=argparse.REMAINDER, help="-- then the training flags")

    p = actions.add_parser("cancel", help="cancel the worker array, then the control job",
                           description="Cancel an elastic job: its worker array, then (once the elements have "
                                       "ended) its control job.")
    p.add_argument("--job-name", required=True, help="the --job-name it was submitted with")

    p = actions.add_parser("ended", help="exit 0 if the job's training has ended (for control.sbatch)")
    add_etcd_arguments(p)


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "submit":
            args.job_name = args.job_name or f"parcae-{args.model}"
            return submit(args)
        return cancel(args) if args.action == "cancel" else ended(args)
    except UsageError as exc:
        print(f"parcae slurm: error: {exc}", file=sys.stderr)
        return 2
    except SlurmError as exc:
        print(f"parcae slurm: error: {exc}", file=sys.stderr)
        return 1
