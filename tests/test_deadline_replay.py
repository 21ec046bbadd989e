"""On-demand instances provisioned live: the coordinator's collaborator
(control/provisioning.py) asks the deadline policy each interval and requests or releases
the difference; its record and event; the emulator applying published counts; and, slow,
`parcae replay --deadline-hours` with paced workers against its spot-only twin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import REPO, TRACES, hooks_env

from megatron_parcae import cli
from megatron_parcae.control.etcd import SchemaError
from megatron_parcae.control.etcd.keys import ProvisioningRecord
from megatron_parcae.control.provisioning import Observed, Provisioning
from megatron_parcae.events import Cost, EventWriter, Provisioned, parse_event, read_events
from megatron_parcae.provisioning.emulator import EmulatorProvisioner
from megatron_parcae.provisioning.pools import Market, Pool
from megatron_parcae.provisioning.provisioner import Instance, Provisioner, ProvisionerError
from megatron_parcae.provisioning.settings import Deadline
from test_coordinator import write_config

START = 1_000_000_000.0
MARKET = Market.constant(1.0, 3.0, 8, 0.0)
RATES = tuple(float(n) for n in range(9))  # a sample a second per instance, 8 at most


class FakeProvisioner(Provisioner):
    """Records what it was asked; names instances od-1, od-2, ..."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__((MARKET.spot, MARKET.on_demand))
        self.calls: list[tuple[str, str, int]] = []
        self.held: list[str] = []
        self.fail = fail
        self._numbers = 0

    def request(self, pool: str, count: int) -> list[str]:
        if self.fail:
            raise ProvisionerError("sbatch failed")
        self.calls.append(("request", pool, count))
        names = [f"od-{self._numbers + k + 1}" for k in range(count)]
        self._numbers += count
        self.held += names
        return names

    def release(self, pool: str, count: int) -> list[str]:
        self.calls.append(("release", pool, count))
        gone, self.held = self.held[len(self.held) - count:], self.held[:len(self.held) - count]
        return gone

    def running(self, pool: str) -> list[Instance]:
        return [Instance(name, pool) for name in self.held]


def observed(at_hours: float, done: float, spot: int, ready: int) -> Observed:
    return Observed(START + at_hours * 3600, START, 0.0, done, 1.0, spot, ready, RATES, 10.0, 10.0)


def provisioning(tmp_path, provisioner: Provisioner | None, samples: int = 20_000) -> Provisioning:
    # 20,000 samples in 1 h: 8 instances make 28,800, 2 spot ones 7,200.
    return Provisioning(MARKET, Deadline("samples", samples, hours=1.0), 60.0, 8,
                        EventWriter(tmp_path / "events.jsonl"), provisioner)


def test_on_demand_is_requested_when_behind_and_released_when_ahead(tmp_path):
    fake = FakeProvisioner()
    live = provisioning(tmp_path, fake)
    record = live.step(observed(0.0, 0, spot=2, ready=0))
    assert record is not None and fake.calls[0][:2] == ("request", "on-demand")
    asked = fake.calls[0][2]
    assert asked >= 1 and live.held == asked and record.wanted == {"on-demand": asked}
    assert record.reason.startswith("behind")
    assert live.step(observed(1 / 60, 60, spot=2, ready=asked)) is None  # on plan: nothing changes
    # Nearly done with half an hour left: more than 2 spot instances need, so on-demand goes.
    record = live.step(observed(0.5, 19_000, spot=2, ready=asked))
    assert record is not None and record.reason.startswith("ahead")
    assert fake.calls[-1][0] == "release" and live.held == record.wanted["on-demand"] < asked
    events = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, Provisioned)]
    assert [(e.held, e.wanted) for e in events] == [(0, asked), (asked, live.held)]
    assert events[0].instances == tuple(f"od-{k}" for k in range(1, asked + 1))
    assert events[0].remaining == 20_000 and events[0].time_left_hours == pytest.approx(1.0)
    assert events[1].instances == tuple(f"od-{k}" for k in range(live.held + 1, asked + 1))


def test_spot_enough_asks_for_nothing_and_done_gives_everything_back(tmp_path):
    fake = FakeProvisioner()
    live = provisioning(tmp_path, fake, samples=3_000)  # 8 spot instances do it in 6 minutes
    assert live.step(observed(0.0, 0, spot=8, ready=0)) is None and fake.calls == []
    live.resume(ProvisioningRecord(START, {"on-demand": 3}, "a previous leader's"))
    assert live.held == 3  # a successor holds what the record says
    record = live.step(observed(0.2, 3_000, spot=8, ready=3))
    assert record.wanted == {"on-demand": 0} and fake.calls == [("release", "on-demand", 3)]


def test_a_remote_backend_gets_the_record_only_and_a_failed_request_changes_nothing(tmp_path):
    remote = provisioning(tmp_path, None)
    record = remote.step(observed(0.0, 0, spot=2, ready=0))
    assert record.wanted["on-demand"] == remote.held > 0
    assert [e.instances for e in read_events(tmp_path / "events.jsonl")] == [()]
    assert remote.pool_of("on-demand/3") == "on-demand" and remote.pool_of("node-1") is None
    failing = provisioning(tmp_path, FakeProvisioner(fail=True))
    assert failing.step(observed(0.0, 0, spot=2, ready=0)) is None and failing.held == 0


def test_iterations_count_through_the_global_batch(tmp_path):
    live = Provisioning(MARKET, Deadline("iterations", 1_000, hours=1.0), 60.0, 8, EventWriter(None), None)
    # 1,000 iterations of 20 samples on 2 spot instances (2 samples/s): 10,000 s, more than an hour.
    record = live.step(Observed(START, START, 0.0, 0, 20.0, 2, 0, RATES, 10.0, 10.0))
    assert record is not None and record.wanted["on-demand"] > 0
    assert "1000 iterations left" in record.reason


def test_the_record_and_the_event_are_checked():
    record = ProvisioningRecord(START, {"on-demand": 4}, "behind: ...")
    assert ProvisioningRecord.decode(record.encode(), "p") == record
    with pytest.raises(SchemaError, match="wanted.on-demand"):
        ProvisioningRecord.decode(json.dumps({"decided_at": START, "wanted": {"on-demand": -1},
                                              "reason": ""}).encode(), "p")
    with pytest.raises(SchemaError, match="unknown"):
        ProvisioningRecord.decode(json.dumps({"decided_at": START, "wanted": {}, "reason": "",
                                              "extra": 1}).encode(), "p")
    event = Provisioned("on-demand", 0, 3, "behind: x", ("a", "b", "c"), 100.0, 0.5, time=START)
    assert parse_event(event.to_json(), "line") == event


def test_the_emulator_applies_published_counts():
    started, stopped, hours = [], [], [0.0]
    host = type("Host", (), {"start_instance": lambda self, n: started.append(n),
                             "stop_instance": lambda self, n: stopped.append(n)})()
    emulator = EmulatorProvisioner((MARKET.spot, Pool("on-demand", "on-demand", 1, 3.0, 4, 0.1)), host,
                                   lambda: hours[0])
    assert emulator.apply({"on-demand": 6}) == {"on-demand": ["on-demand/1", "on-demand/2", "on-demand/3",
                                                               "on-demand/4"]}
    assert emulator.held("on-demand") == 4 and started == []  # starting for 0.1 h
    hours[0] = 0.1
    emulator.step()
    assert len(started) == 4
    assert emulator.apply({"on-demand": 4}) == {}
    assert emulator.apply({"on-demand": 1}) == {"on-demand": ["on-demand/2", "on-demand/3", "on-demand/4"]}
    assert stopped == ["on-demand/4", "on-demand/3", "on-demand/2"]


def test_a_deadline_provisioner_needs_one_spot_and_one_on_demand_pool(tmp_path, capsys):
    pools = [{"name": "a", "market": "spot", "gpus_per_instance": 1, "price": 1.0, "max_count": 4},
             {"name": "b", "market": "spot", "gpus_per_instance": 1, "price": 1.0, "max_count": 4}]
    config = write_config(tmp_path, pools=pools, deadline={"samples": 10, "hours": 1},
                          provisioner={"backend": "emulator"})
    assert cli.main(["coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "exactly one spot and one on-demand pool" in err and len(err.strip().splitlines()) == 1


def test_replay_refuses_spot_only_without_a_deadline(tmp_path, capsys):
    rc = cli.main(["replay", "--trace", str(TRACES / "aws-g4dn" / "g4dn-trace.csv"), "--max-instances", "2",
                   "--baseline", "spot-only", "--workdir", str(tmp_path / "w"), "--", "scripts/pretrain_gpt.py",
                   "--config", "configs/gpt-tiny.yaml"])
    err = capsys.readouterr().err
    assert rc == 2 and "--baseline spot-only needs --deadline-hours" in err


@pytest.mark.extended
@pytest.mark.slow
def test_a_live_replay_buys_on_demand_instances_when_behind(tiny_data, tmp_path):
    # g4dn hours 0.25-1.25 on at most 4 spot instances (4, then 2-3), 40 trace s a second:
    # 60 paced iterations due in half a trace hour are out of spot's reach from the start.
    command = [sys.executable, "-m", "megatron_parcae.cli", "replay", "--trace",
               str(TRACES / "aws-g4dn" / "g4dn-trace.csv"), "--start-hour", "0.25", "--end-hour", "1.25",
               "--max-instances", "4", "--speedup", "40", "--grace-seconds", "5", "--deadline-hours", "0.5",
               "--startup-hours", "0.05", "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "s.json"),
               "--", "scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml", "--num-layers", "2",
               "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "12",
               "--log-interval", "1", "--train-iters", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **hooks_env("paced"),
           "PARCAE_TEST_STEP_SECONDS": "4"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = json.loads((tmp_path / "s.json").read_text())["parcae"]
    asked = [c for c in summary["provisioned"] if c["wanted"] > c["held"]]
    assert asked and asked[0]["reason"].startswith("behind"), summary["provisioned"]
    assert all(name.startswith("on-demand/") for c in asked for name in c["instances"])
    assert summary["dollars"]["on-demand"] > 0 and summary["dollars"]["spot"] > 0
    assert summary["deadline_hours"] == 0.5 and isinstance(summary["met_deadline"], bool)
    assert f"parcae: ${sum(summary['dollars'].values()):,.2f} (spot $" in done.stdout
    # The coordinator decided it (its event), and the workers of on-demand instances joined:
    # it counted them in the on-demand pool.
    events = read_events(tmp_path / "w" / "parcae" / "coordinator-1.events.jsonl")
    decided = [e for e in events if isinstance(e, Provisioned)]
    assert decided and decided[0].wanted == asked[0]["wanted"] and decided[0].pool == "on-demand"
    assert any(isinstance(e, Cost) and e.instances.get("on-demand", 0) > 0 for e in events)


def test_the_replay_takes_the_coordinators_clock(etcd_server, tmp_path):
    from megatron_parcae.control.etcd import EtcdClient, JobStore
    from megatron_parcae.control.etcd.keys import CostRecord
    from megatron_parcae.tools.replay import Buyer, DeadlineSetting, ReplayError

    setting = DeadlineSetting(MARKET, 2.0, 10, 40.0)
    host = type("Host", (), {"start_instance": lambda self, n: None, "stop_instance": lambda self, n: None})()
    buyer = Buyer(host, setting, etcd_server.endpoint, f"clock-{tmp_path.name}")
    try:
        with pytest.raises(ReplayError, match="exited before it counted"):
            buyer.start(lambda: False)
        with pytest.raises(ReplayError, match="no cost record within 0 s"):
            buyer.start(lambda: True, timeout_seconds=0)
        started = time.time() - 90.0  # the coordinator has counted for 90 wall s: an hour of the trace
        with EtcdClient(etcd_server.endpoint) as client:
            assert JobStore(client, f"clock-{tmp_path.name}").publish_cost(CostRecord(started, started, {}, {}, 0.0), [])
        buyer.start(lambda: True)
        assert buyer.started_at == started and buyer.trace_hours(started + 90.0) == pytest.approx(1.0)
        assert buyer.hours() >= 1.0  # the deadline counts from the coordinator's start, not from now
    finally:
        buyer.close()
