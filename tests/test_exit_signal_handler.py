"""--exit-signal-handler: SIGTERM to one rank makes every rank finish its step, save and
exit 0, and the resumed run trains what an uninterrupted one does."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from helpers import (REPO, SMALL_GPT, assert_close, child_env, losses, shared_losses, torchrun, trained_losses,
                     wait_for)
from megatron_parcae.events import Iteration, Save, read_events
from megatron_parcae.training.pretrain import pretrain

ITERS = 10


@pytest.mark.parametrize("flags,message", [
    ([], "--exit-signal-handler needs --save"),
    (["--save", "ckpt", "--parcae"], "--exit-signal-handler cannot be combined with --parcae, which handles SIGTERM itself"),
])
def test_exit_signal_handler_refuses_what_it_cannot_do_in_one_line(tiny_data, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        pretrain("gpt", SMALL_GPT + ["--train-iters", "2", "--exit-signal-handler", *flags])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {message}\n"


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_the_resumed_run_continues_exactly(tiny_data, tmp_path, tmp_path_factory):
    train = SMALL_GPT + ["--train-iters", str(ITERS)]
    # test_training.py's reference: the same model trains the same under every layout.
    uninterrupted = shared_losses(tmp_path_factory, "training-reference",
                                  lambda _: losses(torchrun("pretrain_gpt.py", 1, train)))

    events = tmp_path / "events.jsonl"
    save = ["--save", str(tmp_path / "ckpt"), "--exit-signal-handler"]
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            str(REPO / "scripts" / "pretrain_gpt.py"), *train, *save, "--parcae-events", str(events)],
                           cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: events.exists() and any(isinstance(e, Iteration) and e.iteration >= 3
                                                 for e in read_events(events)), 180, "iteration 3")
        ranks = psutil.Process(job.pid).children()
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGTERM)  # one rank only: the other learns it at the boundary
        output, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, output[-3000:]
    stopped = read_events(events)
    saved = [e for e in stopped if isinstance(e, Save)]
    assert len(saved) == 1 and saved[0].iteration == max(trained_losses(stopped)) < ITERS
    assert f"exiting after receiving SIGTERM, at iteration {saved[0].iteration}" in output

    resumed = losses(torchrun("pretrain_gpt.py", 2, train + ["--load", str(tmp_path / "ckpt")]))
    assert min(resumed) == saved[0].iteration + 1
    assert_close({**trained_losses(stopped), **resumed}, uninterrupted)
