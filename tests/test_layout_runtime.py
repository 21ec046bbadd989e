"""A layout whose build fails part-way (a peer lost while its groups form) leaves no
megatron-core state behind: the next layout of the same process builds."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

from helpers import REPO, SMALL_GPT

pytestmark = pytest.mark.slow  # every test here starts processes

FAILED_THEN_BUILT = """
import sys
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_parcae.training import runtime
from megatron_parcae.training.device import prepare_device
from megatron_parcae.training.arguments import parse_args
from megatron_parcae.training.data.datasets import build_tokenizer
from megatron_parcae.training.models import padded_vocab_size


prepare_device()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
args = parse_args(sys.argv[1:], prog="test", model="gpt", world_size=1)
vocab = padded_vocab_size(build_tokenizer(args).vocab_size, args)

def peer_lost(*args, **kwargs):
    raise dist.DistBackendError("Connection closed by peer")

build_model_chunk, runtime.build_model_chunk = runtime.build_model_chunk, peer_lost
try:
    runtime.LayoutRuntime(args, vocab)  # fails after megatron-core's groups are made
    sys.exit("the build did not fail")
except dist.DistBackendError:
    pass
assert not ps.model_parallel_is_initialized() and ps._DATA_PARALLEL_GROUP is None
runtime.build_model_chunk = build_model_chunk
runtime.LayoutRuntime(args, vocab).destroy()
print("built", flush=True)
"""


def test_a_layout_that_fails_to_build_leaves_nothing_behind():
    run = subprocess.run([sys.executable, "-c", FAILED_THEN_BUILT, *SMALL_GPT], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0 and run.stdout.strip().endswith("built"), f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
