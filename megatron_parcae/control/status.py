"""`parcae status`: what a job looks like in etcd right now, for people and scripts.

It only reads: generation and layout (the newest plan), members and their role in the
layout, preemption notices, the coordinator leading, its last forecast and its last
published decisions, and with pools in its config the job's dollars so far, its deadline
and the projected finish. Everything read is validated like any payload from etcd. A job
with no key at all is an error, not an empty report: a misspelt --job would look like a
job that has not started.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from megatron_parcae.control.etcd.options import add_etcd_arguments, connect
from megatron_parcae.control.etcd import EtcdError, JobStore, SchemaError
from reconfig.layout import Layout


JOBS_PREFIX = "/parcae/"  # every job's keys live under /parcae/<job>/ (etcd/keys.py)
JOBS_LISTED = 10  # known jobs named in the error for a job without records


class UnknownJob(LookupError):
    """The job has no records in etcd: most likely a misspelt --job."""


def check_known(store: JobStore) -> None:
    """Raises UnknownJob, naming the jobs etcd does hold, if the job has no key at all."""
    client = store.client
    if client.keys_with_prefix(store.keys.prefix):
        return
    jobs = sorted({key[len(JOBS_PREFIX):].split("/", 1)[0] for key in client.keys_with_prefix(JOBS_PREFIX)})
    known = ", ".join(jobs[:JOBS_LISTED]) + (f" and {len(jobs) - JOBS_LISTED} more" if len(jobs) > JOBS_LISTED else "")
    raise UnknownJob(f"job {store.keys.job!r} has no records in etcd; "
                     + (f"known jobs: {known}" if jobs else "etcd holds no jobs"))


def collect(store: JobStore) -> dict[str, Any]:
    """The job's state as one JSON-ready dict (what `--json` prints)."""
    now = time.time()
    generation = store.current_generation()
    envelope = store.plan(generation) if generation else None
    layout = None if envelope is None else Layout.from_dict(envelope.layout)
    notices = store.notices()
    steps = store.step_reports()
    members = []
    for worker, member in sorted(store.members().items()):
        in_layout = layout is not None and worker in layout.workers
        step = steps.get(worker)
        members.append({
            "worker": worker, "instance": member.instance, "pid": member.pid, "generation": member.generation,
            "role": "leaving" if worker in notices else "rank" if in_layout else "standby",
            "rank": layout.rank_of(worker) if in_layout else None,
            "step_seconds": None if step is None else step.seconds,
            "notice_deadline_in": None if worker not in notices else round(notices[worker].deadline - now, 1),
        })
    leader = store.leader()
    state = store.coordinator_state()
    return {
        "job": store.keys.job,
        "generation": generation,
        "layout": None if layout is None else layout.to_dict(),
        "members": members,
        "leader": None if leader is None else {"candidate": leader.candidate, "pid": leader.pid},
        "forecast": None if state is None else state.forecast,
        "migrations": [] if state is None else state.decisions,
        "cost": None if (cost := store.cost()) is None else cost.to_dict(),
    }


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _date(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _cost_lines(cost: dict[str, Any]) -> list[str]:
    """Dollars so far by pool, and the deadline against the projected finish and cost."""
    pools = ", ".join(f"{pool} ${dollars:,.2f}" for pool, dollars in sorted(cost["dollars"].items()))
    held = ", ".join(f"{pool} {count}" for pool, count in sorted(cost["instances"].items()))
    lines = [f"dollars: ${sum(cost['dollars'].values()):,.2f} so far ({pools}); ${cost['hourly_dollars']:,.2f} an "
             f"hour now on instances {held}" + (f"; budget ${cost['budget']:,.2f}" if cost["budget"] else "")]
    if cost["deadline_at"] is None:
        return lines
    lines.append(f"deadline: {cost['target']} {cost['unit']} by {_date(cost['deadline_at'])}, {cost['done']} done")
    finish = cost["projected_finish_at"]
    if finish is None:
        lines.append("projected finish: not known yet (no progress rate)")
    else:
        late = finish - cost["deadline_at"]
        verdict = f"{abs(late) / 3600:.1f} h {'late' if late > 0 else 'early'}"
        lines.append(f"projected finish: {_date(finish)} ({verdict}), projected cost ${cost['projected_dollars']:,.2f}")
    return lines


def render(status: dict[str, Any]) -> str:
    """The text report of `collect`'s dict."""
    leader = status["leader"]
    coordinator = "none" if leader is None else f"{leader['candidate']} (pid {leader['pid']})"
    lines = [f"job {status['job']}: generation {status['generation']}, coordinator {coordinator}"]
    layout = status["layout"]
    if layout is None:
        lines.append("layout: none published yet")
    else:
        lines.append(f"layout: T={layout['tp']} P={layout['pp']} D={layout['dp']}, layers per stage "
                     f"{','.join(map(str, layout['stage_layers']))}, workers by rank {layout['slots']}")
    lines.append(f"members ({len(status['members'])}):")
    for m in status["members"]:
        role = "standby" if m["rank"] is None else f"rank {m['rank']}"
        if m["notice_deadline_in"] is not None:
            role += f", leaving: deadline in {m['notice_deadline_in']:g} s"
        step = "" if m["step_seconds"] is None else f", step {m['step_seconds']:.3f} s"
        lines.append(f"  worker {m['worker']:>4}  {m['instance']}  pid {m['pid']}  applied generation "
                     f"{m['generation']}  {role}{step}")
    forecast = status["forecast"]
    if forecast is not None:
        expected = " ".join(f"{v:.1f}" for v in forecast["expected"])
        lines.append(f"forecast (next {len(forecast['expected'])} intervals of {forecast['interval_seconds']:g} s): "
                     f"expected workers {expected}")
    if status["migrations"]:
        lines.append("last migrations:")
        for d in status["migrations"][::-1]:
            lines.append(f"  generation {d['generation']:>4}  {_clock(d['at'])}  {d['kind']:<13} "
                         f"{d['seconds']:8.2f} s expected  {d['reason']}")
    if status.get("cost") is not None:
        lines += _cost_lines(status["cost"])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the state as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        client = connect(args)
    except ValueError as exc:
        print(f"parcae status: error: {exc}", file=sys.stderr)
        return 2
    except EtcdError as exc:
        print(f"parcae status: error: {exc}", file=sys.stderr)
        return 1
    with client:
        try:
            store = JobStore(client, args.job)
            check_known(store)
            status = collect(store)
        except UnknownJob as exc:
            print(f"parcae status: error: {exc}", file=sys.stderr)
            return 2
        except (EtcdError, SchemaError) as exc:
            print(f"parcae status: error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(status, indent=1) if args.json else render(status))
    return 0
