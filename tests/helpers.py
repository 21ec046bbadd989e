"""What the tests share: where things are, how to run the real scripts and read their
events, and small waits and fixtures-in-code. Test modules import this module only
(conftest.py holds the pytest fixtures)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from megatron_parcae.control.etcd import PlanEnvelope
from megatron_parcae.events import Event, Iteration, read_events
from reconfig.layout import Layout, ModelShape, Parallelism
from reconfig.plan import MigrationRequest, plan_migration

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "traces"
ANCHORS = REPO / "benchmarks" / "anchors" / "parcae"

# The live-job tests' training run (conftest.live_job, conftest.uninterrupted).
ITERS = 30
TRAIN = ["--config", "configs/gpt-tiny.yaml", "--train-iters", str(ITERS), "--lr", "3e-4", "--min-lr", "3e-5"]

LEASE_S = 2.0  # etcd's shortest lease with its default 100 ms heartbeat


def new_job() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


SHAPE = ModelShape("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128,
                   max_position_embeddings=32)


def first_layout(workers: list[int]) -> Layout:
    return Layout(Parallelism.even(SHAPE.num_layers, 1, 1, len(workers)), tuple(workers))


def envelope(generation: int, workers: list[int], previous: list[int] | None = None) -> PlanEnvelope:
    """A real plan: the first layout, or a migration from `previous` to `workers`."""
    if previous is None:
        return PlanEnvelope(generation, time.time(), first_layout(workers).to_dict(), None)
    old = first_layout(previous)
    request = MigrationRequest(old, frozenset(previous) & frozenset(workers), frozenset(),
                               frozenset(workers) - frozenset(previous))
    plan = plan_migration(request, Parallelism.even(SHAPE.num_layers, 1, 1, len(workers)), SHAPE)
    return PlanEnvelope(generation, time.time(), plan.new.to_dict(), plan.to_dict())


def computed_folder(tmp_path_factory, name: str) -> Path:
    """Where `computed_once(..., name, ...)` computes: a folder every pytest-xdist worker of
    this run shares (this run's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "computed-once" / name


def computed_once(tmp_path_factory, name: str, compute: Callable[[Path], Any]) -> Any:
    """`compute(folder)`, run once per test run also across pytest-xdist workers (each would
    otherwise run a module's fixtures itself): the first to ask computes it under a lock
    and keeps its JSON beside the folder; the others read that."""
    folder = computed_folder(tmp_path_factory, name)
    folder.mkdir(parents=True, exist_ok=True)
    result = folder.parent / f"{name}.json"
    with FileLock(str(folder.parent / f"{name}.lock")):
        if not result.exists():
            result.write_text(json.dumps(compute(folder)))
    return json.loads(result.read_text())


def shared_losses(tmp_path_factory, name: str, run: Callable[[Path], dict[int, float]]) -> dict[int, float]:
    """The losses of a reference run, computed once (see `computed_once`)."""
    return {int(it): loss for it, loss in computed_once(tmp_path_factory, name, run).items()}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def python_child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_ranks(code: str, argv: Callable[[int], list[str]], ranks: int, env: dict[str, str],
              timeout: float = 120) -> list[tuple[int, str, str]]:
    """Run `code` as `ranks` processes (rank r gets `argv(r)`); (exit code, stdout, stderr)
    of each. None outlives the call."""
    processes = [subprocess.Popen([sys.executable, "-c", code, *argv(rank)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(ranks)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
            p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


HOOKS = REPO / "tests" / "hooks"


def hooks_env(*names: str) -> dict[str, str]:
    """The environment under which a Python process imports the test hooks `names`
    (tests/hooks/NAME.py, by tests/hooks/sitecustomize.py) besides those already set."""
    path = [str(HOOKS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(HOOKS)]
    hooks = [h for h in os.environ.get("PARCAE_TEST_HOOKS", "").split(",") if h and h not in names]
    return {"PYTHONPATH": os.pathsep.join(path), "PARCAE_TEST_HOOKS": ",".join(hooks + list(names))}


def with_hooks(monkeypatch, *names: str, **env: str) -> None:
    """Processes started from now on import the test hooks `names` (each changes their
    behaviour where `env` says how), with `env` set."""
    for name, value in {**hooks_env(*names), **env}.items():
        monkeypatch.setenv(name, value)


def paced_while(monkeypatch, folder: Path, step_seconds: float) -> Path:
    """Processes started from now on pace their steps (tests/hooks/paced.py: `step_seconds`
    a step on one process) while the file returned exists; the test removes it once what
    it waits for has happened."""
    pace = folder / "pace-while"
    pace.touch()
    with_hooks(monkeypatch, "paced", PARCAE_TEST_STEP_SECONDS=str(step_seconds), PARCAE_TEST_PACE_WHILE=str(pace))
    return pace


def start_logged(cmd: list[str], log: Path) -> subprocess.Popen:
    """A process of the repository, its output in `log`, in a process group of its own
    that `kill_group` ends with every process it forked."""
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL `p` and what it forked and left behind (an asynchronous save's writer)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def worker_events(logs: Path) -> list:
    """The events every worker of a `live_job` wrote (worker-ID.events.jsonl), in time order."""
    return sorted((e for path in logs.glob("worker-*.events.jsonl") for e in read_events(path)), key=lambda e: e.time)


# Small enough that a 4-process run of 10-20 iterations takes seconds on 2 cores.
SMALL_GPT = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1"]


def layout_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@dataclass(frozen=True)
class Run:
    """A finished torchrun job: its exit code, output, and the events rank 0 of its layouts wrote."""

    returncode: int
    stdout: str
    stderr: str
    events: list[Event]

    def of(self, kind: type[Event]) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 600, probe: Path | None = None) -> Run:
    """A scripts/ script under torchrun; with `probe`, every process runs under
    tests/collective_probe.py, which writes its findings there."""
    env = child_env()
    with tempfile.TemporaryDirectory(prefix="parcae-test-events-") as tmp:
        events = Path(tmp) / "events.jsonl"
        command = [str(REPO / "scripts" / script)]
        if probe is not None:
            command = [str(REPO / "tests" / "collective_probe.py"), str(probe), *command]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *command, *args, "--parcae-events", str(events)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return Run(done.returncode, done.stdout, done.stderr, read_events(events) if events.exists() else [])


def trained_losses(events: list[Event]) -> dict[int, float]:
    """The lm loss of each reported iteration."""
    return {e.iteration: e.losses["lm loss"] for e in events if isinstance(e, Iteration)}


def losses(run: Run) -> dict[int, float]:
    """Reported lm loss by iteration; fails with the run's output when the run failed."""
    assert run.returncode == 0, f"run failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    found = trained_losses(run.events)
    assert found, f"no loss reported:\n{run.stdout[-2000:]}"
    return found


def assert_same_state(checkpoint: Path, reference: Path, flags: list[str], model: str = "gpt") -> None:
    """`parcae compare`: parameters and Adam moments within 1e-5 relative over the model."""
    run = subprocess.run([sys.executable, "-m", "megatron_parcae.cli", "compare", "--checkpoint", str(checkpoint),
                          "--reference", str(reference), "--model", model, "--", *flags], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    difference = json.loads(run.stdout)
    assert difference["params"] <= 1e-5 and difference["moments"] <= 1e-5, difference


def assert_close(a: dict[int, float], b: dict[int, float], rel: float = 1e-5) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for it in sorted(a):
        assert abs(a[it] - b[it]) <= rel * abs(b[it]), f"iteration {it}: {a[it]} vs {b[it]}"


def processes_mentioning(text: str) -> list[str]:
    """The command lines of running processes that mention `text` (a test's folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in w for w in words):
            found.append(b" ".join(words).decode(errors="replace"))
    return found


def write_tracker(root: Path, iteration: int) -> None:
    """Point a checkpoint directory at an earlier saved iteration (as Megatron users do)."""
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
