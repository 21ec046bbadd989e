"""`parcae profile` measures the real megatron-core model and feeds the liveput throughput model."""

from __future__ import annotations

import pytest

import json
import subprocess
import sys

from helpers import REPO

from megatron_parcae.liveput.throughput import PipelineModel

pytestmark = pytest.mark.slow  # every test here starts processes


def _profile(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_parcae.cli", "profile", "--output",
                           str(tmp_path / "p.json"), "--repeats", "2", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_profile_of_gpt_tiny_drives_the_pipeline_model(tiny_data, tmp_path):
    run = _profile(tmp_path, "--", "--config", "configs/gpt-tiny.yaml")
    assert run.returncode == 0, run.stderr[-2000:]
    profile = json.loads((tmp_path / "p.json").read_text())
    assert len(profile["layers"]) == 4
    assert all(u["forward_ms"] > 0 and u["backward_ms"] > 0 and u["activation_bytes"] > 0 for u in profile["layers"])
    model = PipelineModel.load(str(tmp_path / "p.json"), max_workers=4)
    assert model.samples_per_second(model.best(4)) > model.samples_per_second(model.best(1))


def test_profile_refuses_a_parallel_layout(tiny_data, tmp_path):
    run = _profile(tmp_path, "--", "--config", "configs/gpt-tiny.yaml", "--tensor-model-parallel-size", "2")
    assert run.returncode == 2
    assert "--tensor-model-parallel-size" in run.stderr


def test_analytic_profile_has_the_measured_ones_layouts_and_shape(tiny_data, tmp_path):
    run = _profile(tmp_path, "--analytic", "--", "--config", "configs/gpt-tiny.yaml")
    assert run.returncode == 0, run.stderr[-2000:]
    analytic = PipelineModel.load(str(tmp_path / "p.json"), max_workers=6)
    measured = PipelineModel.load(str(REPO / "configs/profiles/gpt-tiny-cpu.json"), max_workers=6)
    assert analytic.model_shape == measured.model_shape
    assert analytic.layouts() == measured.layouts()
    assert "(analytic)" in json.loads((tmp_path / "p.json").read_text())["device"]
