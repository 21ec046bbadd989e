"""The training-process agent against a real etcd: membership, notices, plans, fencing."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time

import pytest
from helpers import LEASE_S, SHAPE, envelope, new_job, python_child, wait_for

from megatron_parcae.control import agent as agent_module
from megatron_parcae.control.agent import AgentError, ParcaeAgent
from megatron_parcae.control.etcd import JobStore
from megatron_parcae.control.etcd.client import Put
from megatron_parcae.control.etcd.keys import SchemaError
from megatron_parcae.control.notices import Notice

GRACE_S = 30.0


@pytest.fixture
def job_agent(client):
    """A started agent for worker 3 of a fresh job, and the job's store."""
    store = JobStore(client, new_job())
    agent = ParcaeAgent(client, store.keys.job, worker_id=3, grace_seconds=GRACE_S, lease_seconds=LEASE_S, instance="node-a",
                        failure_domain="rack-1")
    agent.start()
    yield agent, store
    agent.stop()


def test_agent_registers_and_deregisters_on_stop(job_agent):
    agent, store = job_agent
    member = store.members()[3]
    assert (member.instance, member.failure_domain, member.pid, member.generation) == ("node-a", "rack-1", os.getpid(), 0)
    assert signal.getsignal(signal.SIGTERM) == agent._on_sigterm
    agent.stop()
    assert store.members() == {}
    assert signal.getsignal(signal.SIGTERM) != agent._on_sigterm
    assert not agent.fenced


def test_the_member_record_says_which_model_the_worker_trains_and_its_pool(client):
    store = JobStore(client, new_job())
    agent = ParcaeAgent(client, store.keys.job, worker_id=4, grace_seconds=GRACE_S, lease_seconds=LEASE_S, model=SHAPE,
                        pool="on-demand")
    agent.start()
    try:
        assert store.members()[4].shape() == SHAPE
        assert store.members()[4].pool == "on-demand"
    finally:
        agent.stop()
    with pytest.raises(SchemaError):
        ParcaeAgent(client, store.keys.job, worker_id=5, grace_seconds=GRACE_S, lease_seconds=LEASE_S, pool="")


def test_plans_are_delivered_in_order_and_acknowledged(job_agent):
    agent, store = job_agent
    assert agent.pending_plan() is None
    first = envelope(1, [3])
    assert store.publish_plan(first)
    assert wait_for(agent.pending_plan, 10, "plan 1") == first
    agent.acknowledge(1)
    assert agent.pending_plan() is None and agent.generation == 1
    wait_for(lambda: store.members()[3].generation == 1, 10, "the acknowledgement in etcd")
    with pytest.raises(AgentError, match="cannot acknowledge generation 1"):
        agent.acknowledge(1)  # a plan is applied once
    second = envelope(2, [3, 4], previous=[3])
    assert store.publish_plan(second)
    assert wait_for(agent.pending_plan, 10, "plan 2") == second


def test_malformed_plan_is_ignored_with_a_clear_error(job_agent, client):
    agent, store = job_agent
    bad = envelope(1, [3]).to_dict() | {"layout": {"tp": 1}}
    # one write, as the coordinator publishes: a watch that starts between two writes
    # would see neither the plan's event nor a current generation with a plan
    client.txn([], [Put(store.keys.plan(1), json.dumps(bad).encode()), Put(store.keys.generation, b"1")])
    wait_for(lambda: agent.last_error, 10, "the agent to refuse the plan")
    assert "Layout.from_dict refused it" in agent.last_error and store.keys.plan(1) in agent.last_error
    assert agent.pending_plan() is None


def test_newcomer_ignores_plans_older_than_its_arrival(client):
    store = JobStore(client, new_job())
    assert store.publish_plan(envelope(1, [0]))
    agent = ParcaeAgent(client, store.keys.job, 9, GRACE_S, LEASE_S)
    agent.start()
    try:
        time.sleep(0.5)
        assert agent.generation == 1 and agent.pending_plan() is None
        assert store.publish_plan(envelope(2, [0, 9], previous=[0]))
        assert wait_for(agent.pending_plan, 10, "plan 2").generation == 2
    finally:
        agent.stop()


def test_step_reports_are_averaged_and_published(job_agent):
    agent, store = job_agent
    for i, seconds in enumerate([0.1, 0.3]):
        agent.report_step(i, seconds, consumed_samples=8 * (i + 1))
    report = wait_for(lambda: store.step_reports().get(3), 10, "a step report")
    # the first step is published alone at once, the second one within a report interval
    if report.window == 1:
        report = wait_for(lambda: (r := store.step_reports()[3]).iteration == 1 and r, 10, "the second report")
    assert report.iteration == 1 and report.consumed_samples == 16 and report.generation == 0
    assert report.seconds == pytest.approx(0.3 if report.window == 1 else 0.2)
    with pytest.raises(ValueError, match="positive number of seconds"):
        agent.report_step(2, float("nan"), 24)


def test_a_changes_phases_are_published_before_its_acknowledgement(job_agent):
    agent, store = job_agent
    agent.report_change(1, "pipeline", {"export": 0.01, "world": 0.2, "build": 1.5, "import": 0.02})
    agent.acknowledge(1)
    wait_for(lambda: store.members()[3].generation == 1, 10, "the acknowledgement")
    assert store.change_reports()[1].phases == {"export": 0.01, "world": 0.2, "build": 1.5, "import": 0.02}
    agent.report_change(2, "pipeline", {"world": float("nan")})  # refused here, not on the agent's thread
    agent.acknowledge(2)
    wait_for(lambda: store.members()[3].generation == 2, 10, "the next acknowledgement")
    assert sorted(store.change_reports()) == [1]


def test_coordinator_can_fence_a_worker(job_agent):
    agent, store = job_agent
    assert store.fence_member(3)
    wait_for(lambda: agent.fenced, 10, "the agent to notice it is fenced")
    agent.report_step(5, 0.1, 40)
    time.sleep(1.2)
    assert store.members() == {} and store.step_reports() == {}


def test_progress_is_written_by_the_next_boundary_outlives_the_worker_and_not_by_a_fenced_one(job_agent):
    agent, store = job_agent
    assert store.publish_plan(envelope(1, [3]))
    agent.record_progress(2, 16, generation=1)  # a restart records before it acknowledges its plan
    assert store.progress().generation == 1 and store.progress().iteration == 2
    agent.acknowledge(1)
    agent.record_progress(3, 24)  # a step's record: sent, and answered by the next boundary
    agent.progress_written()
    assert store.progress().to_dict() | {"recorded_at": 0} == {"generation": 1, "iteration": 3,
                                                               "consumed_samples": 24, "recorded_at": 0,
                                                               "copies": 0, "raised": False}
    assert store.fence_member(3)
    agent.record_progress(4, 32)
    agent.progress_written()
    assert agent.fenced and store.progress().iteration == 3
    assert store.members() == {} and store.progress().consumed_samples == 24  # no lease holds it


def test_step_records_are_sent_when_due_and_the_held_one_before_a_change(job_agent, monkeypatch):
    monkeypatch.setattr(agent_module, "PROGRESS_INTERVAL_S", 0.5)
    agent, store = job_agent
    assert store.publish_plan(envelope(1, [3]))
    agent.acknowledge(1)
    agent.record_progress(1, 8)  # the first is due
    agent.record_progress(2, 16)  # within the interval: held
    wait_for(lambda: store.progress() is not None, 10, "the first record")
    assert store.progress().iteration == 1
    agent.record_progress(3, 24, copies=1)  # names new snapshots: sent at once
    agent.record_progress(4, 32, copies=1)  # held
    wait_for(lambda: store.progress().iteration == 3, 10, "the record of new snapshots")
    assert store.progress().copies == 1
    agent.progress_written()  # before a change or a restart reads the job's progress
    assert store.progress().iteration == 4
    agent.record_progress(5, 40, copies=1)
    time.sleep(0.6)
    agent.record_progress(6, 48, copies=1)  # the interval passed: sent
    wait_for(lambda: store.progress().iteration == 6, 10, "the record after the interval")


def test_a_survivor_raises_the_record_to_what_it_trained_but_never_past_a_newer_plan(job_agent):
    agent, store = job_agent
    assert store.publish_plan(envelope(1, [3]))
    agent.acknowledge(1)
    agent.record_progress(8, 64)
    agent.progress_written()
    assert not store.progress().raised
    assert not agent.raise_progress(7, 56, generation=1)  # behind the record: kept
    assert agent.raise_progress(10, 80, generation=1, copies=1)  # rank 0 died holding its newer record
    # Marked raised: it says what a survivor trained, not what rank 0 logged.
    assert store.progress().to_dict() | {"recorded_at": 0} == {"generation": 1, "iteration": 10,
                                                               "consumed_samples": 80, "recorded_at": 0,
                                                               "copies": 1, "raised": True}
    assert store.publish_plan(envelope(2, [3]))
    agent.record_progress(5, 40, generation=2)  # a restart went back to iteration 5
    assert not agent.raise_progress(10, 80, generation=1)  # a late survivor of generation 1
    assert store.progress().iteration == 5 and not store.progress().raised
    assert store.fence_member(3)
    assert not agent.raise_progress(12, 96, generation=2)  # no longer a member
    assert store.progress().iteration == 5


def test_duplicate_worker_id_is_refused(job_agent, client):
    agent, store = job_agent
    twin = ParcaeAgent(client, store.keys.job, 3, GRACE_S, lease_seconds=1)
    started = time.monotonic()
    with pytest.raises(AgentError, match="worker id 3 is already registered"):
        twin.start()
    assert time.monotonic() - started < 5
    assert store.members()[3].pid == os.getpid()


def test_start_outside_the_main_thread_is_refused(client):
    agent = ParcaeAgent(client, new_job(), 1, GRACE_S, LEASE_S)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(AgentError, agent.start)))
    thread.start()
    thread.join()
    assert "main thread" in str(errors[0].value)


def test_agent_survives_an_etcd_restart(own_etcd):
    server, client = own_etcd
    store = JobStore(client, new_job())
    agent = ParcaeAgent(client, store.keys.job, worker_id=3, grace_seconds=GRACE_S, lease_seconds=LEASE_S)
    agent.start()
    try:
        server.restart()
        assert store.publish_plan(envelope(1, [3]))
        assert wait_for(agent.pending_plan, 10, "the plan published after the restart").generation == 1
        assert not agent.fenced and 3 in store.members()
    finally:
        agent.stop()


WORKER = """
import sys, time
from megatron_parcae.control.agent import ParcaeAgent
from megatron_parcae.control.etcd import EtcdClient
endpoint, job = sys.argv[1], sys.argv[2]
agent = ParcaeAgent(EtcdClient(endpoint), job, worker_id=5, grace_seconds=30, lease_seconds=2)
agent.start()
print("ready", flush=True)
iteration = 0
while not agent.fenced:
    if agent.notice_received:
        print(f"notice {agent.notice_deadline}", flush=True)
        time.sleep(60)
    agent.report_step(iteration, 0.05, 8 * iteration)
    iteration += 1
    time.sleep(0.05)
print("fenced", flush=True)
agent.stop()
sys.exit(3)
"""


def test_sigterm_becomes_a_notice_with_a_deadline(etcd_server, client):
    store = JobStore(client, new_job())
    child = python_child(WORKER, etcd_server.endpoint, store.keys.job)
    try:
        assert child.stdout.readline().strip() == "ready"
        sent_at = time.time()
        child.send_signal(signal.SIGTERM)
        notice = wait_for(lambda: store.notices().get(5), 10, "the notice")
        assert sent_at - 1 < notice.received_at < time.time()
        assert notice.deadline == pytest.approx(notice.received_at + 30)
        assert notice.reason == "SIGTERM"
        assert child.stdout.readline().split() == ["notice", str(notice.deadline)]
        assert child.poll() is None  # SIGTERM does not end the process: it has a grace period
    finally:
        child.kill()
        child.wait()
    wait_for(lambda: not store.members() and not store.notices(), 3 * LEASE_S, "the killed worker's keys to expire")


BUSY_WORKER = """
import sys, time
from megatron_parcae.control.agent import ParcaeAgent
from megatron_parcae.control.etcd import EtcdClient
endpoint, job = sys.argv[1], sys.argv[2]
agent = ParcaeAgent(EtcdClient(endpoint), job, worker_id=6, grace_seconds=30, lease_seconds=2)
agent.start()
print("ready", flush=True)
generation, shown = 0, time.monotonic()
while True:  # wakes the agent thread without pause, as acknowledgements and step reports do
    generation += 1
    agent.acknowledge(generation)
    if time.monotonic() - shown > 0.1:
        print(f"running {generation}", flush=True)
        shown = time.monotonic()
"""


def test_sigterm_while_the_loop_wakes_the_agent_neither_deadlocks_nor_is_lost(etcd_server, client):
    """The handler interrupts the main thread anywhere, also inside the agent's own
    wake-up: SIGTERMs sent while the loop wakes the agent all the time are posted as
    a notice, and the loop goes on."""
    store = JobStore(client, new_job())
    child = python_child(BUSY_WORKER, etcd_server.endpoint, store.keys.job)
    try:
        assert child.stdout.readline().strip() == "ready"
        for _ in range(20):
            child.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        wait_for(lambda: 6 in store.notices(), 10, "the notice")
        lines = queue.SimpleQueue()  # the child's output, read on a thread: a hung child must fail the test
        threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True).start()
        time.sleep(0.5)
        while not lines.empty():
            lines.get()
        later = int(lines.get(timeout=10).split()[1])  # queue.Empty: the loop is stuck
        wait_for(lambda: store.members()[6].generation >= later, 10, "acknowledgements to be published")
    finally:
        child.kill()
        child.wait()


def test_stalled_worker_is_fenced_and_exits_without_writing(etcd_server, client):
    """Issue 7 point 3: SIGSTOP longer than the lease; the member vanishes within the lease,
    and the resumed process sees it is fenced and exits without writing anything."""
    store = JobStore(client, new_job())
    child = python_child(WORKER, etcd_server.endpoint, store.keys.job)
    try:
        assert child.stdout.readline().strip() == "ready"
        wait_for(lambda: 5 in store.step_reports(), 10, "the first step report")
        child.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: not store.members(), 2 * LEASE_S, "the stalled member to expire")
        assert time.monotonic() - stopped_at < 2 * LEASE_S
        assert store.step_reports() == {}
        child.send_signal(signal.SIGCONT)
        assert child.stdout.readline().strip() == "fenced"
        assert child.wait(10) == 3
        assert store.members() == {} and store.step_reports() == {} and store.notices() == {}
    finally:
        child.kill()
        child.wait()


class _NoticeAtOnce:
    """A metadata watcher whose service has already marked the instance."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def start(self, on_notice, stop, on_hint=None) -> None:
        threading.Thread(target=on_notice, args=(Notice("aws", "terminate", self.deadline, time.time()),),
                         daemon=True).start()


def test_a_metadata_notice_is_posted_with_the_providers_deadline(client):
    store = JobStore(client, new_job())
    deadline = time.time() + 95.0  # AWS gives about two minutes, whatever the grace setting says
    agent = ParcaeAgent(client, store.keys.job, worker_id=0, grace_seconds=GRACE_S, lease_seconds=LEASE_S,
                        instance="i-0abc", local_rank=1, notices=_NoticeAtOnce(deadline))
    agent.start()
    try:
        notice = wait_for(lambda: store.notices().get(0), 10, "the notice in etcd")
        assert (notice.instance, notice.reason, notice.deadline) == ("i-0abc", "aws:terminate", deadline)
        assert agent.notice_deadline == deadline and store.members()[0].local_rank == 1
    finally:
        agent.stop()


def test_worker_ids_from_etcd_are_never_handed_out_twice(client):
    store = JobStore(client, new_job())
    ids: list[int] = []
    threads = [threading.Thread(target=lambda: ids.extend(store.allocate_worker_id() for _ in range(20)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids) == list(range(80))
    assert JobStore(client, store.keys.job).allocate_worker_id() == 80  # a later process goes on from there


def test_a_step_record_in_flight_is_written_before_the_worker_deregisters(job_agent):
    agent, store = job_agent
    assert store.publish_plan(envelope(1, [3]))
    agent.acknowledge(1)
    for iteration in range(1, 30):
        agent.record_progress(iteration, 8 * iteration)
    agent.stop()
    assert store.progress().iteration == 29 and store.members() == {}
