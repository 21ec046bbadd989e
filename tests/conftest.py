"""The pytest fixtures: the tiny datasets, etcd servers, live jobs. Shared helpers are in helpers.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from collective_probe import read_findings
from helpers import REPO, TRAIN, kill_group, losses, shared_losses, start_logged, torchrun
from slurm_cluster import slurm_cluster  # noqa: F401  # one cluster per test process, for every module

# Fixtures that start processes (etcd servers, coordinators, workers, torchrun jobs): a
# test that uses one is `slow`. Tests that start processes themselves carry the mark.
PROCESS_FIXTURES = frozenset({"etcd_server", "client", "own_etcd", "auth_server", "secure_server", "live_job",
                              "uninterrupted"})


# Modules of the longest tests, longest first: they run first, so that the test processes
# (pytest.ini's -n; --maxschedchunk 1 hands each process a test or two at a time) finish
# together.
LONGEST_FIRST = ("test_slurm_elastic.py", "test_nccl_rules.py", "test_half_precision.py", "test_checkpoint_interop.py",
                 "test_copies_live.py", "test_recovery.py", "test_timeouts.py", "test_exit_signal_handler.py",
                 "test_reconfig_live.py", "test_live.py", "test_release.py", "test_checkpointing.py",
                 "test_etcd_outage.py", "test_progress.py", "test_replay.py", "test_model_flags.py",
                 "test_save_and_exit.py", "test_training.py")


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config) -> None:
    """SIGTERM ends a test run as Ctrl-C does, running the fixtures' teardown: the etcd
    servers, jobs and SLURM clusters they started are stopped, not left behind."""
    signal.signal(signal.SIGTERM, _interrupted)


def pytest_addoption(parser) -> None:
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked extended: more cases of scenarios the default run checks once")


def pytest_collection_modifyitems(config, items) -> None:
    if not config.getoption("--extended"):
        left_out = [item for item in items if item.get_closest_marker("extended")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


@pytest.fixture(scope="session", autouse=True)
def children_tmpdir():
    """The processes tests start keep their temporary folders in one that is removed at
    the end: those the tests kill cannot remove theirs."""
    from megatron_parcae.tools.replay import children_temporary_folder

    with children_temporary_folder("parcae-tests-") as folder:
        yield folder


@pytest.fixture(scope="session")
def tiny_data() -> dict[str, str]:
    """The corpus, vocabularies and indexed datasets of configs/*-tiny.yaml, built once."""
    from megatron_parcae.training.data.corpus import prepare_tiny_datasets

    return prepare_tiny_datasets(REPO / "data")


@pytest.fixture(scope="session")
def etcd_server():
    """One real etcd server for the whole session."""
    from megatron_parcae.control.etcd import EtcdServer

    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def client(etcd_server):
    from megatron_parcae.control.etcd import EtcdClient

    # The test's own reads wait longer than a worker's would: at a cold start the machine
    # may be busy importing torch in several processes for seconds.
    with EtcdClient(etcd_server.endpoint, timeout=10) as c:
        yield c


@pytest.fixture
def own_etcd():
    """A fresh etcd and a client of it, for a test that restarts the server: a failure
    there cannot take the shared server down with it."""
    from megatron_parcae.control.etcd import EtcdClient, EtcdServer

    with EtcdServer() as server, EtcdClient(server.endpoint, timeout=3) as client:
        yield server, client


def _enable_auth(ctl: list[str]) -> None:
    """User root with password right-password, then authentication on (etcdctl `ctl`)."""
    for args in (["user", "add", "root:right-password"], ["auth", "enable"]):
        subprocess.run(ctl + args, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def auth_server():
    """etcd with authentication on (plain HTTP): user root, password right-password."""
    from megatron_parcae.control.etcd import EtcdServer, find_etcd_binary

    with EtcdServer() as server:
        _enable_auth([find_etcd_binary("etcdctl"), f"--endpoints=http://{server.endpoint}"])
        yield server


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def secure_server(tmp_path_factory):
    """etcd with TLS (client certificates required) and authentication on (root / right-password)."""
    from megatron_parcae.control.etcd import EtcdServer, TLSFiles, find_etcd_binary

    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=parcae-test-ca", cwd=d)
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    client_tls = TLSFiles(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"))
    with EtcdServer(tls=TLSFiles(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"))) as server:
        _enable_auth([find_etcd_binary("etcdctl"), f"--endpoints=https://{server.endpoint}", f"--cacert={client_tls.ca}",
                      f"--cert={client_tls.cert}", f"--key={client_tls.key}"])
        yield server, client_tls


# The live jobs of test_live.py and test_recovery.py: GPT-tiny, with the losses reported.
@pytest.fixture(scope="session")
def uninterrupted(tiny_data, tmp_path_factory) -> dict[int, float]:
    """Losses of TRAIN in one process, with no layout change."""
    return shared_losses(tmp_path_factory, "uninterrupted", lambda _: losses(torchrun("pretrain_gpt.py", 1, TRAIN)))


@pytest.fixture
def live_job(etcd_server, client, tmp_path):
    """A job for workers and coordinators started as processes (logs in tmp_path; the
    workers save asynchronously every 4 iterations, joiners too); all are killed at the
    end. Yields the job's store, coordinator(name), worker(id, *flags), tmp_path."""
    from megatron_parcae.control.etcd import JobStore

    job = f"live-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "coordinator.yaml"
    config.write_text(f"profile: {REPO / 'configs/profiles/gpt-tiny-cpu.json'}\ninterval-seconds: 2\n"
                      "lookahead: 4\ngrace-seconds: 20\nlease-seconds: 2\nmax-workers: 4\nmin-workers: 2\n")
    processes: list[subprocess.Popen] = []
    probe = tmp_path / "probe"

    def coordinator(name: str) -> subprocess.Popen:
        p = start_logged([sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd", etcd_server.endpoint,
                    "--job", job, "--config", str(config), "--events",
                    str(tmp_path / f"coordinator-{name}.events.jsonl")], tmp_path / f"coordinator-{name}.log")
        processes.append(p)
        return p

    def worker(worker_id: int, *flags: str) -> subprocess.Popen:
        p = start_logged([sys.executable, "tests/collective_probe.py", str(probe), "scripts/pretrain_gpt.py", *TRAIN,
                          "--parcae", "--parcae-etcd",
                    etcd_server.endpoint, "--parcae-job", job, "--parcae-worker-id", str(worker_id),
                    "--parcae-grace-seconds", "20", "--parcae-lease-seconds", "5",
                    "--save", str(tmp_path / "checkpoints"), "--save-interval", "4", "--async-save",
                    "--parcae-events", str(tmp_path / f"worker-{worker_id}.events.jsonl"), *flags],
                   tmp_path / f"worker-{worker_id}.log")
        processes.append(p)
        return p

    yield JobStore(client, job), coordinator, worker, tmp_path
    for p in processes:
        kill_group(p)
    # Every collective of the live loop used its plane's device (tests/collective_probe.py).
    _, violations = read_findings(probe)
    assert not violations, violations
