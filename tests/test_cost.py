"""Dollars live: the accounting by hand, the config's pools, deadline, budget and
provisioner, the provisioner backends (emulator, SLURM command lines), and a real
coordinator against etcd that counts dollars by pool and shows them in its cost record,
`parcae status`, its events and its TensorBoard scalars."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from helpers import new_job, wait_for
from test_coordinator import Worker, running, write_config

from megatron_parcae import cli
from megatron_parcae.control.coordinator import CoordinatorConfig
from megatron_parcae.control.etcd import JobStore, SchemaError
from megatron_parcae.control.etcd.keys import CostRecord, MemberRecord, ProgressRecord
from megatron_parcae.control.status import collect, render
from megatron_parcae.events import Cost, parse_event, read_events
from megatron_parcae.provisioning.emulator import EmulatorProvisioner
from megatron_parcae.provisioning.ledger import CostLedger, ProgressRate, pool_dollars
from megatron_parcae.provisioning.pools import Pool, PriceTrace
from megatron_parcae.provisioning.provisioner import (
    Instance, ProvisionerConfig, ProvisionerError, create_provisioner,
)
from megatron_parcae.provisioning.settings import Deadline
from megatron_parcae.provisioning.slurm import SlurmProvisioner

SPOT = Pool("spot", "spot", 1, 0.918, 16)
ON_DEMAND = Pool("on-demand", "on-demand", 1, 3.06, 4, startup_hours=0.1)


# -- the accounting, by hand ---------------------------------------------------------


def test_dollars_of_constant_and_traced_prices():
    assert pool_dollars(SPOT, 3, 0.0, 2.0) == pytest.approx(3 * 0.918 * 2)
    traced = Pool("t", "spot", 1, PriceTrace((0.0, 2.0), (1.0, 3.0)), 8)
    # Hours 1 to 2 at $1, 2 to 4 at $3: $7 an instance.
    assert pool_dollars(traced, 2, 1.0, 4.0) == pytest.approx(14.0)
    assert pool_dollars(traced, 1, 2.5, 3.0) == pytest.approx(1.5)
    assert pool_dollars(traced, 5, 3.0, 3.0) == 0.0


def test_the_ledger_pays_what_was_held_since_the_last_count():
    start = 1_000_000.0
    ledger = CostLedger({"spot": SPOT, "on-demand": ON_DEMAND}, start)
    ledger.advance(start, {"spot": 2})
    ledger.advance(start + 1800, {"spot": 2, "on-demand": 1})  # half an hour of 2 spot: $0.918
    assert ledger.dollars == pytest.approx({"spot": 0.918, "on-demand": 0.0})
    ledger.advance(start + 3600, {"spot": 1, "on-demand": 1})  # and half an hour of 2 spot and 1 on-demand
    assert ledger.dollars == pytest.approx({"spot": 1.836, "on-demand": 1.53})
    assert ledger.total == pytest.approx(3.366)
    assert ledger.hourly() == pytest.approx(0.918 + 3.06)
    assert ledger.projected(start + 3 * 3600) == pytest.approx(3.366 + 2 * (0.918 + 3.06))
    ledger.advance(start + 3000, {"spot": 1})  # a clock that went back pays nothing
    assert ledger.total == pytest.approx(3.366)


def test_the_projected_finish_extends_the_recent_rate():
    rate = ProgressRate()
    assert rate.finish_at(3000) is None
    rate.observe(0.0, 0)
    assert rate.finish_at(3000) is None  # one point: no rate yet
    rate.observe(100.0, 1000)
    rate.observe(100.0, 5000)  # the same progress record read again
    assert rate.per_second() == pytest.approx(10.0)
    assert rate.finish_at(3000) == pytest.approx(300.0)
    assert rate.finish_at(500) == 100.0  # reached already


# -- the records and the event -------------------------------------------------------


def test_member_pool_is_optional_and_cost_records_are_checked():
    member = MemberRecord(3, "node-3", 100, time.time(), 0, pool="spot")
    assert MemberRecord.decode(member.encode(), "m").pool == "spot"
    older = {k: v for k, v in member.to_dict().items() if k != "pool"}
    assert MemberRecord.from_dict(older).pool is None
    record = CostRecord(10.0, 20.0, {"spot": 1.5}, {"spot": 2}, 1.836)
    assert CostRecord.decode(record.encode(), "c") == record
    with pytest.raises(SchemaError, match="expected the pools of dollars"):
        CostRecord(10.0, 20.0, {"spot": 1.5}, {"od": 2}, 1.0).encode()
    with pytest.raises(SchemaError, match="go together"):
        CostRecord(10.0, 20.0, {}, {}, 0.0, unit="samples").encode()
    with pytest.raises(SchemaError, match="before started_at"):
        CostRecord(30.0, 20.0, {}, {}, 0.0).encode()


def test_cost_event_round_trips():
    event = Cost({"spot": 1.5, "on-demand": 3.0}, {"spot": 2, "on-demand": 1}, 4.9, "samples", 100, 1000, 5e9,
                 None, None, 20.0, time=1e9)
    assert parse_event(event.to_json(), "line") == event


# -- the config ----------------------------------------------------------------------

POOLS = [{"name": "spot", "market": "spot", "gpus_per_instance": 1, "price": 0.918, "max_count": 16},
         {"name": "on-demand", "market": "on-demand", "gpus_per_instance": 1, "price": 3.06, "max_count": 4,
          "startup_hours": 0.1}]


def test_pools_deadline_budget_and_provisioner_are_read(tmp_path):
    (tmp_path / "prices.csv").write_text("hour,price\n0,0.9\n12,1.2\n")
    pools = [{**POOLS[0], "price": {"file": "prices.csv"}}, POOLS[1]]
    path = write_config(tmp_path, pools=pools, deadline={"samples": 4_000_000, "hours": 52}, budget=1500,
                        provisioner={"backend": "slurm", "partitions": {"spot": "spot", "on-demand": "batch"}})
    config = CoordinatorConfig.load(path)
    assert [p.name for p in config.pools] == ["spot", "on-demand"]
    assert config.pools[0].price_at(13) == 1.2 and config.pools[1].price_at(13) == 3.06
    assert config.deadline.unit == "samples" and config.deadline.due(1000.0) == 1000.0 + 52 * 3600
    assert config.budget == 1500.0
    assert config.provisioner.backend == "slurm" and config.provisioner.parsed.partitions["on-demand"] == "batch"
    noon = dt.datetime(2026, 7, 1, 12, tzinfo=dt.timezone.utc)
    path = write_config(tmp_path, pools=POOLS, deadline={"iterations": 500, "by": noon})  # a YAML timestamp
    assert "2026-07-01 12:00:00+00:00" in path.read_text()
    assert CoordinatorConfig.load(path).deadline == Deadline("iterations", 500, at=noon.timestamp())
    assert Deadline.from_dict({"samples": 9, "by": "2026-07-01T14:00:00+02:00"}).at == noon.timestamp()


BAD = [
    ({"pools": [{k: v for k, v in POOLS[0].items() if k != "price"}]}, "pools[0]: missing price"),
    ({"pools": [{**POOLS[0], "market": "reserved"}]}, "market must be one of spot, on-demand"),
    ({"pools": [POOLS[0], {**POOLS[1], "name": "spot"}]}, "pool names must be unique"),
    ({"pools": [{**POOLS[0], "price": {"file": "none.csv"}}]}, "pools[0].price.file: cannot read"),
    ({"pools": [{**POOLS[0], "gpus_per_instance": 2}]}, "pool 'spot' has gpus_per_instance 2, but gpus-per-instance is 1"),
    ({"pools": POOLS, "deadline": {"samples": 10}}, "deadline: expected one of samples or iterations and one of by"),
    ({"pools": POOLS, "deadline": {"samples": 10, "by": "2026-07-01T12:00:00"}}, "has no time zone"),
    ({"pools": POOLS, "deadline": {"samples": 0, "hours": 5}}, "deadline: samples: expected a positive integer"),
    ({"pools": POOLS, "budget": -5}, "budget: expected a positive number of dollars, got -5"),
    ({"deadline": {"iterations": 10, "hours": 1}}, "deadline: needs pools"),
    ({"pools": POOLS, "provisioner": {"backend": "kubernetes"}}, "backend 'kubernetes' is not one of emulator, slurm"),
    ({"pools": POOLS, "provisioner": {"backend": "slurm"}}, "provisioner: slurm: partitions: expected a mapping"),
    ({"pools": POOLS, "provisioner": {"backend": "emulator", "speed": 2}}, "emulator: takes no options, got speed"),
]


@pytest.mark.parametrize("override, message", BAD, ids=[m for _, m in BAD])
def test_bad_provisioning_config_exits_2_with_one_clear_line(tmp_path, capsys, override, message):
    config = write_config(tmp_path, **override)
    rc = cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and str(config) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# -- the provisioners ----------------------------------------------------------------


class Host:
    """Stands in for the replay: records the instances it was told to start and stop."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.stopped: list[str] = []

    def start_instance(self, name: str) -> None:
        self.started.append(name)

    def stop_instance(self, name: str) -> None:
        self.stopped.append(name)


def test_the_emulator_starts_on_demand_after_start_up_and_spot_as_the_trace_allows():
    host, hours = Host(), [0.0]
    emulator = create_provisioner(ProvisionerConfig.from_dict({"backend": "emulator"}), "j", (SPOT, ON_DEMAND),
                                  host=host, clock=lambda: hours[0])
    assert isinstance(emulator, EmulatorProvisioner)
    emulator.set_capacity("spot", 2)
    assert emulator.request("spot", 3) == ["spot/1", "spot/2", "spot/3"][:2]  # the trace allows 2
    assert host.started == ["spot/1", "spot/2"]
    assert emulator.request("on-demand", 6) == ["on-demand/3", "on-demand/4", "on-demand/5", "on-demand/6"]  # max 4
    assert emulator.running("on-demand") == []  # starting for 0.1 h
    hours[0] = 0.1
    emulator.step()
    assert [i.name for i in emulator.running("on-demand")] == ["on-demand/3", "on-demand/4", "on-demand/5",
                                                               "on-demand/6"]
    emulator.set_capacity("spot", 3)  # the third spot instance asked for starts now
    assert emulator.running("spot") == [Instance("spot/1", "spot"), Instance("spot/2", "spot"),
                                        Instance("spot/7", "spot")]
    emulator.set_capacity("spot", 1)  # the trace takes two back: the newest go
    assert host.stopped == ["spot/7", "spot/2"] and [i.name for i in emulator.running("spot")] == ["spot/1"]
    assert emulator.release("on-demand", 3) == ["on-demand/4", "on-demand/5", "on-demand/6"]
    assert emulator.pool_of("on-demand/3") == "on-demand" and emulator.pool_of("node-1") is None
    with pytest.raises(ProvisionerError, match="runs inside `parcae replay`"):
        create_provisioner(ProvisionerConfig.from_dict({"backend": "emulator"}), "j", (SPOT,))


class Slurm:
    """A fake SLURM: answers sbatch with job ids, squeue with the elements it holds."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []
        self.env: dict[str, str] = {}
        self.queue: list[str] = []
        self.next_job = 500

    def __call__(self, argv: list[str], env) -> str:
        self.commands.append(argv)
        self.env = dict(env)
        if argv[0] == "sbatch":
            self.next_job += 1
            return f"{self.next_job};cluster\n"
        if argv[0] == "squeue":
            return "\n".join(self.queue) + "\n"
        return ""


def test_slurm_submits_and_cancels_elements_on_the_pools_partitions(tmp_path):
    fake = Slurm()
    options = ProvisionerConfig.from_dict({
        "backend": "slurm", "partitions": {"spot": "preemptible", "on-demand": "batch"}, "grace-seconds": 120,
        "script": str(tmp_path / "element.sbatch"), "sbatch-args": ["--time=1:00:00"],
        "training-flags": ["--config", "gpt.yaml"], "user": "alice"})
    slurm = create_provisioner(options, "my-job", (SPOT, ON_DEMAND), runner=fake,
                               environ={"SLURM_JOB_ID": "400", "PATH": "/bin"})
    assert isinstance(slurm, SlurmProvisioner)
    assert slurm.request("on-demand", 2) == ["501_0", "501_1"]
    squeue = ["squeue", "-h", "-r", "-u", "alice", "-n", "my-job", "-o", "%F %K %P %T"]
    assert fake.commands == [squeue, [
        "sbatch", "--parsable", "--job-name=my-job", "--partition=batch", "--array=0-1", "--ntasks-per-node=1",
        "--gres=gpu:1", "--time=1:00:00", str(tmp_path / "element.sbatch"), "--config", "gpt.yaml"]]
    assert fake.env["PARCAE_CONTROL_JOB"] == "400"  # the elements find the control job's etcd
    assert slurm.request("spot", 3)[-1] == "502_2"
    assert fake.commands[-1][3:6] == ["--partition=preemptible", "--array=0-2", "--ntasks-per-node=1"]
    assert "--signal=TERM@120" in fake.commands[-1]  # spot elements only
    fake.queue = ["400 N/A batch RUNNING", "501 0 batch RUNNING", "501 1 batch RUNNING", "502 0 preemptible RUNNING",
                  "502 1 preemptible PENDING", "502 2 preemptible RUNNING", "499 0 preemptible CANCELLED"]
    assert slurm.running("spot") == [Instance("502_0", "spot"), Instance("502_2", "spot")]
    assert slurm.request("on-demand", 5) == ["503_0", "503_1"]  # 2 held of at most 4
    fake.commands.clear()
    assert slurm.release("spot", 2) == ["502_1", "502_2"]  # the pending one first, then the newest running
    assert fake.commands == [squeue, ["scancel", "502_1", "502_2"]]
    assert slurm.pool_of("501_1.0@node7") == "on-demand" and slurm.pool_of("502_0.2@node3") == "spot"
    assert slurm.pool_of("node-1") is None
    with pytest.raises(ProvisionerError, match="no partition for pool"):
        SlurmProvisioner((SPOT, ON_DEMAND), ProvisionerConfig.from_dict(
            {"backend": "slurm", "partitions": {"spot": "p"}}).parsed, "j", fake)


# -- a real coordinator --------------------------------------------------------------

SPOT_HOURLY, ON_DEMAND_HOURLY = 36.0, 72.0  # a cent and two cents a second: dollars show within seconds


def test_the_coordinator_counts_dollars_by_pool_and_shows_them(etcd_server, client, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_parcae.scalars.tensorboard_backend import TensorBoardBackend

    store = JobStore(client, new_job())
    # Spot is listed first: the pool of members whose record names none.
    pools = [{"name": "spot", "market": "spot", "gpus_per_instance": 1, "price": SPOT_HOURLY, "max_count": 8},
             {"name": "on-demand", "market": "on-demand", "gpus_per_instance": 1, "price": ON_DEMAND_HOURLY,
              "max_count": 8}]
    due = time.time() + 7200
    config = write_config(tmp_path, **{"interval-seconds": 1, "pools": pools, "budget": 500,
                                       "deadline": {"samples": 10_000, "by": due}})
    workers = [Worker(store, 0), Worker(store, 1), Worker(store, 2), Worker(store, 3)]
    for worker, pool in zip(workers, ("spot", "spot", "on-demand", None)):
        worker.record = MemberRecord(**{**worker.record.to_dict(), "pool": pool})
        assert store.update_member(worker.record, worker.lease.id)
    events, board = tmp_path / "coordinator.events.jsonl", tmp_path / "board"
    scalars = TensorBoardBackend(str(board))
    try:
        with running(store, config, "counting", scalars, events):
            first = wait_for(store.cost, 15, "a cost record")
            assert first.instances == {"spot": 3, "on-demand": 1}
            assert first.hourly_dollars == pytest.approx(3 * SPOT_HOURLY + ON_DEMAND_HOURLY)
            # The rate comes from the progress records' own times: 10 samples/s.
            writer = workers[0]
            t1 = time.time()
            assert store.record_progress(ProgressRecord(1, 10, 1000, t1 - 100), 0, writer.lease.id)
            wait_for(lambda: store.cost().done == 1000, 15, "the first progress counted")
            assert store.record_progress(ProgressRecord(1, 20, 2000, t1), 0, writer.lease.id)
            cost = wait_for(lambda: (c := store.cost()).projected_finish_at is not None and c, 15, "a projection")
            wait_for(lambda: any(isinstance(e, Cost) and e.projected_finish_at for e in read_events(events)), 15,
                     "a cost event with the projection")
    finally:
        scalars.close()
    for worker in workers:
        worker.vanish()

    assert cost.projected_finish_at == pytest.approx(t1 + 800)  # 8000 samples left at 10 a second
    assert cost.deadline_at == pytest.approx(due) and cost.target == 10_000 and cost.unit == "samples"
    hourly = 3 * SPOT_HOURLY + ON_DEMAND_HOURLY
    held = (cost.counted_at - cost.started_at) / 3600
    # Every instance was held from the first count: dollars are the hours times the prices.
    assert cost.dollars["spot"] == pytest.approx(3 * SPOT_HOURLY * held)
    assert cost.dollars["on-demand"] == pytest.approx(ON_DEMAND_HOURLY * held)
    assert sum(cost.dollars.values()) > 0
    assert cost.projected_dollars == pytest.approx(sum(cost.dollars.values())
                                                   + hourly * (cost.projected_finish_at - cost.counted_at) / 3600)
    assert cost.budget == 500.0

    assert cli.main(["status", "--etcd", etcd_server.endpoint, "--job", store.keys.job]) == 0
    shown = capsys.readouterr().out
    final = store.cost()
    assert f"dollars: ${sum(final.dollars.values()):,.2f} so far (on-demand ${final.dollars['on-demand']:,.2f}, " \
           f"spot ${final.dollars['spot']:,.2f}); ${hourly:,.2f} an hour now" in shown
    assert f"deadline: 10000 samples by {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(due))}, 2000 done" in shown
    early = (due - final.projected_finish_at) / 3600
    assert f"projected finish: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(final.projected_finish_at))} " \
           f"({early:.1f} h early), projected cost ${final.projected_dollars:,.2f}" in shown
    assert render(collect(store)) == shown.rstrip("\n")

    reader = EventAccumulator(str(board), size_guidance={"scalars": 0})
    reader.Reload()
    charted = {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}
    assert {"parcae/dollars", "parcae/dollars/spot", "parcae/dollars/on-demand", "parcae/dollars-per-hour",
            "parcae/deadline-hours", "parcae/projected-finish-hours", "parcae/projected-dollars"} <= set(charted)
    assert all(v == pytest.approx(hourly) for _, v in charted["parcae/dollars-per-hour"])
    spent = [v for _, v in charted["parcae/dollars"]]
    assert spent == sorted(spent) and spent[-1] > 0  # dollars only grow
    assert charted["parcae/deadline-hours"][-1][1] == pytest.approx((due - cost.started_at) / 3600, rel=1e-4)
    assert charted["parcae/projected-finish-hours"][-1][1] == pytest.approx(
        (t1 + 800 - cost.started_at) / 3600, rel=1e-4)
    assert 20 in {step for step, _ in charted["parcae/projected-dollars"]}  # at the job's iteration

    # A new leader goes on from the record: the dollars and their start are kept.
    replacement = [Worker(store, 4)]
    try:
        with running(store, config, "successor"):
            later = wait_for(lambda: (c := store.cost()).instances == {"spot": 1, "on-demand": 0} and c, 15,
                             "the successor's count")
    finally:
        replacement[0].vanish()
    assert later.started_at == cost.started_at
    assert sum(later.dollars.values()) >= sum(final.dollars.values())
    assert json.loads(json.dumps(later.to_dict())) == later.to_dict()


def test_the_replay_starts_and_preempts_the_instances_the_emulator_names(tmp_path, monkeypatch):
    """ParcaeJob is the emulator's InstanceHost: an instance's worker gets its name."""
    from megatron_parcae.tools import replay

    class Process:
        def __init__(self, cmd, log_file, env) -> None:
            self.cmd, self.preempted, self.grace = cmd, False, None
            self.popen = type("Popen", (), {"poll": lambda self: None})()

        def preempt(self, grace_seconds: float) -> None:
            self.preempted, self.grace = True, grace_seconds

    monkeypatch.setattr(replay, "_Process", Process)
    job = replay.ParcaeJob.__new__(replay.ParcaeJob)  # without its etcd and coordinator
    job.script, job.args, job.workdir, job.job = "pretrain_gpt.py", ["--tiny"], tmp_path, "j"
    job.grace_seconds, job.gpus_per_instance, job.preemptions = 7.0, 1, 0
    job.log, job._workers, job._instances, job._next_id = replay.JobLog(), {}, {}, 0
    job._server = type("Server", (), {"endpoint": "127.0.0.1:2379"})()
    emulator = EmulatorProvisioner((SPOT, ON_DEMAND), job, lambda: 1.0)
    emulator.request("spot", 2)
    assert [p.cmd[p.cmd.index("--parcae-instance") + 1] for p in job._workers.values()] == ["spot/1", "spot/2"]
    assert job.alive() == [0, 1]
    emulator.release("spot", 1)
    assert job._workers[1].preempted and job._workers[1].grace == 7.0 and job.alive() == [0]
    assert job.preemptions == 1
