"""The coordinator against a real etcd: first plan, notices, arrivals, lost and restarted
workers, leadership, SIGKILL and restart from etcd alone, bad config, etcd unreachable.

Workers are member records on their own leases (`Worker`), or real `ParcaeAgent`s in
child processes where a signal must become a notice. The profile is a 4-layer GPT layer
profile on which more workers train faster, so liveput grows the layout when it can.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import envelope, new_job, python_child, wait_for
from helpers import SHAPE as MODEL

from megatron_parcae import cli
from megatron_parcae.control.coordinator import MAX_RETRIES, ConfigError, Coordinator, CoordinatorConfig
from megatron_parcae.control.etcd import JobStore, KeptLease, SchemaError
from megatron_parcae.control.etcd.client import KeyValue
from megatron_parcae.control.etcd.keys import SAVE_AND_EXIT, TRAIN, CoordinatorState, MemberRecord, NoticeRecord
from megatron_parcae.control.etcd.keys import ChangeReport, NetworkRecord, StepReport
from megatron_parcae.control.status import collect, render
from megatron_parcae.events import EventWriter, MigrationCostLearned, NetworkMeasured, ThroughputLearned, read_events
from megatron_parcae.events import PlanPublished
from megatron_parcae.liveput.cost import DEFAULT_CONSTANTS, MigrationCostModel
from reconfig.layout import Layout, Parallelism
from reconfig.plan import MigrationPlan, MigrationRequest, plan_migration

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
         "vocab_size": 128, "max_position_embeddings": 32}
UNIT = {"forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 0.5, "activation_bytes": 1e6, "output_bytes": 1e5}
PROFILE = {"format": "megatron-parcae-layer-profile", "version": 1, "model": "tiny", "device": "test",
           "micro_batch_size": 1, "global_batch_size": 8, "gpu_memory_bytes": 1e9, "link_bytes_per_second": 1.25e9,
           "tensor_parallel_bytes_per_second": 1e11, "max_tensor_parallel": 1, "memory_bytes_per_param": 16,
           "gradient_bytes_per_param": 2, "model_shape": SHAPE, "embedding": UNIT, "layers": [UNIT] * 4, "head": UNIT}
WAIT_S = 15.0
# The coordinator's and the stand-in workers' leases. Longer than etcd's shortest: on two
# cores shared by three test processes and their children, this process can stall past 2 s.
LEASE_S = 4.0


def write_config(folder: Path, **overrides) -> Path:
    """A coordinator config with the tiny profile; 30 s intervals unless overridden."""
    (folder / "tiny.json").write_text(json.dumps(PROFILE))
    config = {"profile": "tiny.json", "interval-seconds": 30, "lookahead": 4, "grace-seconds": 20,
              "lease-seconds": LEASE_S, "max-workers": 8, **overrides}
    path = folder / "coordinator.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Worker:
    """A member record on its own lease, standing in for a training process."""

    def __init__(self, store: JobStore, worker_id: int, pid: int | None = None, instance: str | None = None,
                 can_save: bool = False, model: dict | None = None, failure_domain: str | None = None) -> None:
        self.store, self.worker_id = store, worker_id
        self.lease = KeptLease(store.client, LEASE_S)
        self.record = MemberRecord(worker_id, instance or f"node-{worker_id}", pid or 1000 + worker_id, time.time(), 0,
                                   can_save=can_save, model=model, failure_domain=failure_domain)
        assert store.register_member(self.record, self.lease.id) is not None

    def acknowledge(self, generation: int) -> None:
        self.record = MemberRecord(**{**self.record.to_dict(), "generation": generation})
        assert self.store.update_member(self.record, self.lease.id)

    def broke(self, generation: int, state_kept: bool, state_of: int | None = None) -> None:
        """The WORLD of `generation` failed under this worker (as LiveReconfiguration reports it);
        `state_of`: the generation of the layout whose state it kept, if not `generation`'s."""
        self.record = MemberRecord(**{**self.record.to_dict(), "generation": generation, "broken": generation,
                                      "state_kept": state_kept, "state_of": state_of})
        assert self.store.update_member(self.record, self.lease.id)

    def notice(self, deadline_in: float) -> None:
        now = time.time()
        deadline = now + deadline_in
        notice = NoticeRecord(self.worker_id, self.record.instance, "test", min(now, deadline), deadline)
        assert self.store.post_notice(notice, self.lease.id)

    def vanish(self) -> None:
        self.lease.revoke()


@contextlib.contextmanager
def running(store: JobStore, config: Path, name: str = "coordinator", scalars=None, events: Path | None = None):
    """A Coordinator serving in a thread of this process."""
    loaded = CoordinatorConfig.load(config)
    coordinator = Coordinator(store, loaded, loaded.optimizer(), name, EventWriter(events), scalars)
    thread = threading.Thread(target=coordinator.serve, name=name, daemon=True)
    thread.start()
    try:
        yield coordinator
    finally:
        coordinator.stop()
        thread.join(10)
        assert not thread.is_alive(), f"{name} did not stop"


def wait_generation(store: JobStore, generation: int) -> Layout:
    wait_for(lambda: store.current_generation() >= generation, WAIT_S, f"generation {generation}")
    assert store.current_generation() == generation, "more generations than expected"
    return Layout.from_dict(store.plan(generation).layout)


def decision(store: JobStore, generation: int) -> dict:
    """The coordinator's record of why it published `generation` (saved just after the plan)."""
    wait_for(lambda: store.coordinator_state().decisions[-1]["generation"] >= generation, WAIT_S, f"decision {generation}")
    return store.coordinator_state().decisions[-1]


def migration(store: JobStore, generation: int) -> MigrationPlan:
    return MigrationPlan.from_dict(store.plan(generation).migration)


@pytest.fixture
def job(client, tmp_path):
    store = JobStore(client, new_job())
    workers: list[Worker] = []
    yield store, workers, tmp_path
    for worker in workers:
        worker.lease.revoke()


def test_first_plan_covers_the_initial_members_and_a_notice_removes_a_worker(etcd_server, job):
    store, workers, tmp_path = job
    config = write_config(tmp_path, **{"min-workers": 3})
    workers += [Worker(store, 0), Worker(store, 1)]
    agent = python_child(AGENT, etcd_server.endpoint, store.keys.job, "2")  # a real agent, for SIGTERM
    try:
        assert agent.stdout.readline().strip() == "ready"
        with running(store, config):
            first = wait_generation(store, 1)
            assert first.workers == {0, 1, 2} and store.plan(1).migration is None
            assert agent.stdout.readline().strip() == "applied 1"
            agent.send_signal(signal.SIGTERM)
            second = wait_generation(store, 2)
            assert 2 not in second.workers and second.workers <= {0, 1}
            plan = migration(store, 2)
            assert plan.request.leaving == {2} and plan.request.survivors == {0, 1}
            decision(store, 2)  # the state is saved just after the plan
            state = store.coordinator_state()
            assert [d["generation"] for d in state.decisions] == [1, 2]
            assert state.decisions[0]["kind"] == "start" and "notice from workers [2]" in state.decisions[1]["reason"]
            assert set(state.admitted) == {str(w) for w in second.workers}
    finally:
        agent.kill()
        agent.wait()
    status = collect(store)
    assert status["generation"] == 2 and status["layout"] == second.to_dict()
    assert render(status).startswith(f"job {store.keys.job}: generation 2")


AGENT = """
import sys
import time
from megatron_parcae.control.agent import ParcaeAgent
from megatron_parcae.control.etcd import EtcdClient
endpoint, job, worker = sys.argv[1], sys.argv[2], int(sys.argv[3])
agent = ParcaeAgent(EtcdClient(endpoint), job, worker_id=worker, grace_seconds=20, lease_seconds=2)
agent.start()
print("ready", flush=True)
while True:
    plan = agent.pending_plan()
    if plan is not None:
        agent.acknowledge(plan.generation)
        print(f"applied {plan.generation}", flush=True)
    time.sleep(0.05)
"""


def test_each_interval_charts_availability_forecast_and_liveput_at_the_jobs_iteration(job):
    """tensorboard-dir: read back with TensorBoard's reader, at the iteration the job's
    progress record says (the step the workers' own scalars use)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_parcae.control.etcd.keys import ProgressRecord
    from megatron_parcae.scalars.tensorboard_backend import TensorBoardBackend

    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]
    board = tmp_path / "board"
    config = write_config(tmp_path, **{"interval-seconds": 1, "tensorboard-dir": "board"})
    assert CoordinatorConfig.load(config).tensorboard_dir == board
    scalars = TensorBoardBackend(str(board))
    try:
        with running(store, config, "charting", scalars):
            first = wait_generation(store, 1)
            for worker in workers:
                worker.acknowledge(1)
            writer = min(first.workers)
            assert store.record_progress(ProgressRecord(1, 7, 56, time.time()), writer, workers[writer].lease.id)
            time.sleep(3.5)
    finally:
        scalars.close()
    reader = EventAccumulator(str(board), size_guidance={"scalars": 0})
    reader.Reload()
    charted = {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}
    assert set(charted) == {"parcae/available-instances", "parcae/forecast-instances",
                            "parcae/liveput-samples-per-second"}
    assert {value for _, value in charted["parcae/available-instances"]} == {2.0}
    assert all(value == pytest.approx(2.0) for _, value in charted["parcae/forecast-instances"])
    assert all(value > 0 for _, value in charted["parcae/liveput-samples-per-second"])
    assert 7 in {step for step, _ in charted["parcae/available-instances"]}


def test_arrival_grows_the_layout_once_the_current_one_is_applied(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(3)]
    events = tmp_path / "coordinator.events.jsonl"
    with running(store, write_config(tmp_path, **{"min-workers": 3}), events=events):
        first = wait_generation(store, 1)
        assert len(first.workers) == 3
        workers.append(Worker(store, 3))
        time.sleep(1.0)  # the arrival is seen at once, but the first plan is not applied yet
        assert store.current_generation() == 1
        for worker in workers[:3]:
            worker.acknowledge(1)
        grown = wait_generation(store, 2)
        assert grown.workers == {0, 1, 2, 3}
        plan = migration(store, 2)
        assert plan.request.joining == {3} and plan.request.survivors == {0, 1, 2}
        assert "workers [3] join" in decision(store, 2)["reason"]
        # The new layout's rank 0 reports the phases the change took: the costs are refitted.
        phases = {"export": 0.01, "world": 0.3, "exchange": 0.02, "build": 2.0, "import": 0.01}
        rank0 = workers[grown.slots[0]]
        assert store.report_change(ChangeReport(2, plan.kind, phases), rank0.worker_id, rank0.lease.id)
        learned = wait_for(lambda: [e for e in read_events(events) if isinstance(e, MigrationCostLearned)],
                           WAIT_S, "the migration costs refitted")
        assert (learned[0].generation, learned[0].reports) == (2, 1)
        assert learned[0].measured_seconds == pytest.approx(sum(phases.values()))
        assert learned[0].fitted_seconds != pytest.approx(learned[0].prior_seconds, rel=0.01)


def test_step_reports_of_the_running_layout_correct_its_predicted_time(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]
    config = CoordinatorConfig.load(write_config(tmp_path, **{"max-workers": 1, "interval-seconds": 1}))
    events = tmp_path / "coordinator.events.jsonl"
    optimizer = config.optimizer()
    coordinator = Coordinator(store, config, optimizer, "learner", EventWriter(events))
    thread = threading.Thread(target=coordinator.serve, daemon=True)
    thread.start()
    try:
        first = wait_generation(store, 1)
        layout, (running_worker,) = first.parallelism, first.workers
        for worker in workers:
            worker.acknowledge(1)
        prior = 8 / optimizer.throughput.samples_per_second(layout)
        for iteration, factor in enumerate((3.0, 3.2, 20.0), start=10):  # the median ignores the outlier
            for worker in workers:  # the standby worker's reports do not measure the layout
                seconds = factor * prior if worker.worker_id == running_worker else 50 * prior
                report = StepReport(worker.worker_id, 1, iteration, seconds, 5, 8 * iteration, time.time())
                assert store.report_step(report, worker.lease.id)
            time.sleep(1.2)  # one interval boundary reads each report
        stale = StepReport(running_worker, 0, 99, 100 * prior, 5, 0, time.time())  # another generation's
        assert store.report_step(stale, workers[running_worker].lease.id)
        time.sleep(1.2)
    finally:
        coordinator.stop()
        thread.join(10)
    learned = [e for e in read_events(events) if isinstance(e, ThroughputLearned)]
    assert learned and learned[0].prior_seconds == pytest.approx(prior)
    assert (learned[-1].tp, learned[-1].pp, learned[-1].dp) == (layout.tp, layout.pp, layout.dp)
    assert learned[-1].reports == 3 and learned[-1].intervals == len(learned) == 3
    assert learned[-1].predicted_seconds == pytest.approx(3.2 * prior)


class MemoryEtcd:
    """The reads a coordinator's cost fit makes of etcd, from a dict of JSON payloads."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def get(self, key: str) -> KeyValue | None:
        return KeyValue(key, self.values[key], 1, 1, 1, 0) if key in self.values else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [self.get(key) for key in sorted(self.values) if key.startswith(prefix)]


def test_reported_phases_refit_the_migration_costs_the_coordinator_plans_with(tmp_path):
    """Two changes' measured phases bring the coordinator's predictions of both from what
    the cost constants say to what was measured; a change whose WORLD broke, or whose
    plan is gone, is left out; each new report gets its event."""
    client, events = MemoryEtcd(), tmp_path / "coordinator.events.jsonl"
    store = JobStore(client, new_job())
    config = CoordinatorConfig.load(write_config(tmp_path))
    coordinator = Coordinator(store, config, config.optimizer(), "unit", EventWriter(events))
    grown = envelope(2, [0, 1, 2], previous=[0, 1])  # D 2 -> 3, a worker joins
    plans = {2: MigrationPlan.from_dict(grown.migration)}
    plans[3] = plan_migration(MigrationRequest(plans[2].new, plans[2].new.workers, frozenset(), frozenset()),
                              Parallelism.even(4, 1, 2, 1), MODEL)  # P 1 -> 2
    plans[4] = plans[3]  # its WORLD broke
    default = coordinator._optimizer.costs
    truth = MigrationCostModel(default.constants, default.shape, {  # how this job's changes go
        "export": {"bytes": 2e-9}, "world": {"changes": 0.4}, "exchange": {"bytes": 3e-8},
        "build": {"groups": 0.2, "parameters": 2e-6}, "import": {"bytes": 1e-9}})
    measured = {g: truth.phase_seconds(plan) for g, plan in plans.items()}
    for generation, plan in plans.items():
        client.values[store.keys.plan(generation)] = dataclasses.replace(
            grown, generation=generation, layout=plan.new.to_dict(), migration=plan.to_dict()).encode()
    for generation, plan in [*plans.items(), (9, plans[2])]:  # no plan of 9 is kept
        report = ChangeReport(generation, plan.kind, truth.phase_seconds(plan))
        client.values[store.keys.change(generation)] = report.encode()
    members = {0: MemberRecord(0, "node-0", 1000, 1.0, 4, broken=4, state_kept=True)}

    def refit() -> None:  # as the watch on the change reports has the coordinator do
        coordinator._changes_reported.set()
        coordinator._refit(members)

    coordinator._changes = {}  # it read before the reports came
    refit()
    costs = coordinator._optimizer.costs
    for generation in (2, 3):
        plan, seconds = plans[generation], sum(measured[generation].values())
        assert default.plan_cost(plan).seconds != pytest.approx(seconds, rel=0.1)
        assert costs.plan_cost(plan).seconds == pytest.approx(seconds)
    learned = read_events(events)
    assert [(e.generation, e.kind, e.reports) for e in learned] == [(2, plans[2].kind, 2), (3, "pipeline", 2)]
    for event in learned:
        assert isinstance(event, MigrationCostLearned)
        assert event.measured_seconds == pytest.approx(sum(measured[event.generation].values()))
        assert event.predicted_seconds == event.prior_seconds == pytest.approx(
            sum(default.phase_seconds(plans[event.generation]).values()))
        assert event.fitted_seconds == pytest.approx(event.measured_seconds)
    refit()  # nothing new: no event, same costs
    assert len(read_events(events)) == 2 and coordinator._optimizer.costs.phase_rates == costs.phase_rates


@pytest.mark.parametrize("profile", ["tiny.json", "tiny.csv"])
def test_the_network_the_workers_measured_prices_links_and_transfers(tmp_path, profile):
    """Once the record is in etcd the coordinator plans with it: a layer profile's link
    (pipeline and data-parallel traffic) and the cost model's messages between instances
    take the measured figures; a throughput table keeps its own throughputs. One event says so."""
    client, events = MemoryEtcd(), tmp_path / "coordinator.events.jsonl"
    store = JobStore(client, new_job())
    write_tables(tmp_path)
    path = write_config(tmp_path) if profile == "tiny.json" else table_config(tmp_path, profile, 2)
    config = CoordinatorConfig.load(path)
    coordinator = Coordinator(store, config, config.optimizer(), "unit", EventWriter(events))
    before = coordinator._optimizer
    coordinator._use_network()  # nothing measured yet
    assert coordinator._optimizer is before and not events.exists()
    record = NetworkRecord(1, "node-0", "node-1", 2**22, 3e-4, 2e8, time.time())
    client.values[store.keys.network] = record.encode()
    coordinator._use_network()
    after = coordinator._optimizer
    assert after.costs.constants.transfer_seconds(2**30) == pytest.approx(3e-4 + 2**30 / 2e8)
    assert before.costs.constants.transfer_seconds(2**30) == pytest.approx(1198255.9e-6)  # the constants' table
    two = next(p for p in before.throughput.layouts() if p.world_size == 2)
    (event,) = read_events(events)
    assert isinstance(event, NetworkMeasured) and event.instances == ("node-0", "node-1")
    assert (event.generation, event.latency_seconds, event.bytes_per_second) == (1, 3e-4, 2e8)
    assert event.transfer_bytes_per_second == pytest.approx(2e8, rel=1e-3)
    assert event.prior_transfer_bytes_per_second == pytest.approx(2**30 / 1198255.9e-6)
    if profile == "tiny.json":  # slower than the profile's 1.25e9: layouts that talk over it lose
        assert (event.link_bytes_per_second, event.prior_link_bytes_per_second) == (2e8, 1.25e9)
        assert after.throughput.link_bytes_per_second == 2e8
        assert after.throughput.samples_per_second(two) < before.throughput.samples_per_second(two)
    else:
        assert event.link_bytes_per_second is event.prior_link_bytes_per_second is None
        assert after.throughput.samples_per_second(two) == before.throughput.samples_per_second(two)
    coordinator._use_network()  # read once
    assert len(read_events(events)) == 1 and coordinator._optimizer is after


def test_instances_of_two_gpus_go_and_come_whole(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w, instance="abcd"[w // 2]) for w in range(8)]  # a: 0 1, b: 2 3, ...

    def whole_instances(layout: Layout) -> bool:
        return all(layout.slots[r] // 2 == layout.slots[r + 1] // 2 for r in range(0, len(layout.slots), 2))

    with running(store, write_config(tmp_path, **{"min-workers": 8, "gpus-per-instance": 2})):
        first = wait_generation(store, 1)
        assert whole_instances(first), first.slots
        for worker in workers:
            worker.acknowledge(1)
        noticed = first.slots[2]  # one worker hears the notice: its whole instance leaves
        sibling = noticed ^ 1
        workers[noticed].notice(20.0)
        second = wait_generation(store, 2)
        plan = migration(store, 2)
        assert plan.request.leaving == {noticed, sibling} and not second.workers & {noticed, sibling}
        assert plan.request.placement.gpus_per_instance == 2 and whole_instances(second)
        assert f"notice from workers {sorted([noticed, sibling])}" in decision(store, 2)["reason"]
        for worker in second.workers:
            workers[worker].acknowledge(2)
        gone = second.slots[0]  # lost without notice: its sibling goes with the instance
        workers[gone].vanish()
        third = wait_generation(store, 3)
        # A migration, or a restart where the instance held every replica of a stage.
        assert not third.workers & {gone, gone ^ 1}
        assert f"lost workers {sorted([gone, gone ^ 1])}" in decision(store, 3)["reason"]
        wait_for(lambda: gone ^ 1 not in store.members(), WAIT_S, "the sibling fenced with its instance")


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_published_copy_holders_are_in_another_failure_domain(job, gpus):
    store, workers, tmp_path = job
    # Instances node-0 and node-1 in zone a, node-2 and node-3 in zone b: in rank order,
    # half of the buddies would share their zone.
    workers += [Worker(store, w, instance=f"node-{w // gpus}", failure_domain="ab"[w // (2 * gpus)])
                for w in range(4 * gpus)]
    zone = {worker.worker_id: worker.record.failure_domain for worker in workers}
    with running(store, write_config(tmp_path, **{"min-workers": 4 * gpus, "gpus-per-instance": gpus})):
        first = wait_generation(store, 1)
        holders = store.plan(1).holders()
    assert first.workers == set(zone)
    assert sorted(holders) == sorted(holders.values()) == sorted(zone)
    assert all(zone[w] != zone[h] and w // gpus != h // gpus for w, h in holders.items()), holders


GQA = {**SHAPE, "num_query_groups": 1}  # SHAPE under --group-query-attention --num-query-groups 1


def write_tables(folder: Path) -> None:
    """Cost constants that know SHAPE as "tiny", and throughput tables of it: tiny.csv
    runs best at T=2, tp2.csv has only T=2."""
    constants = json.loads(DEFAULT_CONSTANTS.read_text())
    (folder / "constants.json").write_text(json.dumps({**constants, "models": {"tiny": SHAPE}}))
    header = "# model=tiny global_batch_size=8\ndata_parallel,pipeline_stages,iteration_ms,samples_per_s,tensor_parallel\n"
    (folder / "tiny.csv").write_text(header + "1,1,1000,8,1\n2,1,800,10,1\n1,1,200,40,2\n")
    (folder / "tp2.csv").write_text(header + "1,1,200,40,2\n")


def table_config(folder: Path, profile: str, workers: int, **overrides) -> Path:
    """A coordinator on a table of `write_tables`, for one instance of `workers` GPUs."""
    return write_config(folder, profile=profile, model="tiny", **{
        "cost-constants": "constants.json", "min-workers": workers, "gpus-per-instance": workers, **overrides})


def test_a_table_is_planned_only_in_layouts_the_workers_model_can_be_built_in(job, caplog):
    """A CSV table takes its shape from the cost constants, which know nothing of
    --num-query-groups: the members' records say which model they train."""
    store, workers, tmp_path = job
    write_tables(tmp_path)

    @contextlib.contextmanager
    def members(profile: str, *models: dict | None):
        """A new job of workers training `models` (None: an older worker's record), led
        by a coordinator on `profile`."""
        job = JobStore(store.client, new_job())
        workers.extend(Worker(job, w, instance="node", model=m) for w, m in enumerate(models))
        with running(job, table_config(tmp_path, profile, len(models))):
            yield job

    def first_tp(profile: str, *models: dict | None) -> int:
        with members(profile, *models) as job:
            return wait_generation(job, 1).tp

    assert first_tp("tiny.csv", SHAPE, SHAPE) == first_tp("tiny.csv", None, None) == 2
    assert first_tp("tiny.csv", GQA, GQA) == first_tp("tiny.csv", GQA, None) == 1
    assert first_tp("tiny.csv", SHAPE, GQA) == 1
    assert "workers train different models: workers [0] num_query_groups=None; workers [1] num_query_groups=1" \
        in caplog.text
    why = ("profile of tiny: no layout of it can train the workers' model: --num-query-groups 1 is not divisible "
           "by tensor-parallel size 2; waiting for workers of a model it can train")
    with members("tp2.csv", GQA, GQA) as job:
        wait_for(lambda: why in caplog.text, WAIT_S, "the coordinator to say why it cannot plan")
        time.sleep(1.0)
        assert job.current_generation() == 0
    assert caplog.text.count(why) == 1


def test_a_table_corrected_by_step_reports_still_keeps_to_the_workers_model(job):
    """Steps ten times slower than the table says make the T=2 layout the table rates
    highest look better still; the workers' model cannot be built in it."""
    store, workers, tmp_path = job
    write_tables(tmp_path)
    workers += [Worker(store, w, instance="node", model=GQA) for w in range(2)]
    with running(store, table_config(tmp_path, "tiny.csv", 2, **{"interval-seconds": 1, "lookahead": 30})):
        first = wait_generation(store, 1)
        assert (first.tp, first.dp) == (1, 2)
        for worker in workers:
            worker.acknowledge(1)
        for iteration in range(10, 14):
            for worker in workers:
                report = StepReport(worker.worker_id, 1, iteration, 8.0, 5, 8 * iteration, time.time())
                assert store.report_step(report, worker.lease.id)
            time.sleep(1.2)  # one interval boundary learns from each report
        assert store.current_generation() == 1


def test_lost_worker_and_restarted_process_are_dropped(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(4)]
    with running(store, write_config(tmp_path, **{"min-workers": 4})):
        layout = wait_generation(store, 1)
        assert layout.workers == {0, 1, 2, 3}
        for worker in workers:
            worker.acknowledge(1)
        workers[3].vanish()  # killed without notice
        layout = wait_generation(store, 2)
        assert layout.workers <= {0, 1, 2} and migration(store, 2).request.lost == {3}
        for worker in workers[:3]:
            worker.acknowledge(2)
        # worker 1's process dies and a new one registers under the same id at once:
        # its state is gone, so it may not keep its slot as a survivor
        workers[1].vanish()
        workers[1] = Worker(store, 1, pid=4242)
        wait_for(lambda: store.current_generation() >= 3, WAIT_S, "a generation without the old worker 1")
        assert "lost workers [1]" in decision(store, 3)["reason"]
        plan = store.plan(3).migration  # None: layers were lost, the job resumes from a checkpoint
        assert plan is None or 1 not in MigrationPlan.from_dict(plan).request.survivors


def test_broken_world_waits_for_every_live_worker_then_recovers(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(4)]
    with running(store, write_config(tmp_path, **{"min-workers": 4})):
        assert wait_generation(store, 1).workers == {0, 1, 2, 3}
        for worker in workers:
            worker.acknowledge(1)
        # a collective timed out with nobody lost: the same layout is re-formed in place,
        # once the last live worker has reported
        for worker in workers[:3]:
            worker.broke(1, state_kept=True)
        time.sleep(1.0)
        assert store.current_generation() == 1
        workers[3].broke(1, state_kept=True)
        layout = wait_generation(store, 2)
        plan = migration(store, 2)
        assert layout == Layout.from_dict(store.plan(1).layout) and not plan.transfers and not plan.request.lost
        assert "WORLD broke under workers [0, 1, 2, 3]" in decision(store, 2)["reason"]
        for worker in workers:
            worker.acknowledge(2)
        # a worker killed without notice: the others report, its lease ends, state moves in place
        for worker in workers[:3]:
            worker.broke(2, state_kept=True)
        workers[3].vanish()
        layout = wait_generation(store, 3)
        assert layout.workers <= {0, 1, 2} and migration(store, 3).request.lost == {3}
        for worker in workers[:3]:
            worker.acknowledge(3)
        # one of them broke mid-change, its state gone: the job resumes from its checkpoint
        workers[0].broke(3, state_kept=False)
        for worker in workers[1:3]:
            worker.broke(3, state_kept=True)
        wait_generation(store, 4)
        assert store.plan(4).migration is None and decision(store, 4)["kind"] == "restart"
        assert "some mid-change" in decision(store, 4)["reason"]


@pytest.mark.parametrize("dropped, lost_first, sharded",
                         [(False, False, False), (True, False, False), (True, False, True), (False, True, True)],
                         ids=["kept", "dropped", "dropped-sharded", "lost-before-reports"])
def test_a_growth_broken_mid_change_is_retried_from_the_state_the_old_workers_kept(job, dropped, lost_first, sharded):
    """A joiner killed while the layout grows: the old layout's workers kept its state, so
    the change is planned again from that layout without the joiner (the other joiner,
    which held nothing, is just available). Where one of them dropped its state, the
    retry leaves it out too and refills its slot from its replica; with the distributed
    optimizer its moments have none, and the job restarts. When the joiner's loss is seen
    before the others report, and planning from the grown layout would restart, the
    coordinator waits for them."""
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]
    events = tmp_path / "coordinator.events.jsonl"
    # The distributed optimizer: a slot's optimizer state is held by its worker alone.
    config = write_config(tmp_path, **{"min-workers": 2, "distributed-optimizer": sharded})
    with running(store, config, events=events):
        first = wait_generation(store, 1)
        workers += [Worker(store, 2), Worker(store, 3)]  # the growth waits for the first plan's acknowledgements
        for worker in workers[:2]:
            worker.acknowledge(1)
        assert wait_generation(store, 2).workers == {0, 1, 2, 3}
        if lost_first:
            workers[3].vanish()
            time.sleep(1.5)
            assert store.current_generation() == 2, "planned from a layout the change never formed"
        workers[0].broke(2, state_kept=not dropped, state_of=0 if dropped else 1)
        workers[1].broke(2, state_kept=True, state_of=1)
        workers[2].broke(2, state_kept=False, state_of=0)
        if not lost_first:
            workers[3].vanish()
        retried = wait_generation(store, 3)
        if dropped and sharded:  # worker 0's state is gone and the first layout keeps no snapshots
            assert store.plan(3).migration is None and "some mid-change" in decision(store, 3)["reason"]
            return
        plan = migration(store, 3)
        kept = {1} if dropped else {0, 1}  # worker 0, alive, dropped its state: refilled from worker 1
        assert plan.request.old == first and plan.request.survivors == kept and 3 not in retried.workers
        assert retried.workers.isdisjoint({0} - kept)
        assert "mid-change: retried from the state the workers kept" in decision(store, 3)["reason"]
        published = wait_for(lambda: [e for e in read_events(events) if isinstance(e, PlanPublished)
                                      and e.generation == 3], WAIT_S, "the plan's event")[0]
        assert (published.recovery, published.lost) == ("replicas", (3,))


def test_a_change_that_keeps_breaking_is_retried_at_most_max_retries_times(job):
    """A growth that breaks every time, nobody lost (a failure that recurs): retried from
    the old layout's kept state MAX_RETRIES times, then the job restarts from its checkpoint
    instead of looping."""
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]
    with running(store, write_config(tmp_path, **{"min-workers": 2})):
        wait_generation(store, 1)
        workers += [Worker(store, 2), Worker(store, 3)]
        for worker in workers[:2]:
            worker.acknowledge(1)
        generation = 2
        for attempt in range(MAX_RETRIES + 1):
            assert wait_generation(store, generation).workers == {0, 1, 2, 3}
            for worker in workers[:2]:
                worker.broke(generation, state_kept=True, state_of=1)
            for worker in workers[2:]:
                worker.broke(generation, state_kept=False, state_of=0)
            generation += 1
            wait_generation(store, generation)
            retried = "mid-change: retried from the state the workers kept" in decision(store, generation)["reason"]
            assert retried == (attempt < MAX_RETRIES), (attempt, decision(store, generation))
        assert store.plan(generation).migration is None and decision(store, generation)["kind"] == "restart"


def test_a_rollback_to_snapshots_that_keeps_breaking_is_retried_at_most_max_retries_times(job):
    """Rank 0's record names snapshots no worker holds whole (one was lost while they were
    being replaced): every rollback to them breaks, nobody lost. After MAX_RETRIES retries
    the job restarts from its checkpoint instead of looping."""
    from megatron_parcae.control.etcd.keys import ProgressRecord

    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(4)]
    with running(store, write_config(tmp_path, **{"min-workers": 3})):
        wait_generation(store, 1)
        for worker in workers:
            worker.acknowledge(1)
        assert store.record_progress(ProgressRecord(1, 10, 80, time.time(), copies=1), 0, workers[0].lease.id)
        for worker in workers[:3]:
            worker.broke(1, state_kept=False, state_of=0)
        workers[3].vanish()
        generation = 2
        for attempt in range(MAX_RETRIES + 1):
            wait_generation(store, generation)
            assert migration(store, generation).request.copies.generation == 1, (attempt, decision(store, generation))
            for worker in workers[:3]:
                worker.broke(generation, state_kept=False, state_of=0)
            generation += 1
        wait_generation(store, generation)
        assert store.plan(generation).migration is None and decision(store, generation)["kind"] == "restart"


def test_member_whose_notice_expired_is_dropped_and_fenced(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(3)]
    with running(store, write_config(tmp_path, **{"min-workers": 3})):
        wait_generation(store, 1)
        workers[0].notice(deadline_in=-1.0)  # its grace period is over: it cannot send state
        layout = wait_generation(store, 2)
        assert 0 not in layout.workers
        wait_for(lambda: workers[0].lease.lost, WAIT_S, "worker 0's lease to be revoked")
        assert 0 not in store.members() and {1, 2} <= set(store.members())


def test_job_leaving_at_once_saves_and_exits_then_resumes_on_new_workers(job):
    store, workers, tmp_path = job
    workers += [Worker(store, w, can_save=True) for w in range(3)]
    with running(store, write_config(tmp_path, **{"min-workers": 3})):
        first = wait_generation(store, 1)
        for worker in workers:
            worker.acknowledge(1)
        # not every worker leaves: the others take the state over, as they always did
        leaving = first.slots[0]
        workers[leaving].notice(20.0)
        second = wait_generation(store, 2)
        assert store.plan(2).action == TRAIN and migration(store, 2).request.leaving == {leaving}
        for worker in second.workers:
            workers[worker].acknowledge(2)
        # then the others hear theirs together: nobody is left to take the state over
        rest = sorted(set(range(3)) - {leaving})
        for worker in rest:
            workers[worker].notice(20.0)
        assert wait_generation(store, 3) == second
        assert store.plan(3).action == SAVE_AND_EXIT and store.plan(3).migration is None
        saving = decision(store, 3)
        assert saving["kind"] == SAVE_AND_EXIT and "save a checkpoint and exit" in saving["reason"]
        assert f"notice from workers {sorted(second.workers)}" in saving["reason"]
        # new processes come while the old ones still save: the job resumes once they are done
        workers += [Worker(store, w, can_save=True) for w in (3, 4, 5)]
        time.sleep(1.0)
        assert store.current_generation() == 3
        savers = sorted(second.workers)
        workers[savers[0]].acknowledge(3)  # saved, and stays on standby without a notice
        for worker in savers[1:]:
            workers[worker].vanish()  # saved and exited
        resumed = wait_generation(store, 4)
        assert resumed.workers <= {3, 4, 5} and store.plan(4).migration is None and store.plan(4).action == TRAIN
        restart = decision(store, 4)
        assert restart["kind"] == "restart" and "resume from the checkpoint of generation 3" in restart["reason"]


def test_job_leaving_without_save_directories_is_not_asked_to_save(job, caplog):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]  # their member records say: no --save
    with running(store, write_config(tmp_path, **{"min-workers": 2})):
        layout = wait_generation(store, 1)
        for worker in workers:
            worker.acknowledge(1)
        for worker in workers:
            worker.notice(20.0)
        why = f"workers {sorted(layout.workers)} run without --save: the job cannot save and exit"
        wait_for(lambda: why in caplog.text, WAIT_S, "the coordinator to say why the job cannot save")
        assert store.current_generation() == 1


def coordinator_child(endpoint: str, job: str, config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd", endpoint,
                                 "--job", job, "--config", str(config)], env=env, stdout=out, stderr=out)


def test_second_coordinator_waits_and_a_killed_one_is_replaced_from_etcd(etcd_server, job, client):
    """Issue 6 point 3 and issue 7 point 2, with real `parcae coordinator` processes."""
    store, workers, tmp_path = job
    config = write_config(tmp_path, **{"interval-seconds": 1, "min-workers": 4})
    workers += [Worker(store, w) for w in range(5)]
    published: list[str] = []  # the key of every write under plans/, in order
    watching = threading.Event()

    def record(events) -> None:
        published.extend(e.key for e in events if e.value)
        watching.set()

    watch = client.watch(store.keys.plans, record, prefix=True)
    assert watching.wait(WAIT_S)
    first = coordinator_child(etcd_server.endpoint, store.keys.job, config, tmp_path / "first.log")
    second = None
    try:
        wait_generation(store, 1)
        first_leader = store.leader()
        assert first_leader.pid == first.pid
        second = coordinator_child(etcd_server.endpoint, store.keys.job, config, tmp_path / "second.log")
        wait_for(lambda: "waiting for leadership" in (tmp_path / "second.log").read_text(), WAIT_S,
                 "the second coordinator to wait")
        wait_for(lambda: len(store.coordinator_state().history) >= 2, WAIT_S, "two intervals of history")
        layout = Layout.from_dict(store.latest_plan().layout)
        leaving = min(layout.workers)
        workers[leaving].notice(deadline_in=20)
        wait_for(lambda: leaving not in Layout.from_dict(store.latest_plan().layout).workers, WAIT_S,
                 "the first coordinator to drop the noticed worker")
        assert store.leader().pid == first.pid  # the second one did nothing meanwhile
        assert "published" not in (tmp_path / "second.log").read_text()
        before = store.coordinator_state()
        generation = store.current_generation()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        layout = Layout.from_dict(store.latest_plan().layout)
        gone = max(layout.workers)
        workers[gone].vanish()  # lost while no coordinator acts
        wait_for(lambda: store.current_generation() > generation, WAIT_S + 2 * LEASE_S,
                 "the second coordinator to take over and drop the lost worker")
        assert store.leader().pid == second.pid
        assert gone not in Layout.from_dict(store.latest_plan().layout).workers
        after = store.coordinator_state()
        assert len(after.history) >= len(before.history) and after.boundary_at >= before.boundary_at
        assert [d["generation"] for d in after.decisions][:len(before.decisions)] == \
            [d["generation"] for d in before.decisions]  # it continued the first one's record
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0
        assert store.leader() is None  # it resigned
    finally:
        watch.stop()
        for child in (first, second):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
    generations = [int(key.rsplit("/", 1)[1]) for key in published]
    assert len(published) == len(set(published)), f"a plan was published twice: {published}"
    assert generations == sorted(generations) and generations == list(range(1, len(generations) + 1))
    assert all(kv.version == 1 for kv in client.get_prefix(store.keys.plans))


def test_the_rates_key_puts_a_rate_models_means_in_the_coordinators_forecast(tmp_path):
    """The model is fitted on the kept availability history, whose last row starts at the
    boundary just passed; without the key the forecaster's expectations stand."""
    rows = [[4, 0, 0]] * 100 + [[3, 1, 0], [4, 0, 1]] * 30  # 159 intervals of 30 s: over an hour
    forecasts = {}
    for rates in ("none", "constant", "seasonal"):
        config = CoordinatorConfig.load(write_config(tmp_path, rates=rates))
        assert config.rates == rates
        coordinator = Coordinator(JobStore(MemoryEtcd(), new_job()), config, config.optimizer(), "unit")
        for row in rows:
            coordinator._observe(row)
        coordinator._boundary_at = 1_700_000_000.0
        forecasts[rates] = coordinator._make_forecast()
    assert CoordinatorConfig.load(write_config(tmp_path)).rates == "none"
    preemption_rate = (30 + 0.5) / (sum(row[0] for row in rows[:-1]) + 30 + 1)  # exposure: running + arrived
    arrival_rate = (30 + 0.5) / (len(rows) - 1 + 1)
    expected = preemption_rate * (np.concatenate(([4], forecasts["none"].expected[:-1])) + arrival_rate)
    assert forecasts["constant"].preemptions == pytest.approx(expected)
    assert forecasts["constant"].arrivals == pytest.approx([arrival_rate] * 3)
    assert forecasts["none"].preemptions != pytest.approx(expected)
    assert forecasts["seasonal"].preemptions == pytest.approx(expected)  # under a day: the constant model


def test_two_coordinators_in_one_process_never_both_act(job):
    store, workers, tmp_path = job
    config = write_config(tmp_path, **{"min-workers": 3})
    workers += [Worker(store, w) for w in range(3)]
    with running(store, config, "first") as first:
        wait_generation(store, 1)
        with running(store, config, "second") as second:
            workers[0].notice(deadline_in=20)
            wait_generation(store, 2)
            assert first.is_leader and not second.is_leader
            first.stop()
            wait_for(lambda: second.is_leader, WAIT_S, "the second coordinator to lead after the first resigned")
            workers[1].notice(deadline_in=20)
            layout = wait_generation(store, 3)
            assert layout.workers == {2}


BAD_CONFIGS = [
    ({"lookahead": 0}, "lookahead: expected an integer from 1"),
    ({"lookahead": True}, "lookahead: expected an integer"),
    ({"interval-seconds": -1}, "interval-seconds: expected a positive number"),
    ({"grace-seconds": "soon"}, "grace-seconds: expected a number of seconds >= 0, got 'soon'"),
    ({"profile": "missing.json"}, "profile: no file"),
    ({"colour": "blue"}, "unknown key(s) colour"),
    ({"min-workers": 9}, "min-workers 9 exceeds max-workers 8"),
    ({"forecaster": "oracle"}, "forecaster: expected one of default, last-value"),
    ({"rates": "hourly"}, "rates: expected one of none, seasonal, constant, got 'hourly'"),
    ({"rates": None}, "rates: expected one of none, seasonal, constant, got None"),
    ({"tensorboard-dir": 3}, "tensorboard-dir: expected a folder path, got 3"),
    ({"tensorboard-dir": "tiny.json"}, "tiny.json is not a folder"),
]


@pytest.mark.parametrize("override, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_exits_2_with_a_clear_message(tmp_path, capsys, override, message):
    config = write_config(tmp_path, **override)
    rc = cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and str(config) in err and "Traceback" not in err


def test_unusable_files_exit_2(tmp_path, capsys):
    config = write_config(tmp_path)
    (tmp_path / "tiny.json").write_text(json.dumps({**PROFILE, "layers": []}))
    assert cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)]) == 2
    assert "layers: expected a list of 4" in capsys.readouterr().err
    config.write_text("profile: [unclosed")
    assert cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    config.write_text("- a list")
    assert cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)]) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "bad/name", "--config",
                     str(write_config(tmp_path))]) == 2
    assert "job name 'bad/name'" in capsys.readouterr().err


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True), st.text(max_size=8),
                   st.lists(st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["profile", "model", "cost-constants", "interval-seconds", "lookahead",
                                        "grace-seconds", "lease-seconds", "max-workers", "min-workers", "forecaster",
                                        "rates", "tensorboard-dir", "x"]),
                       VALUES, max_size=6))
def test_config_loader_gives_only_clear_errors(data):
    try:
        config = CoordinatorConfig.from_dict(data, "fuzz", REPO)
    except ConfigError as exc:
        assert str(exc).startswith("fuzz: ")
    else:
        assert config.lookahead >= 1 and config.profile.is_file()


def test_etcd_unreachable_is_a_clear_error_within_10_s(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    started = time.monotonic()
    rc = cli.main(["coordinator", "--etcd", f"127.0.0.1:{port}", "--job", "j", "--config", str(write_config(tmp_path))])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 1 and f"cannot connect to etcd at 127.0.0.1:{port}" in err and "Traceback" not in err
    assert elapsed < 10
    assert cli.main(["status", "--etcd", f"127.0.0.1:{port}", "--job", "j", "--etcd-timeout", "1"]) == 1
    assert "cannot connect to etcd" in capsys.readouterr().err


def test_status_command_prints_json(etcd_server, job, capsys):
    store, workers, tmp_path = job
    workers += [Worker(store, w) for w in range(2)]
    with running(store, write_config(tmp_path, **{"min-workers": 2})):
        layout = wait_generation(store, 1)
    assert cli.main(["status", "--etcd", etcd_server.endpoint, "--job", store.keys.job, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["generation"] == 1 and status["layout"] == layout.to_dict()
    roles = {m["worker"]: m["role"] for m in status["members"]}
    assert roles == {w: "rank" if w in layout.workers else "standby" for w in (0, 1)}
    assert status["migrations"][0]["kind"] == "start" and status["leader"] is None


def test_status_over_tls_with_a_password_and_wrong_credentials(secure_server, tmp_path, capsys):
    server, tls = secure_server
    secret = tmp_path / "password"
    secret.write_text("right-password\n")
    command = ["status", "--etcd", server.endpoint, "--job", new_job(), "--etcd-ca", tls.ca, "--etcd-cert", tls.cert,
               "--etcd-key", tls.key, "--etcd-user", "root", "--etcd-password-file", str(secret), "--json"]
    assert cli.main(command) == 2  # it read etcd over TLS as root: the new job has no keys yet
    assert f"job {command[4]!r} has no records in etcd" in capsys.readouterr().err
    secret.write_text("wrong-password")
    assert cli.main(command) == 1
    assert "check the etcd user and password" in capsys.readouterr().err
    assert cli.main(command[:5] + ["--etcd-timeout", "1"]) == 1  # no TLS options against a TLS server
    assert "cannot connect to etcd" in capsys.readouterr().err


STATE = {"interval_seconds": 60.0, "boundary_at": 1.7e9, "history": [[4, 0, 0], [3, 1, 0]], "previous": [1, 2, 3],
         "seen": [1, 2, 3], "admitted": {"1": [99, 1.7e9]}, "forecast": None,
         "decisions": [{"generation": 1, "at": 1.7e9, "reason": "start", "kind": "start", "seconds": 3.5}]}


@pytest.mark.parametrize("change, why", [
    ({"history": [[4, 0]]}, "expected [available, preempted, arrived]"),
    ({"history": [[4, -1, 0]]}, "expected [available, preempted, arrived]"),
    ({"seen": ["1"]}, "is not a worker id"),
    ({"admitted": {"x": [1, 2.0]}}, "expected worker id -> [pid, registered_at]"),
    ({"decisions": [{**STATE["decisions"][0], "kind": "rm -rf"}]}, "expected one of"),
    ({"decisions": [{"generation": 1}]}, "missing required keys"),
    ({"forecast": {"expected": [1.0]}}, "forecast is missing"),
    ({"extra": 1}, "unknown keys ['extra']"),
])
def test_state_record_is_validated(client, change, why):
    store = JobStore(client, new_job())
    assert CoordinatorState.from_dict(STATE).encode()  # the good one round-trips
    client.put(store.keys.coordinator, json.dumps({**STATE, **change}).encode())
    with pytest.raises(SchemaError) as info:
        store.coordinator_state()
    assert why in str(info.value) and store.keys.coordinator in str(info.value)
