"""The SLURM backend: instances are elements of job arrays, submitted and cancelled by the
control job (scripts/slurm/control.sbatch runs the coordinator).

Each pool is a partition (`partitions:`): spot pools a preemptible one, whose elements
SLURM preempts and requeues; on-demand pools one that does not preempt. `request`
submits one array of `count` elements of the element script (scripts/slurm/
elastic-worker.sbatch, one node of G GPUs each, as `parcae slurm submit` does) on the
pool's partition; `release` cancels elements, pending ones first, then the newest
running; `running` and `pool_of` read the queue. The element script names its instance
`<array>_<element>.<requeue>@<node>`, so a member record leads to its array and so to
its partition and pool. Commands go through `runner(argv, env) -> stdout`, which tests
replace.

The elements get the control job's environment, as `parcae slurm submit`'s array does
(PARCAE_JOB, PARCAE_RUN_DIR, ...), with PARCAE_CONTROL_JOB set to the control job and
without its SLURM_* variables, which would otherwise pass its own settings (such as
SLURM_CPUS_PER_TASK) on to the elements' srun. Their logs go to
$PARCAE_RUN_DIR/element-<array>_<element>.out. What `parcae slurm submit` set is the
default for what the options leave out: the training flags (PARCAE_TRAINING_FLAGS, a
JSON list) and the spot elements' grace time (PARCAE_GRACE_SECONDS).
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_parcae.provisioning.pools import Pool
from megatron_parcae.provisioning.provisioner import Instance, Provisioner, ProvisionerError, ProvisionerParameters

ELEMENT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "elastic-worker.sbatch"
COMMAND_SECONDS = 60
_OPTIONS = ("partitions", "script", "job-name", "gres", "grace-seconds", "sbatch-args", "training-flags", "user")
# squeue's states of an element that is gone, and of one on its way out (cancelled, or
# preempted and about to be requeued): held still, neither running nor to be released.
_ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                    "DEADLINE", "OUT_OF_MEMORY"})
_LEAVING = "COMPLETING"

Runner = Callable[[list[str], Mapping[str, str]], str]


def run_command(argv: list[str], env: Mapping[str, str]) -> str:
    """Run a SLURM client command; its stdout, or ProvisionerError with its last line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=dict(env), timeout=COMMAND_SECONDS)
    except FileNotFoundError:
        raise ProvisionerError(f"{argv[0]} is not on PATH: the SLURM backend runs where SLURM's commands are") from None
    except subprocess.TimeoutExpired:
        raise ProvisionerError(f"{shlex.join(argv)} did not answer within {COMMAND_SECONDS} s") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ProvisionerError(f"{shlex.join(argv)} failed ({done.returncode}): {said[-1] if said else 'no message'}")
    return done.stdout


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name}: expected a list of strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class SlurmOptions:
    """The `provisioner:` options of the SLURM backend (keys with '-')."""

    partitions: Mapping[str, str]  # pool -> partition
    script: Path = ELEMENT_SCRIPT
    job_name: str | None = None  # default: the job's name (the control job's, as `parcae slurm submit` names it)
    gres: str | None = None  # default gpu:G; "none": no --gres
    grace_seconds: int | None = None  # spot elements get SIGTERM this long before they are killed
    sbatch_args: tuple[str, ...] = ()
    training_flags: tuple[str, ...] | None = None  # passed to every element's workers; default $PARCAE_TRAINING_FLAGS
    user: str | None = None  # whose queue to read; default the current user

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SlurmOptions:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(map(str, unknown))}; known: {', '.join(_OPTIONS)}")
        partitions = options.get("partitions")
        if not isinstance(partitions, dict) or not partitions \
                or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in partitions.items()):
            raise ValueError("partitions: expected a mapping of pool names to partition names")
        values: dict[str, Any] = {"partitions": dict(partitions)}
        for key in ("script", "job-name", "gres", "user"):
            if key in options:
                if not isinstance(options[key], str) or not options[key]:
                    raise ValueError(f"{key}: expected a non-empty string, got {options[key]!r}")
                values[key.replace("-", "_")] = Path(options[key]) if key == "script" else options[key]
        if "grace-seconds" in options:
            grace = options["grace-seconds"]
            if isinstance(grace, bool) or not isinstance(grace, int) or grace < 1:
                raise ValueError(f"grace-seconds: expected a positive integer, got {grace!r}")
            values["grace_seconds"] = grace
        for key in ("sbatch-args", "training-flags"):
            if key in options:
                values[key.replace("-", "_")] = _strings(key, options[key])
        return cls(**values)


def parse_options(options: Mapping[str, Any]) -> SlurmOptions:
    return SlurmOptions.from_dict(options)


@dataclass(frozen=True)
class _Element:
    array: str
    task: int
    partition: str
    state: str

    @property
    def name(self) -> str:
        return f"{self.array}_{self.task}"


def _environment_flags(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The training flags `parcae slurm submit` passed on in PARCAE_TRAINING_FLAGS."""
    text = environ.get("PARCAE_TRAINING_FLAGS")
    if text is None:
        return ()
    try:
        return _strings("PARCAE_TRAINING_FLAGS", json.loads(text))
    except ValueError as exc:
        raise ProvisionerError(f"PARCAE_TRAINING_FLAGS: not a JSON list of strings: {exc}") from None


def _environment_grace(environ: Mapping[str, str]) -> int | None:
    text = environ.get("PARCAE_GRACE_SECONDS")
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ProvisionerError(f"PARCAE_GRACE_SECONDS is {text!r}, expected a positive number of seconds")
    return int(text)


class SlurmProvisioner(Provisioner):
    """See the module docstring."""

    def __init__(self, pools: tuple[Pool, ...], options: SlurmOptions, job: str, runner: Runner = run_command,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(pools)
        missing = sorted(set(self.pools) - set(options.partitions))
        extra = sorted(set(options.partitions) - set(self.pools))
        if missing or extra:
            raise ProvisionerError("slurm partitions: " + "; ".join(
                [*([f"no partition for pool(s) {', '.join(missing)}"] if missing else []),
                 *([f"no pool(s) {', '.join(extra)}"] if extra else [])]))
        self.options = options
        self.job_name = options.job_name or job
        self._run = runner
        environ = dict(os.environ if environ is None else environ)
        control = environ.get("PARCAE_CONTROL_JOB") or environ.get("SLURM_JOB_ID")
        self._env = {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        if control:
            self._env["PARCAE_CONTROL_JOB"] = control
        self._run_dir = environ.get("PARCAE_RUN_DIR")
        self._training_flags = options.training_flags if options.training_flags is not None \
            else _environment_flags(environ)
        self._grace_seconds = options.grace_seconds or _environment_grace(environ)
        self._user = options.user or environ.get("USER") or getpass.getuser()
        self._pool_of_partition = {partition: pool for pool, partition in options.partitions.items()}
        self._partition_of_array: dict[str, str] = {}

    def submit_command(self, pool: str, count: int) -> list[str]:
        """The sbatch command of `count` new elements of `pool`."""
        p = self.pool(pool)
        gres = self.options.gres or f"gpu:{p.gpus_per_instance}"
        signal = [f"--signal=TERM@{self._grace_seconds}"] if p.preemptible and self._grace_seconds else []
        output = [f"--output={self._run_dir}/element-%A_%a.out"] if self._run_dir else []
        return ["sbatch", "--parsable", f"--job-name={self.job_name}", f"--partition={self.options.partitions[pool]}",
                f"--array=0-{count - 1}", f"--ntasks-per-node={p.gpus_per_instance}",
                *([] if gres == "none" else [f"--gres={gres}"]), *signal, *output, *self.options.sbatch_args,
                str(self.options.script), *self._training_flags]

    def request(self, pool: str, count: int) -> list[str]:
        held = len(self._elements(pool))
        count = min(self.check_count(count), self.pool(pool).max_count - held)
        if count <= 0:
            return []
        array = self._run(self.submit_command(pool, count), self._env).strip().split(";")[0]
        if not array.isdigit():
            raise ProvisionerError(f"sbatch answered {array!r}, not a job id")
        self._partition_of_array[array] = self.options.partitions[pool]
        return [f"{array}_{task}" for task in range(count)]

    def release(self, pool: str, count: int) -> list[str]:
        elements = [e for e in self._elements(pool) if e.state != _LEAVING]
        # Those not running first (pending, requeued), then the newest running ones.
        order = sorted(elements, key=lambda e: (e.state == "RUNNING", -int(e.array), -e.task))
        chosen = [e.name for e in order[:self.check_count(count)]]
        if chosen:
            self._run(["scancel", *chosen], self._env)
        return chosen

    def running(self, pool: str) -> list[Instance]:
        return [Instance(e.name, pool) for e in self._elements(pool) if e.state == "RUNNING"]

    def pool_of(self, instance: str) -> str | None:
        array = instance.split("_", 1)[0]
        if not array.isdigit():
            return None
        if array not in self._partition_of_array:
            self._queue()
        return self._pool_of_partition.get(self._partition_of_array.get(array, ""))

    def _elements(self, pool: str) -> list[_Element]:
        """The pool's elements SLURM holds: those leaving too, which a preemption requeues."""
        partition = self.options.partitions[self.pool(pool).name]
        return [e for e in self._queue() if e.partition == partition]

    def _queue(self) -> list[_Element]:
        """The job's array elements SLURM holds, one per line (-r), other jobs of its name
        (the control job) left out."""
        out = self._run(["squeue", "-h", "-r", "-u", self._user, "-n", self.job_name, "-o", "%F %K %P %T"], self._env)
        elements = []
        for line in out.splitlines():
            words = line.split()
            if len(words) != 4 or not words[0].isdigit() or not words[1].isdigit():
                continue
            element = _Element(words[0], int(words[1]), words[2], words[3])
            self._partition_of_array[element.array] = element.partition
            if element.state not in _ENDED:
                elements.append(element)
        return elements


def create(params: ProvisionerParameters) -> SlurmProvisioner:
    return SlurmProvisioner(params.pools, params.options, params.job, params.context.get("runner", run_command),
                            params.context.get("environ"))
