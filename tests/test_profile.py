"""`parcae profile` measures a one-layer copy of the real megatron-core model and feeds the
liveput throughput model a profile of the whole model."""

from __future__ import annotations

import pytest

import argparse
import dataclasses
import json
import subprocess
import sys

from helpers import REPO

from megatron_parcae.liveput.cost import CostConstants
from megatron_parcae.liveput.throughput import ForModels, PipelineModel, ProfileError
from megatron_parcae.tools.profile import UnitTimer, add_arguments, build_profile, one_layer
from megatron_parcae.training.arguments import parse_args
from reconfig.layout import ModelShape

TINY = ["--config", "configs/gpt-tiny.yaml"]

# Runs `parcae profile` with each model the command builds reported on stdout.
_RECORDING = """
import sys
import megatron_parcae.training.runtime as runtime
from megatron_parcae.cli import main

class Recording(runtime.LayoutRuntime):
    def __init__(self, args, vocab_size):
        super().__init__(args, vocab_size)
        print("built parameters:", sum(p.numel() for p in self.model[0].parameters()))

runtime.LayoutRuntime = Recording
sys.exit(main(sys.argv[1:]))
"""


def _profile(tmp_path, *extra: str, script: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *(script or ["-m", "megatron_parcae.cli"]), "profile", "--output",
                           str(tmp_path / "p.json"), "--repeats", "2", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _options(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--output", "unused.json", *flags])


def test_profile_repeats_the_layer_and_shares_the_step_over_the_whole_models_units():
    args = parse_args([*TINY, "--num-layers", "12", "--mock-data", "--vocab-size", "384"],
                      prog="test", model="gpt", world_size=1)
    assert (one_layer(args).num_layers, one_layer(args).stage_layers, args.num_layers) == (1, (1,), 12)
    unit = {"forward_ms": 1.0, "backward_ms": 2.0, "optimizer_ms": 0.0, "activation_bytes": 3.0, "output_bytes": 4.0}
    measured = {"embedding": unit, "layer": {**unit, "forward_ms": 5.0}, "head": unit, "optimizer_ms": 10.0,
                "vocab_size": 384, "device": "test"}
    profile = build_profile(args, measured, _options())
    shape = ModelShape.from_args(args, 384)
    assert profile["model_shape"] == shape.to_dict()
    assert [u["forward_ms"] for u in profile["layers"]] == [5.0] * 12
    # The one-layer model's step, per parameter, for each unit of the whole model.
    built = dataclasses.replace(shape, num_layers=1)
    per_param = 10.0 / sum(u.params for u in built.units())
    assert profile["layers"][11]["optimizer_ms"] == pytest.approx(per_param * shape.unit("layer.11").params)
    assert profile["embedding"]["optimizer_ms"] + profile["layers"][0]["optimizer_ms"] \
        + profile["head"]["optimizer_ms"] == pytest.approx(10.0)
    # Tensor-parallel all-reduces stay inside an instance: the cost constants' GPU link.
    assert profile["tensor_parallel_bytes_per_second"] == CostConstants.load().intra_instance_bytes_per_second
    assert profile["link_bytes_per_second"] == 1.25e9
    assert PipelineModel(profile, max_workers=4).model_shape == shape


def test_activation_bytes_leave_out_the_parameters():
    """Autograd saves weights too; they are state, counted per parameter, and under the
    distributed optimizer their storage is the whole model's parameter buffer."""
    import torch

    buffer = torch.zeros(1000)
    weight = torch.nn.Parameter(buffer[:64].view(8, 8))
    x = torch.ones(4, 8, requires_grad=True)
    unit, _ = UnitTimer(2, [weight]).measure(lambda: x @ weight)
    assert unit["activation_bytes"] == x.numel() * x.element_size()
    assert unit["output_bytes"] == 4 * 8 * 4


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", pytest.param("bert", marks=pytest.mark.extended)])
def test_profile_of_a_tiny_model_drives_the_pipeline_model(tiny_data, tmp_path, model):
    run = _profile(tmp_path, "--model", model, "--", "--config", f"configs/{model}-tiny.yaml")
    assert run.returncode == 0, run.stderr[-2000:]
    profile = json.loads((tmp_path / "p.json").read_text())
    assert len(profile["layers"]) == 4
    assert all(u["forward_ms"] > 0 and u["backward_ms"] > 0 and u["activation_bytes"] > 0 for u in profile["layers"])
    model = PipelineModel.load(str(tmp_path / "p.json"), max_workers=4)
    assert model.samples_per_second(model.best(4)) > model.samples_per_second(model.best(1))


@pytest.mark.slow
def test_profile_of_a_deep_model_builds_one_layer(tiny_data, tmp_path):
    """48 layers: the process builds one, whose figures stand for every layer of a profile
    that describes the 48-layer model and so is refused for another."""
    run = _profile(tmp_path, "--", *TINY, "--num-layers", "48", script=["-c", _RECORDING])
    assert run.returncode == 0, run.stderr[-2000:]
    profile = json.loads((tmp_path / "p.json").read_text())
    shape = ModelShape.from_args(parse_args([*TINY, "--num-layers", "48"], prog="test", model="gpt", world_size=1),
                                 profile["model_shape"]["vocab_size"])
    built = sum(u.params for u in dataclasses.replace(shape, num_layers=1).units())
    assert [line for line in run.stdout.splitlines() if line.startswith("built")] == [f"built parameters: {built}"]
    assert ModelShape.from_dict(profile["model_shape"]) == shape
    assert len(profile["layers"]) == 48 and all(u == profile["layers"][0] for u in profile["layers"])
    model = PipelineModel.load(str(tmp_path / "p.json"), max_workers=4)
    assert ForModels(model, [shape]).layouts() == model.layouts()
    with pytest.raises(ProfileError, match="sums to 48, the model has 4 layers"):
        ForModels(model, [dataclasses.replace(shape, num_layers=4)])


@pytest.mark.slow
def test_profile_refuses_a_parallel_layout(tiny_data, tmp_path):
    run = _profile(tmp_path, "--", *TINY, "--tensor-model-parallel-size", "2")
    assert run.returncode == 2
    assert "--tensor-model-parallel-size" in run.stderr


@pytest.mark.slow
def test_analytic_profile_has_the_measured_ones_layouts_and_shape(tiny_data, tmp_path):
    run = _profile(tmp_path, "--analytic", "--", *TINY)
    assert run.returncode == 0, run.stderr[-2000:]
    analytic = PipelineModel.load(str(tmp_path / "p.json"), max_workers=6)
    measured = PipelineModel.load(str(REPO / "configs/profiles/gpt-tiny-cpu.json"), max_workers=6)
    assert analytic.model_shape == measured.model_shape
    assert analytic.layouts() == measured.layouts()
    assert "(analytic)" in json.loads((tmp_path / "p.json").read_text())["device"]
