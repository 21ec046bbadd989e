"""Nothing waits for ever: a job whose etcd is gone for good stops, its workers saving a
checkpoint first, instead of hanging (`parcae replay` stopped by SIGTERM: test_live_errors)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers import ITERS, REPO, TRAIN, start_logged, wait_for
from megatron_parcae.control.etcd import EtcdClient, EtcdServer, JobStore
from megatron_parcae.training.checkpointing import read_progress

pytestmark = pytest.mark.slow  # every test here starts processes

PROFILE = REPO / "configs/profiles/gpt-tiny-cpu.json"


@pytest.mark.parametrize("noticed", [True, pytest.param(False, marks=pytest.mark.extended)], ids=["notice", "no-notice"])
def test_etcd_gone_for_good_stops_workers_and_coordinator(tiny_data, tmp_path, noticed):
    """etcd stops while two workers train. With a notice to one of them, the workers agree
    to save and leave within its grace period; without, once the outage bound is past. The
    coordinator gives up after the bound; each says why and exits with an error."""
    # Half the grace is left for a boundary, the save and the exit: a save under load takes
    # 10-20 s here (megatron-core forks writers that fsync). The workers' bound is past
    # the grace period's end when noticed, so that only the notice can stop them in time.
    grace_s = 30
    outage_s, coordinator_outage_s = (40, 12) if noticed else (12, 12)
    iters = 1000  # training outlasts the outage: finishing first (a slow start under load) is another way out
    server = EtcdServer().start()
    processes: list[subprocess.Popen] = []
    try:
        with EtcdClient(server.endpoint, timeout=3) as client:
            store = JobStore(client, "outage")
            config = tmp_path / "coordinator.yaml"
            config.write_text(f"profile: {PROFILE}\ninterval-seconds: 2\nlookahead: 4\ngrace-seconds: {grace_s}\n"
                              "lease-seconds: 2\nmax-workers: 2\nmin-workers: 2\n")
            coordinator = start_logged([sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd",
                                        server.endpoint, "--job", "outage", "--config", str(config),
                                        "--etcd-outage-seconds", str(coordinator_outage_s)], tmp_path / "coordinator.log")
            processes.append(coordinator)
            save = tmp_path / "checkpoints"
            workers = [start_logged([sys.executable, "scripts/pretrain_gpt.py", *TRAIN, "--parcae",
                                     "--parcae-etcd", server.endpoint, "--parcae-job", "outage",
                                     "--parcae-worker-id", str(w), "--parcae-grace-seconds", str(grace_s),
                                     "--parcae-lease-seconds", "5", "--parcae-etcd-outage-seconds", str(outage_s),
                                     "--train-iters", str(iters), "--save", str(save), "--save-interval", str(ITERS)],
                                    tmp_path / f"worker-{w}.log") for w in (0, 1)]
            processes += workers
            def settled() -> bool:  # both train in the current layout: no change is in flight
                generation = store.current_generation()
                plan = store.plan(generation) if generation else None
                members = store.members()
                return plan is not None and set(plan.layout["slots"]) == {0, 1} \
                    and all(m.generation == generation for m in members.values()) \
                    and max((r.iteration for r in store.step_reports().values()), default=0) >= 3

            wait_for(settled, 180, "both workers to train in one layout")
        server.stop()
        if noticed:
            workers[0].send_signal(signal.SIGTERM)
        for w, p in enumerate(workers):  # within the grace period or bound, and the seconds a boundary and exit take
            assert p.wait(timeout=grace_s + 5 if noticed else outage_s + 30) == 1
            log = (tmp_path / f"worker-{w}.log").read_text()
            assert "etcd" in log and "stops:" in log and "saved iteration" in log, log[-2000:]
        assert coordinator.wait(timeout=coordinator_outage_s + 30) == 1
        log = (tmp_path / "coordinator.log").read_text()
        assert f"more than the outage bound of {coordinator_outage_s:g} s" in log, log[-2000:]
        # the checkpoint holds the iteration they stopped at: nothing trained is lost
        _, progress = read_progress(str(save))
        assert 3 <= progress["iteration"] < iters
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
