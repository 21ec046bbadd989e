"""--wandb-project: one wandb run per job, whichever processes are the layout's rank 0,
read back from the offline run files (WANDB_MODE=offline: no server); and the one-line
error where wandb is not installed."""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

import pytest

from helpers import REPO, SMALL_GPT, losses, torchrun
from megatron_parcae.events import LayoutChange
from megatron_parcae.training.metrics.writer import MetricsWriter
from megatron_parcae.training.pretrain import pretrain


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch) -> Path:
    """wandb writes runs under the returned folder only, without a server or console capture."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    return tmp_path / "wandb-runs"


def offline_runs(folder: Path) -> list[tuple[float, float, str, dict[int, dict[str, float]]]]:
    """Each offline run directory wandb made under `folder` (one per wandb.init), in the
    order they were opened: (opened at, last written at, run id, {iteration: scalars})."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in (folder / "wandb").glob("offline-run-*/run-*.wandb"):
        opened, run_id, history = None, None, {}
        for data in _log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.HasField("run"):
                opened, run_id = record.run.start_time.ToNanoseconds() / 1e9, record.run.run_id
            elif record.HasField("history"):
                row = {item.key or ".".join(item.nested_key): float(item.value_json) for item in record.history.item}
                row = {key: value for key, value in row.items() if not key.startswith("_")}  # wandb's own
                history.setdefault(int(row.pop("iteration")), {}).update(row)
        runs.append((opened, os.stat(path).st_mtime_ns / 1e9, run_id, history))
    return sorted(runs)


def _log_records(data: bytes):
    """The records of a .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (checksum,
    little-endian length, type: 1 whole record, 2/3/4 its first/middle/last part) and
    data; a block's tail too short for a header is padding."""
    assert data[:4] == b":W&B", "not a wandb run file"
    position, record = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            return  # zeroed space past the last record
        record += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield record
            record = b""


def _writer_args(**fields) -> argparse.Namespace:
    """The arguments the writer and the run id read, `fields` replacing the defaults."""
    return argparse.Namespace(**{"tensorboard_dir": None, "wandb_project": "p", "wandb_exp_name": "e",
                                 "wandb_save_dir": None, "save": None, "parcae_etcd": None, "parcae_job": None,
                                 **fields})


def test_the_run_id_is_the_jobs(monkeypatch):
    from megatron_parcae.scalars.wandb_backend import job_run_id

    live_job = {"parcae_etcd": "http://etcd:2379", "parcae_job": "j1"}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    live, saved, launched = (job_run_id(_writer_args(**fields))
                             for fields in ({**live_job, "save": "ckpt"}, {"save": "ckpt"}, {}))
    assert len({live, saved, launched}) == 3
    # The same in every process of a job, and in a later launch that resumes its --save;
    # another launch without --save is another job.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")
    assert job_run_id(_writer_args(**live_job)) == live
    assert job_run_id(_writer_args(save="./ckpt/")) == saved
    assert job_run_id(_writer_args()) not in {live, saved, launched}
    assert job_run_id(_writer_args(save="ckpt", wandb_exp_name="e2")) != saved
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without a rendezvous id: this process's own
    assert job_run_id(_writer_args()) == job_run_id(_writer_args()) not in {live, saved, launched}


@pytest.mark.slow  # wandb.init starts wandb's service process
def test_a_released_run_is_resumed_at_the_next_write(offline_wandb):
    import wandb

    from megatron_parcae.events import Evaluation

    writer = MetricsWriter(_writer_args(wandb_save_dir=str(offline_wandb)), flops_per_step=0.0)
    try:
        writer.reported(Evaluation(1, 1, {"lm loss": 3.0}))
        writer.release_run()  # as at the end of a layout whose rank 0 this process was
        writer.reported(Evaluation(1, 1, {"lm loss": 2.5}))  # the next rank 0 starts where it ended
        writer.reported(Evaluation(2, 1, {"lm loss": 2.0}))
    finally:
        writer.close()
        wandb.teardown()  # its service process
    (_, closed, first, before), (opened, _, second, after) = offline_runs(offline_wandb)
    assert first == second and closed <= opened
    assert before == {1: {"lm loss validation": 3.0}}
    assert after == {1: {"lm loss validation": 2.5}, 2: {"lm loss validation": 2.0}}


# `python slow_finish.py SCRIPT ARGS...`: SCRIPT with wandb's run.finish a second slower,
# as uploading what is left of a run makes it online; the process that becomes rank 0
# must still open the run only once it is finished.
SLOW_FINISH = """
import runpy, sys, time
import wandb

finish = wandb.Run.finish


def slow_finish(run, *args, **kwargs):
    time.sleep(1.0)
    return finish(run, *args, **kwargs)


wandb.Run.finish = slow_finish
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_one_run_follows_rank_0_to_other_processes(tiny_data, offline_wandb, tmp_path):
    slow_finish = tmp_path / "slow_finish.py"
    slow_finish.write_text(SLOW_FINISH)
    # T1P1D2 on workers 0, 1; from iteration 2 worker 1 alone (worker 0, rank 0 so far,
    # leaves and exits, handing nothing over); from iteration 4 T1P1D2 again with worker 2
    # joining. (torchrun takes an absolute path in place of a script of scripts/.)
    run = torchrun(str(slow_finish), 3, [str(REPO / "scripts" / "pretrain_gpt.py"), *SMALL_GPT,
                                         "--train-iters", "6", "--wandb-project", "p", "--wandb-exp-name", "e",
                                         "--wandb-save-dir", str(offline_wandb), "--parcae",
                                         "--parcae-layout-schedule", "2:1,1,1:leave=0;4:1,1,2:join=1"])
    printed = losses(run)
    runs = offline_runs(offline_wandb)
    assert {run_id for _, _, run_id, _ in runs} == {runs[0][2]}  # one run, resumed by each rank 0
    # Each closed before the next opened; one opening per layout: worker 0's, then worker
    # 1's, closed at the next change and reopened by the rank 0 of the layout after it.
    assert all(closed <= opened for (_, closed, _, _), (opened, _, _, _) in zip(runs, runs[1:]))
    assert [sorted(it for it, row in history.items() if "lm loss" in row) for _, _, _, history in runs] == \
        [[1, 2], [3, 4], [5, 6]]
    history = {}
    for _, _, _, rows in runs:
        for it, row in rows.items():
            history.setdefault(it, {}).update(row)
    assert {it: row["lm loss"] for it, row in history.items()} == pytest.approx(printed, rel=1e-6)
    assert sorted(printed) == [1, 2, 3, 4, 5, 6]
    # A change's seconds, at the iteration the previous rank 0 wrote last, are kept.
    changes = {e.iteration: e.seconds for e in run.of(LayoutChange)}
    assert {it: row["parcae/layout-change-seconds"] for it, row in history.items()
            if "parcae/layout-change-seconds" in row} == pytest.approx(changes, rel=1e-6)
    assert sorted(changes) == [2, 4]


def test_wandb_without_wandb_installed_fails_in_one_line(tiny_data, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec("wandb") is None
    with pytest.raises(SystemExit) as exit_:
        pretrain("gpt", SMALL_GPT + ["--train-iters", "2", "--wandb-project", "p", "--wandb-exp-name", "e"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --wandb-project: wandb is not installed (pip install wandb)\n"
