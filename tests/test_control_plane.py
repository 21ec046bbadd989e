"""benchmarks/control_plane.py at a small scale: the report's shape, every plan
acknowledged by every agent, nothing left running; timings belong to the benchmark."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from helpers import REPO, child_env, processes_mentioning, wait_for

from megatron_parcae.events import read_events

BENCHMARK = [sys.executable, "-m", "benchmarks.control_plane"]
SMALL = ["--instances", "16", "--notices", "1", "--kills", "1", "--arrivals", "1", "--lease-seconds", "2",
         "--agents-per-process", "8"]


def test_bad_arguments_are_refused_with_a_clear_error():
    run = subprocess.run([*BENCHMARK, "--instances", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--instances must be at least 2" in run.stderr
    run = subprocess.run([*BENCHMARK, "--instances", "16", "--notices", "8"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "more than half of the 16 instances" in run.stderr


@pytest.mark.slow
def test_every_agent_acknowledges_every_plan(tmp_path):
    report = tmp_path / "report.json"
    run = subprocess.run([*BENCHMARK, *SMALL, "--json", str(report), "--workdir", str(tmp_path / "work")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=child_env())
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    result = json.loads(report.read_text())
    assert result["passed"] and result["instances"] == 16 and result["command"].startswith("python -m")
    for name in ("notice_to_plan_ms", "plan_to_ack_ms", "plan_to_all_acked_ms"):
        assert result[name]["count"] > 0 and 0 < result[name]["p50"] <= result[name]["p99"], result[name]
    assert result["notice_to_plan_ms"]["count"] == 1  # one noticed instance
    coordinator, etcd = result["coordinator"], result["etcd"]
    assert coordinator["cpu_seconds"] > 0 and coordinator["cpu_percent"] > 0 and coordinator["peak_rss_bytes"] > 0
    assert etcd["requests_per_second"] > 0 and etcd["db_size_bytes"] > 0 and etcd["requests"]["Txn"] > 0
    assert [r["kind"] for r in result["rounds"]] == ["notice", "kill", "arrival"]
    assert all(r["plans"] for r in result["rounds"] if r["kind"] != "arrival")  # each took a layout's workers
    acks = result["acknowledgements"]
    assert acks["missing"] == 0 and acks["fenced"] == [] and acks["acked"] + acks["gone"] == acks["expected"] > 0
    assert [p["generation"] for p in result["plans"]] == list(range(1, len(result["plans"]) + 1))
    for plan in result["plans"]:  # every agent registered when a plan came acknowledged it, or left first
        assert plan["missing"] == [] and plan["acked"] + plan["gone"] == plan["registered"] > 0, plan
    assert processes_mentioning(result["job"]) == [] and processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
def test_sigterm_stops_every_process_it_started(tmp_path):
    work = tmp_path / "work"
    benchmark = subprocess.Popen([*BENCHMARK, *SMALL, "--workdir", str(work)], cwd=REPO, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, env=child_env())
    job = f"bench-{benchmark.pid}"
    try:
        events = work / "coordinator.events.jsonl"

        def first_plan() -> bool:
            assert benchmark.poll() is None, benchmark.stderr.read()
            return events.is_file() and bool(read_events(events))

        wait_for(first_plan, 180, "the first plan")  # minutes on a busy machine: it starts 5 processes
        assert len(processes_mentioning(job)) >= 3  # the coordinator and the agent processes
        benchmark.send_signal(signal.SIGTERM)
        assert benchmark.wait(timeout=60) == 130
    finally:
        if benchmark.poll() is None:
            benchmark.kill()
            benchmark.wait()
    assert "interrupted; every process it started is stopped" in benchmark.stderr.read()
    assert processes_mentioning(job) == [] and processes_mentioning(str(work)) == []
