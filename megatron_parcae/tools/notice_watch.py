"""`parcae notice-watch --source aws|gcp|azure|auto`: print this instance's preemption
notice from its cloud's metadata service, as the training processes would hear it.

One line per notice: `aws terminate, deadline 2026-11-22T16:34:24Z (in 118 s)`, or with
`--json` exactly `{"source": ..., "action": ..., "deadline": <unix seconds>}`. A
rebalance recommendation (AWS) is printed the same way with action "rebalance" and, as
deadline, the time AWS issued it: it is a hint of elevated risk, not a notice. A watcher
hears one notice; `--once` exits 0 after it, otherwise the command waits until it is
interrupted. Ctrl-C exits 130, SIGTERM 0. Exits 1 when `auto` finds no metadata service
(only signals can give notice there) or a named one does not answer within PROBE_SECONDS
(a metadata service answers in milliseconds: a wrong --endpoint must not wait forever),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import signal
import sys
import threading
import time

from megatron_parcae.control.notices import PROBE_SECONDS, WATCHERS, Notice, NoticeWatcher, build_watcher


class _Terminated(Exception):
    """SIGTERM arrived."""


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=("auto", *WATCHERS), default="auto",
                        help="which metadata service to watch; auto: the first of them that answers")
    parser.add_argument("--endpoint", default=None,
                        help="the metadata service's base URL (default: the provider's own; with auto: "
                             "all three are asked there)")
    parser.add_argument("--once", action="store_true", help="exit 0 after the first notice")
    parser.add_argument("--json", action="store_true", help="print each notice as one JSON object")
    parser.add_argument("--poll-seconds", type=seconds, default=None,
                        help="seconds between polls (default 2); GCP hangs on a request instead and only "
                             "waits this long to retry an unreachable server")


def _line(notice: Notice, as_json: bool) -> str:
    if as_json:
        return json.dumps({"source": notice.source, "action": notice.action, "deadline": notice.deadline})
    when = datetime.datetime.fromtimestamp(notice.deadline, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if notice.action == "rebalance":
        return f"{notice.source} rebalance recommended at {when} (a hint, not a notice)"
    return f"{notice.source} {notice.action}, deadline {when} (in {notice.deadline - time.time():.0f} s)"


def _answers(watcher: NoticeWatcher) -> bool:
    """Whether the service answers within PROBE_SECONDS; a probe still hanging then (a DNS
    lookup) is left to end on its daemon thread."""
    answered = threading.Event()
    probe = threading.Thread(target=lambda: watcher.answers(PROBE_SECONDS) and answered.set(),
                             name=f"notice-probe-{watcher.source}", daemon=True)
    probe.start()
    probe.join(PROBE_SECONDS)
    return answered.is_set()


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="parcae notice-watch: %(message)s")
    options = {} if args.poll_seconds is None else {"poll_seconds": args.poll_seconds}
    # Ctrl-C raises KeyboardInterrupt even where SIGINT was inherited ignored (a background job).
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    stop = threading.Event()
    try:
        try:
            watcher = build_watcher(args.source, args.endpoint, **options)
        except ValueError as exc:
            print(f"parcae notice-watch: error: {exc}", file=sys.stderr)
            return 2
        if watcher is None:
            where = "here" if args.endpoint is None else f"at {args.endpoint}"
            print(f"parcae notice-watch: error: no metadata service (AWS, GCP, Azure) answered {where}; "
                  "only signals can give notice", file=sys.stderr)
            return 1
        if args.source != "auto" and not _answers(watcher):  # auto's choice has just answered
            print(f"parcae notice-watch: error: the {watcher.source} metadata service at {watcher.endpoint.url} "
                  f"did not answer (refused, or silent for {PROBE_SECONDS:g} s)", file=sys.stderr)
            return 1

        noticed = threading.Event()

        def show(notice: Notice) -> None:
            print(_line(notice, args.json), flush=True)

        def deliver(notice: Notice) -> None:
            show(notice)
            noticed.set()

        watcher.start(deliver, stop, on_hint=show).join()  # returns after the one notice
        if not noticed.is_set():
            print("parcae notice-watch: error: the watcher ended without a notice", file=sys.stderr)
            return 1
        if not args.once:
            stop.wait()  # until interrupted: a watcher hears one notice
        return 0
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 0
    finally:
        stop.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
