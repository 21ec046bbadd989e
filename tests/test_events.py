"""megatron_parcae/events.py: the events file programs read instead of the training log."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from megatron_parcae import events
from megatron_parcae.events import (
    EventError,
    EventFollower,
    EventWriter,
    Iteration,
    LayoutChange,
    Load,
    MigrationCostLearned,
    NetworkMeasured,
    PlanPublished,
    Save,
    read_events,
)

ITERATION = Iteration(12, 40, 384, 32, {"lm loss": 7.25, "sop loss": 0.5}, 1.5, 2.5e-4, 412.34, 320, 1, 32768.0,
                      time=1.0e9)
MIGRATION = LayoutChange(3, 12, "pipeline", 1, 4, 1, 0.2345, 1_048_576, 9, 812.4, time=1.0e9 + 1,
                         phases={"export": 0.0041, "world": 0.05, "exchange": 0.0203, "build": 0.12, "import": 0.03})
RESTART = LayoutChange(4, 10, "restart", 2, 2, 1, 3.5, source="/ckpt", lost_steps=2, time=1.0e9 + 2)
ALL = [ITERATION, MIGRATION, RESTART, Save(12, "/ckpt", time=1.0e9 + 3), Load(10, "/ckpt", time=1.0e9 + 4),
       PlanPublished(5, "tensor", 2, 1, 2, (3, 1, 4, 0), 1.25, "lost workers [2]", (2,), (), time=1.0e9 + 5),
       MigrationCostLearned(5, "tensor", 3, 2.5, 1.25, 2.25, 1.25, time=1.0e9 + 6),
       NetworkMeasured(1, ("node-a", "node-b"), 5e-5, 1.1e9, 1.1e9, 1.25e9, 1.0999e9, 8.96e8, time=1.0e9 + 7),
       NetworkMeasured(1, ("node-a", "node-b"), 5e-5, 1.1e9, None, None, 1.0999e9, 8.96e8, time=1.0e9 + 8)]


@pytest.fixture
def path(tmp_path):
    return tmp_path / "events.jsonl"


def test_every_kind_round_trips(path):
    writer = EventWriter(path)
    for event in ALL:
        writer.write(event)
    assert read_events(path) == ALL
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == [
        "iteration", "layout_change", "layout_change", "save", "load", "plan_published", "migration_cost_learned",
        "network_measured", "network_measured"]


def test_writer_without_a_path_writes_nothing(tmp_path):
    EventWriter(None).write(ITERATION)
    assert not list(tmp_path.iterdir())


def test_log_lines_keep_megatrons_format():
    assert ITERATION.log_line() == (
        " iteration       12/      40 | consumed samples:          384 | elapsed time per iteration (ms): 412.3 | "
        "learning rate: 2.500000E-04 | global batch size:    32 | lm loss: 7.250000E+00 | sop loss: 5.000000E-01 | "
        "loss scale: 32768.0 | grad norm: 1.500000 | number of skipped iterations:   1 |")
    # Without fp16 the line has neither fp16 field.
    assert dataclasses.replace(ITERATION, loss_scale=None).log_line().endswith(
        "sop loss: 5.000000E-01 | grad norm: 1.500000 |")
    assert MIGRATION.log_line() == (
        " layout change at iteration 12 (generation 3): pipeline migration to tp 1 pp 4 dp 1, 1048576 bytes planned, "
        "234.5 ms (export 4, world 50, exchange 20, build 120, import 30 ms), 9 process groups, 812 MiB resident")
    assert RESTART.log_line() == (
        " layout change at iteration 10 (generation 4): restart to tp 2 pp 2 dp 1 from /ckpt, 2 steps lost, 3500.0 ms")
    assert Save(12, "/ckpt").log_line() == " saved checkpoint at iteration 12 to /ckpt"
    assert Load(10, "/ckpt").log_line() == " loaded checkpoint /ckpt at iteration 10"


def test_report_prints_the_line_and_appends_the_event(path, capsys):
    events.open_training_events(str(path))
    try:
        events.report(MIGRATION)
    finally:
        events.open_training_events(None)
    assert capsys.readouterr().out == MIGRATION.log_line() + "\n"
    assert read_events(path) == [MIGRATION]


@pytest.mark.parametrize("line,message", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"event": "nap", "time": 1}', "'event' is 'nap'"),
    ('{"event": "save", "time": 1, "iteration": 3}', "without field(s) directory"),
    ('{"event": "save", "time": 1, "iteration": 3, "directory": "/c", "size": 1}', "unknown field(s) size"),
    ('{"event": "save", "time": 1, "iteration": "3", "directory": "/c"}', "iteration is '3', not int"),
    ('{"event": "save", "time": 1, "iteration": true, "directory": "/c"}', "iteration is True, not int"),
    ('{"event": "save", "time": 1, "iteration": 3.5, "directory": "/c"}', "iteration is 3.5, not int"),
    ('{"event": "load", "time": null, "iteration": 3, "directory": "/c"}', "time is None, not float"),
], ids=["json", "object", "kind", "missing", "unknown", "text", "bool", "fraction", "null"])
def test_a_malformed_line_is_named(path, line, message):
    path.write_text(ITERATION.to_json() + "\n" + line + "\n" + MIGRATION.to_json() + "\n")
    with pytest.raises(EventError, match=f"^{re.escape(f'{path}:2: ')}.*{re.escape(message)}"):
        read_events(path)


@pytest.mark.parametrize("event,field,value", [(ITERATION, "losses", {"lm loss": "low"}),
                                               (MIGRATION, "phases", {"build": None})], ids=["losses", "phases"])
def test_a_wrong_nested_type_is_refused(path, event, field, value):
    bad = json.loads(event.to_json())
    bad[field] = value
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(EventError, match=f"{field} is"):
        read_events(path)


def test_a_change_written_before_phases_were_reported_still_reads(path):
    old = json.loads(MIGRATION.to_json())
    del old["phases"]
    path.write_text(json.dumps(old) + "\n")
    assert read_events(path) == [dataclasses.replace(MIGRATION, phases={})]


def test_a_truncated_last_line_from_a_killed_writer_is_ignored(path):
    whole = ITERATION.to_json() + "\n" + MIGRATION.to_json() + "\n"
    path.write_text(whole + RESTART.to_json()[:25])
    assert read_events(path) == [ITERATION, MIGRATION]
    path.write_text(whole + RESTART.to_json())  # cut just before its newline: still whole
    assert read_events(path) == [ITERATION, MIGRATION, RESTART]
    path.write_bytes(whole.encode() + "\u00e9".encode()[:1])  # cut inside a character
    assert read_events(path) == [ITERATION, MIGRATION]


def test_follower_reads_each_whole_line_once(path):
    follower = EventFollower(path)
    assert follower.read() == []  # not written yet
    line = MIGRATION.to_json() + "\n"
    path.write_text(ITERATION.to_json() + "\n" + line[:30])
    assert follower.read() == [ITERATION]
    with path.open("a") as f:
        f.write(line[30:])
    assert follower.read() == [MIGRATION]
    assert follower.read() == []
    with path.open("a") as f:
        f.write("oops\n")
    with pytest.raises(EventError, match=f"^{re.escape(f'{path}:3: not JSON')}"):
        follower.read()
