"""Transformer Engine only when asked: with no flag a worker runs `local`, even on a GPU
where Transformer Engine imports; each worker states its implementation in its member
record, and the coordinator never puts two in one layout (a job that starts mixed is
refused with one line naming the instances)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import time

import pytest
import torch
from helpers import new_job, wait_for
from test_coordinator import LEASE_S, WAIT_S, coordinator_child, running, wait_generation, write_config

from megatron_parcae.control.agent import ParcaeAgent
from megatron_parcae.control.etcd import JobStore, KeptLease, SchemaError
from megatron_parcae.control.etcd.keys import MemberRecord
from megatron_parcae.control.implementations import MixedImplementations, one_implementation
from megatron_parcae.training.arguments import ArgumentError, parse_args

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def _parse(*extra: str):
    return parse_args([*FLAGS, *extra], prog="pretrain_gpt.py", model="gpt", world_size=1)


@pytest.fixture
def machine(monkeypatch):
    """Say whether Transformer Engine imports and a GPU is present: `machine(te, gpu)`."""

    def make(te: bool, gpu: bool) -> None:
        find_spec = importlib.util.find_spec

        def fake(name, *args, **kwargs):
            if name == "transformer_engine":
                return importlib.machinery.ModuleSpec(name, None) if te else None
            return find_spec(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)

    return make


def test_no_flag_runs_local_even_on_a_gpu_with_transformer_engine(machine):
    machine(te=True, gpu=True)
    assert _parse().transformer_impl == "local"
    assert _parse("--transformer-impl", "local").transformer_impl == "local"
    assert _parse("--transformer-impl", "transformer_engine").transformer_impl == "transformer_engine"


@pytest.mark.parametrize("te, gpu, message", [
    (False, True, "--transformer-impl transformer_engine: Transformer Engine is not installed"),
    (True, False, "--transformer-impl transformer_engine needs a GPU"),
])
def test_transformer_engine_asked_for_where_it_cannot_run_is_a_clear_error(machine, te, gpu, message):
    machine(te=te, gpu=gpu)
    with pytest.raises(ArgumentError, match=message):
        _parse("--transformer-impl", "transformer_engine")
    assert _parse().transformer_impl == "local"


def member(worker: int, impl: str | None, instance: str | None = None) -> MemberRecord:
    return MemberRecord(worker, instance or f"node-{worker}", 1000 + worker, 1.0, 0, transformer_impl=impl)


def test_the_member_record_states_the_implementation_and_refuses_others():
    record = member(0, "transformer_engine")
    assert MemberRecord.decode(record.encode(), "m").transformer_impl == "transformer_engine"
    older = json.loads(record.encode())
    del older["transformer_impl"]  # a record written before the key existed: not said
    assert MemberRecord.from_dict(older, "m").transformer_impl is None
    with pytest.raises(SchemaError, match=r"transformer_impl: 'te' is not one of local, transformer_engine"):
        MemberRecord.from_dict({**older, "transformer_impl": "te"}, "m")
    with pytest.raises(SchemaError, match="expected str, got int"):
        MemberRecord.from_dict({**older, "transformer_impl": 1}, "m")
    with pytest.raises(SchemaError, match="transformer_impl"):
        ParcaeAgent(None, "job", 0, grace_seconds=1, lease_seconds=1, transformer_impl="te")  # before any etcd


def test_one_implementation_keeps_the_layouts_and_refuses_a_mixed_start():
    same = {0: member(0, "local"), 1: member(1, "local"), 2: member(2, None)}
    assert one_implementation(same, frozenset()) == (same, "")
    mixed = {0: member(0, "local", "a"), 1: member(1, "transformer_engine", "b"),
             2: member(2, "transformer_engine", "c"), 3: member(3, None, "d")}
    with pytest.raises(MixedImplementations) as refused:
        one_implementation(mixed, frozenset())
    line = str(refused.value)
    assert "\n" not in line
    assert ("workers state different transformer implementations: local on instances [a]; "
            "transformer_engine on instances [b, c]; the job is refused") in line
    with pytest.raises(MixedImplementations):
        one_implementation(mixed, frozenset({3}))  # its one worker states none: no implementation to keep
    kept, why = one_implementation(mixed, frozenset({1, 2}))
    assert set(kept) == {1, 2, 3} and "the layout runs transformer_engine, the others are left out" in why
    kept, why = one_implementation(mixed, frozenset({0}))
    assert set(kept) == {0, 3} and "transformer_engine on instances [b, c]" in why
    many = {w: member(w, "local" if w else "transformer_engine", f"n{w:02}") for w in range(20)}
    with pytest.raises(MixedImplementations, match=r"local on instances \[n01, .*n08, \.\.\. 19 in all\]"):
        one_implementation(many, frozenset())


class Worker:
    """A member record on its own lease stating `impl`."""

    def __init__(self, store: JobStore, worker: int, impl: str) -> None:
        self.store, self.lease = store, KeptLease(store.client, LEASE_S)
        self.record = MemberRecord(worker, f"node-{worker}", 1000 + worker, time.time(), 0, transformer_impl=impl)
        assert store.register_member(self.record, self.lease.id) is not None

    def acknowledge(self, generation: int) -> None:
        self.record = MemberRecord(**{**self.record.to_dict(), "generation": generation})
        assert self.store.update_member(self.record, self.lease.id)


@pytest.fixture
def workers(client):
    made: list[Worker] = []
    yield JobStore(client, new_job()), made
    for worker in made:
        worker.lease.revoke()


def test_a_job_whose_workers_state_different_implementations_is_refused(etcd_server, workers, tmp_path):
    """A real `parcae coordinator`: one line naming the instances, exit status 2, no plan."""
    store, made = workers
    made += [Worker(store, 0, "local"), Worker(store, 1, "transformer_engine")]
    log = tmp_path / "coordinator.log"
    child = coordinator_child(etcd_server.endpoint, store.keys.job, write_config(tmp_path, **{"min-workers": 2}), log)
    try:
        rc = child.wait(60)  # a bound on a hang only: it exits as soon as it has read the members
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    text = log.read_text()
    assert rc == 2 and "Traceback" not in text
    lines = [line for line in text.splitlines() if "transformer implementations" in line]
    assert lines == ["parcae coordinator: error: workers state different transformer implementations: local on "
                     "instances [node-0]; transformer_engine on instances [node-1]; the job is refused: start every "
                     "worker with the same --transformer-impl"]
    assert store.current_generation() == 0 and store.leader() is None  # no plan; it resigned


def test_a_worker_of_another_implementation_is_left_out_of_the_running_layout(workers, tmp_path, caplog):
    store, made = workers
    made += [Worker(store, w, "local") for w in range(3)]
    with running(store, write_config(tmp_path, **{"min-workers": 3})):
        assert wait_generation(store, 1).workers == {0, 1, 2}
        made += [Worker(store, 3, "transformer_engine"), Worker(store, 4, "local")]
        for worker in made[:3]:
            worker.acknowledge(1)
        assert wait_generation(store, 2).workers == {0, 1, 2, 4}
        wait_for(lambda: "the layout runs local, the others are left out" in caplog.text, WAIT_S, "the warning")
    assert "transformer_engine on instances [node-3]" in caplog.text


def test_an_agent_states_its_implementation_in_its_member_record(workers):
    store, _ = workers
    agent = ParcaeAgent(store.client, store.keys.job, 7, grace_seconds=1, lease_seconds=LEASE_S,
                        transformer_impl="transformer_engine")
    agent.start()
    try:
        assert store.members()[7].transformer_impl == "transformer_engine"
    finally:
        agent.stop()
