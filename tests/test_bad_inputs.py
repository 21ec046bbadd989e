"""Bad inputs a user may give `parcae` (issue 37): each gets one line on stderr that names
what is wrong and a non-zero exit within 5 s. Every one is refused by a check made before
any slow import or wait. The 5 s are the process's own CPU time, which a busy machine does
not stretch as it stretches wall time; a wait (an endpoint never answering) shows as wall
time, bounded by WAIT_S."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import ANCHORS, REPO, TRACES
from megatron_parcae.control.etcd.keys import JobKeys

WITHIN_S = 5.0  # the bound, in CPU seconds of the refusing process
WAIT_S = 30.0  # wall seconds: far above any refusal, far below a wait that never ends
TRACE = TRACES / "aws-p3" / "p3-trace.csv"


def parcae(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `parcae ARGS` as a user would (warnings shown); the result and the CPU seconds
    it took (this test process runs no other child meanwhile)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatron_parcae.cli", *args], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < WAIT_S, f"waited {time.monotonic() - started:.0f} s: {done.stderr[-300:]}"
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def assert_refused(done: subprocess.CompletedProcess, seconds: float, code: int, *words: str) -> None:
    """Exit `code` within WITHIN_S, nothing on stdout, one line on stderr holding `words`."""
    assert done.returncode == code, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert not done.stdout
    assert seconds < WITHIN_S, f"took {seconds:.1f} s of CPU: {lines[0]}"


def test_status_of_a_job_without_records_names_it_and_the_known_jobs(etcd_server, client):
    known = JobKeys(f"0-known-{uuid.uuid4().hex[:8]}")  # sorts before the other tests' jobs: listed
    typo = f"typo-{uuid.uuid4().hex[:8]}"
    client.put(known.generation, b"0")
    try:
        done, seconds = parcae("status", "--etcd", etcd_server.endpoint, "--job", typo)
    finally:
        client.delete(known.prefix, prefix=True)
    assert_refused(done, seconds, 2, f"job {typo!r} has no records in etcd", "known jobs: ", known.job)


@pytest.mark.slow
@pytest.mark.parametrize("source", [None, "aws", "gcp", "azure"], ids=["auto", "aws", "gcp", "azure"])
def test_notice_watch_at_an_endpoint_that_refuses(source):
    chosen = [] if source is None else ["--source", source]
    done, seconds = parcae("notice-watch", *chosen, "--endpoint", "http://127.0.0.1:1", "--once")
    assert_refused(done, seconds, 1, "http://127.0.0.1:1", "metadata service")


@pytest.mark.slow
@pytest.mark.parametrize("command, column, row", [
    (["simulate", "--trace", str(TRACE)], "iteration_ms", 4),
    (["plan", "--trace", str(TRACE), "--samples", "1000", "--deadline", "5"], "data_parallel", 6),
], ids=["simulate", "plan"])
def test_profile_csv_with_a_word_for_a_number(tmp_path, command, column, row):
    lines = (ANCHORS / "gpt-1.5b.csv").read_text().splitlines()
    header = lines[2].split(",")
    assert lines[2].startswith("data_parallel,") and not lines[row - 1].startswith("#")
    fields = lines[row - 1].split(",")
    fields[header.index(column)] = "abc"
    lines[row - 1] = ",".join(fields)
    profile = tmp_path / "gpt-1.5b.csv"
    profile.write_text("\n".join(lines) + "\n")
    done, seconds = parcae(*command, "--profile", str(profile))
    assert_refused(done, seconds, 2, f"{profile}:{row}:", f"column {column}", "'abc'")


@pytest.mark.slow
def test_compare_with_a_missing_checkpoint_names_the_flag(tmp_path):
    done, seconds = parcae("compare", "--checkpoint", "MISSING", "--reference", str(tmp_path))
    assert_refused(done, seconds, 2, "--checkpoint MISSING", "no such folder")
    (tmp_path / "file").write_text("")
    done, seconds = parcae("compare", "--checkpoint", str(tmp_path), "--reference", str(tmp_path / "file"))
    assert_refused(done, seconds, 2, f"--reference {tmp_path / 'file'}", "not a folder")
