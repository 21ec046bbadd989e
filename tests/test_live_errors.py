"""Error paths of the live system (issue 6, acceptance 5): an unreachable etcd, wrong
credentials, an unknown trace format and a training command that fails at start each end
the command with a clear error (one line; for a crashed worker, its exit code and the
tail of its log) and a non-zero exit within 10 s of the failure, and leave no process
behind.

Every command runs as a real subprocess. A watcher thread records the processes it
starts (children and grandchildren) while it runs; afterwards none of them may be alive,
and no process on the machine may name the test's job, endpoint or work folder.
"""

from __future__ import annotations

import json
import os
import signal
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from helpers import REPO, wait_for

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
FAILURE_BUDGET_S = 10.0
# An unreachable etcd is given up after the client's 5 s connect timeout, well before the
# 60 s outage bound; process start-up under three test processes on 2 cores takes up to 5 s more.
UNREACHABLE_BUDGET_S = 20.0
WORKER = [sys.executable, "scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml", "--parcae"]
PARCAE = [sys.executable, "-m", "megatron_parcae.cli"]
PROFILE = REPO / "configs" / "profiles" / "gpt-tiny-cpu.json"


@dataclass
class Finished:
    """A command's end: exit code, output, how long it ran and what it started meanwhile."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from its start to its exit (time.monotonic)
    ended_at: float  # time.time() at its exit, to compare with file times
    started: dict[int, tuple[psutil.Process, str]] = field(default_factory=dict)  # pid -> (process, cmdline)

    @property
    def name(self) -> str:
        return f"parcae {self.cmd[3]}" if self.cmd[1] == "-m" else Path(self.cmd[1]).name

    def error_line(self) -> str:
        """The one line of stderr; fails if the command said more (a traceback, say)."""
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in self.stderr, f"{self.name}: not one line:\n{self.stderr[-3000:]}"
        return lines[0]


class Watched:
    """One command started now, with a thread recording every process under it."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.started: dict[int, tuple[psutil.Process, str]] = {}
        self._begin = time.monotonic()
        self.popen = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        try:
            parent = psutil.Process(self.popen.pid)
        except psutil.NoSuchProcess:
            return
        while self.popen.poll() is None:
            try:
                children = parent.children(recursive=True)
            except psutil.Error:
                return
            for child in children:  # read every time: a fork shows its parent's command until it execs
                try:
                    cmdline = " ".join(child.cmdline())
                except psutil.Error:  # exited meanwhile
                    continue
                if cmdline or child.pid not in self.started:  # a zombie's reads empty
                    self.started[child.pid] = (self.started.get(child.pid, (child,))[0], cmdline)
            time.sleep(0.05)

    def wait(self, timeout: float = 120) -> Finished:
        stdout, stderr = self.popen.communicate(timeout=timeout)
        seconds, ended_at = time.monotonic() - self._begin, time.time()
        self._watcher.join(timeout=5)
        return Finished(self.cmd, self.popen.returncode, stdout, stderr, seconds, ended_at, dict(self.started))


def run_each(*cmds: list[str]) -> list[Finished]:
    """One after the other: a command's time is not another's start-up on these 2 cores."""
    return [Watched(cmd).wait() for cmd in cmds]


def assert_nothing_left(finished: list[Finished], *markers: str) -> None:
    """No process a command started is alive, and none names a marker (job, endpoint, folder)."""
    for f in finished:
        alive = [cmdline for p, cmdline in f.started.values() if _alive(p)]
        assert not alive, f"{f.name} left processes behind: {alive}"
    deadline = time.monotonic() + 3  # a process that was just killed may take a moment to go
    while strays := [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
                     if p.pid != os.getpid() and _alive(p)
                     and any(m in " ".join(p.info["cmdline"] or []) for m in markers)]:
        assert time.monotonic() < deadline, f"stray processes: {strays}"
        time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_name() -> str:
    return f"errors-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def coordinator_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("coordinator") / "coordinator.yaml"
    path.write_text(f'{{"profile": "{PROFILE}"}}\n')  # JSON is YAML
    return path


def three_commands(endpoint: str, job: str, config: Path, worker_flags: list[str],
                   parcae_flags: list[str]) -> list[list[str]]:
    """A worker, `parcae coordinator` and `parcae status`, all pointed at `endpoint`."""
    return [
        [*WORKER, "--parcae-etcd", endpoint, "--parcae-job", job, "--parcae-worker-id", "0", *worker_flags],
        [*PARCAE, "coordinator", "--etcd", endpoint, "--job", job, "--config", str(config), *parcae_flags],
        [*PARCAE, "status", "--etcd", endpoint, "--job", job, *parcae_flags],
    ]


def assert_failed_clearly(finished: list[Finished], code: int, *words: str,
                          budget: float = FAILURE_BUDGET_S) -> None:
    """Each exited with `code` within `budget` seconds, saying `words` in one line."""
    for f in finished:
        assert f.returncode == code, f"{f.name}: exit {f.returncode}, expected {code}:\n{f.stderr[-3000:]}"
        line = f.error_line()
        for word in words:
            assert word in line, f"{word!r} not in {line!r}"
        assert f.seconds < budget, f"{f.name} took {f.seconds:.1f} s to fail: {line}"


# -- 1. etcd unreachable ---------------------------------------------------------------


@pytest.mark.slow
def test_unreachable_etcd_fails_fast_with_the_endpoint(coordinator_config):
    endpoint, job = f"127.0.0.1:{closed_port()}", job_name()
    finished = run_each(*three_commands(endpoint, job, coordinator_config, [], []))
    assert_failed_clearly(finished, 1, f"cannot connect to etcd at {endpoint}", "is etcd running there",
                          budget=UNREACHABLE_BUDGET_S)
    assert_nothing_left(finished, job, endpoint)


# -- 2. wrong credentials --------------------------------------------------------------


def test_wrong_password_is_refused_naming_the_credentials(auth_server, coordinator_config, tmp_path):
    password = tmp_path / "password"
    password.write_text("wrong-password\n")
    job = job_name()
    finished = run_each(*three_commands(
        auth_server.endpoint, job, coordinator_config,
        ["--parcae-etcd-user", "root", "--parcae-etcd-password-file", str(password)],
        ["--etcd-user", "root", "--etcd-password-file", str(password)]))
    assert_failed_clearly(finished, 1, f"etcd authentication at {auth_server.endpoint} refused",
                          "authentication failed", "check the etcd user and password")
    assert_nothing_left(finished, job)


def test_missing_credentials_are_refused_at_connect(auth_server, coordinator_config):
    job = job_name()
    finished = run_each(*three_commands(auth_server.endpoint, job, coordinator_config, [], []))
    assert_failed_clearly(finished, 1, auth_server.endpoint, "the server requires a user and password")
    assert_nothing_left(finished, job)


def test_missing_password_file_is_a_flag_error(auth_server, coordinator_config, tmp_path):
    missing, job = tmp_path / "no-such-password", job_name()
    worker, coordinator, status = run_each(*three_commands(
        auth_server.endpoint, job, coordinator_config,
        ["--parcae-etcd-user", "root", "--parcae-etcd-password-file", str(missing)],
        ["--etcd-user", "root", "--etcd-password-file", str(missing)]))
    assert_failed_clearly([worker], 2, f"--parcae-etcd-password-file: cannot read {missing}", "No such file")
    assert_failed_clearly([coordinator, status], 2, f"--etcd-password-file: cannot read {missing}", "No such file")
    assert_nothing_left([worker, coordinator, status], job)


# -- 3. the replay's trace -------------------------------------------------------------


def replay(trace: Path, workdir: Path, *training_flags: str) -> Watched:
    return Watched([*PARCAE, "replay", "--trace", str(trace), "--max-instances", "1", "--speedup", "1",
                    "--grace-seconds", "2", "--profile", str(PROFILE),
                    "--workdir", str(workdir), "--", "scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml",
                    *training_flags])


def assert_nothing_started(f: Finished, workdir: Path) -> None:
    assert not f.started, f"processes were started: {[c for _, c in f.started.values()]}"
    assert not workdir.exists(), f"{workdir} was made"


@pytest.mark.parametrize("content, why", [
    ("instances over time\nplenty;few\n", r":1: unrecognised trace format: expected .*'ms,count'"),
    (None, r":\d+: cannot read: No such file or directory"),
], ids=["unknown-format", "missing-file"])
@pytest.mark.slow
def test_replay_rejects_a_bad_trace_before_starting_anything(tmp_path, content, why):
    trace = tmp_path / "availability.trace"
    if content is not None:
        trace.write_text(content)
    workdir = tmp_path / "replay"
    f = replay(trace, workdir).wait()
    assert f.returncode == 2, f.stderr[-3000:]
    assert re.match(f"parcae replay: error: {re.escape(str(trace))}{why}", f.error_line()), f.error_line()
    assert f.seconds < FAILURE_BUDGET_S, f"the trace error took {f.seconds:.1f} s"
    assert_nothing_started(f, workdir)
    assert_nothing_left([f], str(workdir))


# -- 4. a training command that fails at start -----------------------------------------


def one_instance_trace(tmp_path: Path) -> Path:
    """One instance for an hour (format 'ms,count'): the replay only ends by the failure."""
    trace = tmp_path / "one-instance.csv"
    trace.write_text("0,1\n3600000,1\n")
    return trace


@pytest.mark.parametrize("flags, why", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--num-layers", "many"], "argument --num-layers: invalid int value: 'many'"),
    (["--tensor-model-parallel-size", "3"], "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
], ids=["unknown", "not-a-number", "layout"])
@pytest.mark.slow
def test_replay_rejects_a_bad_training_flag_before_starting_anything(tmp_path, flags, why):
    workdir = tmp_path / "replay"
    f = replay(one_instance_trace(tmp_path), workdir, *flags).wait()
    assert f.returncode == 2, f.stderr[-3000:]
    assert f.error_line() == f"parcae replay: error: training command: {why}"
    assert f.seconds < FAILURE_BUDGET_S, f"the flag error took {f.seconds:.1f} s"
    assert_nothing_started(f, workdir)
    assert_nothing_left([f], str(workdir))


@pytest.mark.slow
def test_replay_stops_everything_when_a_worker_crashes_at_start(tmp_path):
    # A vocabulary that passes flag validation (the file exists) but is not one: the
    # worker crashes building its tokenizer, after it has joined etcd.
    vocab = tmp_path / "gpt2-vocab.json"
    vocab.write_bytes((REPO / "data" / "gpt2-vocab.json").read_bytes()[:300])
    workdir = tmp_path / "replay"
    f = replay(one_instance_trace(tmp_path), workdir, "--vocab-file", str(vocab)).wait()

    assert f.returncode == 1, f"exit {f.returncode}:\n{f.stderr[-3000:]}"
    m = re.search(r"parcae replay: error: parcae: worker \d+ exited with 1 \(log (\S+)\):\n", f.stderr)
    assert m, f.stderr[-3000:]
    log = Path(m.group(1))
    assert log.parent == workdir / "parcae"
    tail = f.stderr[m.end():]
    assert "Error while initializing BPE" in tail and tail.strip().splitlines()[-1] in log.read_text(), tail
    # The crash is when the worker wrote its last line (its output goes straight to the
    # log); the replay must have exited within 10 s of it.
    since_crash = f.ended_at - log.stat().st_mtime
    assert since_crash < FAILURE_BUDGET_S, f"the replay exited {since_crash:.1f} s after the worker crashed"

    started = [cmdline for _, cmdline in f.started.values()]
    assert any("etcd" in c and "--listen-client-urls" in c for c in started), started
    assert any("pretrain_gpt.py" in c and "--parcae-worker-id" in c for c in started), started
    coordinator = next((c for c in started if " coordinator " in c), None)
    assert coordinator is not None, started
    job = re.search(r"--job (\S+)", coordinator).group(1)
    endpoint = re.search(r"--etcd (\S+)", coordinator).group(1)
    assert_nothing_left([f], job, endpoint, str(workdir))


@pytest.mark.slow
def test_replay_stopped_by_sigterm_leaves_no_process(tmp_path):
    # Instances of two processes: etcd, the coordinator, a torchrun and its two workers.
    workdir, temporary = tmp_path / "replay", tmp_path / "tmp"
    temporary.mkdir()
    watched = Watched([*PARCAE, "replay", "--trace", str(one_instance_trace(tmp_path)), "--max-instances", "1",
                       "--gpus-per-instance", "2", "--speedup", "1", "--grace-seconds", "2", "--profile", str(PROFILE),
                       "--workdir", str(workdir), "--", "scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml"],
                      env={**ENV, "TMPDIR": str(temporary)})
    try:
        wait_for(lambda: sum("pretrain_gpt.py" in c and "torch.distributed.run" not in c
                             for _, c in list(watched.started.values())) == 2, 60, "both workers started")
        # the workers' temporary folders go in one of the replay's own
        assert [p.name.startswith("parcae-replay-") for p in temporary.iterdir()] == [True]
    finally:
        watched.popen.send_signal(signal.SIGTERM)
    f = watched.wait(timeout=FAILURE_BUDGET_S)
    assert f.returncode == 130, f.stderr[-3000:]
    assert f.stderr.strip().splitlines()[-1] == "parcae replay: interrupted; every process it started is stopped"
    started = [c for _, c in f.started.values()]
    assert any(" coordinator " in c for c in started) and any("etcd" in c for c in started), started
    assert_nothing_left([f], str(workdir))
    assert not any(temporary.iterdir()), list(temporary.rglob("*"))


# -- 6. a profile of another model -------------------------------------------------------


@pytest.mark.slow
def test_a_profile_of_another_model_is_refused_naming_the_difference(etcd_server, client, tmp_path):
    """Issue 16, acceptance 2: the worker refuses the coordinator's plans, naming what differs,
    within 10 s of meeting both the coordinator and the job (it polls once a second)."""
    from megatron_parcae.control.etcd import JobStore

    other = json.loads(PROFILE.read_text())
    other["model_shape"]["hidden_size"] = 256
    (tmp_path / "other-model.json").write_text(json.dumps(other))
    config = tmp_path / "coordinator.yaml"
    config.write_text(json.dumps({"profile": str(tmp_path / "other-model.json")}))
    job = f"profile-{uuid.uuid4().hex[:8]}"
    worker, coordinator, _ = three_commands(etcd_server.endpoint, job, config, [], [])
    store = JobStore(client, job)
    registered: list[float] = []  # when the worker's member key was first written
    watch = client.watch(store.keys.member(0), lambda events: registered.extend(
        time.time() for e in events if e.value is not None))
    started = Watched(coordinator)
    try:
        wait_for(lambda: store.profile() is not None, 60, "the coordinator to say which model it plans for")
        f = Watched(worker).wait(timeout=180)
    finally:
        watch.stop()
        started.popen.terminate()
        started.wait(timeout=30)
    assert f.returncode == 1
    line = f.error_line()
    assert "other-model.json was measured on another model" in line and "hidden_size 256 (this worker: 128)" in line
    assert registered and f.ended_at - registered[0] < FAILURE_BUDGET_S, registered
    assert_nothing_left([f], job)
