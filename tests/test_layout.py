"""reconfig.layout: unit sizes against real megatron-core models, rank order, JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reconfig.layout import (
    HEAD,
    POSITION_EMBEDDING,
    WORD_EMBEDDING,
    Layout,
    ModelShape,
    Parallelism,
    Slot,
    balanced_partition,
    buildable_partitions,
    layer_unit,
    partition_layers,
)

# Builds stage chunks of real megatron-core models in a child process (it initialises
# torch.distributed, which must not leak into the test process) and prints, for each
# parameter, its size and whether megatron-core marks it tensor-parallel; and
# Megatron's own rank groups for a few (T, P, D).
MEGATRON_PROBE = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec

    def config(layers):
        return TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96,
                                 use_cpu_initialization=True, gradient_accumulation_fusion=False,
                                 masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False)
    chunks = []
    for kind in ("gpt", "bert"):
        for tied in (True, False):
            for pre, post, layers in ((True, True, 3), (True, False, 2), (False, True, 1)):
                common = dict(vocab_size=64, max_sequence_length=16, pre_process=pre, post_process=post,
                              share_embeddings_and_output_weights=tied)
                if kind == "gpt":
                    model = GPTModel(config(layers), get_gpt_layer_local_spec(), **common)
                else:
                    model = BertModel(config(layers), num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                                      add_binary_head=True, **common)
                params = [[n, p.numel(), bool(getattr(p, "tensor_model_parallel", False))]
                          for n, p in model.named_parameters()]
                chunks.append({"kind": kind, "tied": tied, "pre": pre, "post": post, "params": params})
    groups = {}
    for t, p, d in ((2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 3, 1)):
        gen = ps.RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=1, order="tp-cp-ep-dp-pp")
        groups[f"{t},{p},{d}"] = {token: gen.get_ranks(token) for token in ("tp", "pp", "dp")}
    print(json.dumps({"chunks": chunks, "groups": groups}))
""")


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core")
    store = tmp_path_factory.mktemp("probe") / "store"
    done = subprocess.run([sys.executable, "-c", MEGATRON_PROBE, str(store)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def tiny(kind: str, tied: bool, layers: int) -> ModelShape:
    return ModelShape(kind, layers, 32, 4, 96, 64, 16, tied_embeddings=tied)


def unit_of(name: str, layer_offset: int, tied: bool) -> str:
    """Which planning unit megatron-core parameter `name` belongs to."""
    if name.startswith("embedding.word_embeddings"):
        return WORD_EMBEDDING
    if name.startswith("embedding."):
        return POSITION_EMBEDDING
    parts = name.split(".")
    if parts[0] in ("decoder", "encoder") and parts[1] == "layers":
        return layer_unit(layer_offset + int(parts[2]))
    if name == "output_layer.weight" and tied:
        return WORD_EMBEDDING  # the tied copy on the last stage
    return HEAD


@pytest.mark.slow
def test_stage_units_match_megatron_core_parameters(megatron: dict) -> None:
    """Each chunk's parameters, grouped into units and split/replicated by megatron-core's own
    tensor_model_parallel flag, equal what stage_units predicts (P=1: 3 layers; P=2: 2 + 1)."""
    for chunk in megatron["chunks"]:
        kind, tied, pre, post = chunk["kind"], chunk["tied"], chunk["pre"], chunk["post"]
        shape = tiny(kind, tied, 3)
        parallelism = Parallelism(1, 1, 1, (3,)) if pre and post else Parallelism(1, 2, 1, (2, 1))
        stage = 1 if not pre else 0
        offset = parallelism.layers_of_stage(stage).start
        measured: dict[str, list[int]] = {}
        for name, numel, split in chunk["params"]:
            counts = measured.setdefault(unit_of(name, offset, tied), [0, 0])
            counts[0 if split else 1] += numel
        expected = {u.name: [u.split_params, u.replicated_params] for u in parallelism.stage_units(shape, stage)}
        assert measured == expected, (kind, tied, pre, post)


@pytest.mark.slow
def test_rank_order_matches_megatron_rank_generator(megatron: dict) -> None:
    for key, groups in megatron["groups"].items():
        t, p, d = map(int, key.split(","))
        parallelism = Parallelism.even(p * 2, t, p, d)
        for token, field in (("tp", "tp"), ("pp", "pp"), ("dp", "dp")):
            for group in groups[token]:
                slots = [parallelism.slot(r) for r in group]
                # a group varies exactly one coordinate, in rank order
                assert [getattr(s, field) for s in slots] == list(range(len(group)))
                others = {tuple(getattr(s, f) for f in ("tp", "pp", "dp") if f != field) for s in slots}
                assert len(others) == 1
        assert all(parallelism.rank(parallelism.slot(r)) == r for r in range(parallelism.world_size))


def test_tied_copy_counted_only_with_several_stages() -> None:
    shape = ModelShape("gpt", 4, 64, 4, 256, 1000, 128)
    one = Parallelism(1, 1, 1, (4,))
    two = Parallelism(1, 2, 1, (2, 2))
    total = sum(u.params for u in shape.units())
    assert sum(u.params for u in one.stage_units(shape, 0)) == total
    held = sum(u.params for s in range(2) for u in two.stage_units(shape, s))
    assert held == total + 1000 * 64
    untied = ModelShape("gpt", 4, 64, 4, 256, 1000, 128, tied_embeddings=False)
    assert sum(u.params for s in range(2) for u in two.stage_units(untied, s)) == sum(
        u.params for u in untied.units())


def test_partition_layers() -> None:
    assert partition_layers(8, 4) == (2, 2, 2, 2)
    assert partition_layers(10, 4, first_stage_layers=1, last_stage_layers=3) == (1, 3, 3, 3)
    assert partition_layers(9, 3, last_stage_layers=1) == (4, 4, 1)
    assert partition_layers(5, 1) == (5,)
    with pytest.raises(ValueError, match="leaves 7 layers for 2 even stages"):
        partition_layers(9, 3, first_stage_layers=2)
    with pytest.raises(ValueError, match="48 layers over 32 stages"):
        partition_layers(48, 32)


def test_buildable_partitions_are_every_partition_layers_split() -> None:
    for layers in range(1, 13):
        for pp in range(1, 8):
            splits = set()
            for first in range(1, layers + 1):
                for last in range(1, layers + 1):
                    try:
                        splits.add(partition_layers(layers, pp, first, last))
                    except ValueError:
                        pass
            assert sorted(buildable_partitions(layers, pp)) == sorted(splits), (layers, pp)


def test_balanced_partition_is_buildable_and_balanced() -> None:
    assert balanced_partition(48, 7) == (6, 7, 7, 7, 7, 7, 7)
    assert balanced_partition(48, 10) == (4,) + (5,) * 8 + (4,)
    assert balanced_partition(48, 8) == (6,) * 8
    with pytest.raises(ValueError, match="3 layers cannot be split over 4 pipeline stages"):
        balanced_partition(3, 4)


def test_layout_slots_and_lookups() -> None:
    layout = Layout(Parallelism.even(4, 2, 2, 2), (7, 6, 5, 4, 3, 2, 1, 0))
    assert layout.slot_of(4) == Slot(tp=1, pp=0, dp=1)  # rank 3 = 1 + 2*(1 + 2*0)
    assert layout.worker_at(Slot(tp=0, pp=1, dp=0)) == 3
    assert (layout.tp, layout.pp, layout.dp, layout.stage_layers) == (2, 2, 2, (2, 2))
    with pytest.raises(ValueError, match="worker 9 has no slot"):
        layout.slot_of(9)
    assert layout.dp_peers(4) == {6}  # tp 1, pp 0: ranks 1 and 3
    assert Layout(Parallelism.even(4, 1, 1, 3), (2, 0, 1)).dp_peers(0) == {1, 2}
    assert Layout(Parallelism.even(4, 2, 2, 1), (0, 1, 2, 3)).dp_peers(3) == frozenset()


def test_json_round_trip() -> None:
    layout = Layout(Parallelism(2, 3, 1, (1, 2, 3)), (5, 0, 3, 9, 1, 2))
    data = json.loads(json.dumps(layout.to_dict()))
    assert Layout.from_dict(data) == layout
    shape = ModelShape("bert", 24, 1024, 16, 4096, 30592, 512, param_bytes_per_param=2,
                       optimizer_bytes_per_param=12)
    assert ModelShape.from_dict(json.loads(json.dumps(shape.to_dict()))) == shape
    assert shape.state_bytes_per_param == 14


GOOD = {"tp": 2, "pp": 2, "dp": 1, "stage_layers": [2, 2], "slots": [0, 1, 2, 3]}


@pytest.mark.parametrize("change, message", [
    ({"tp": "2"}, "layout.tp: expected an integer"),
    ({"dp": True}, "layout.dp: expected an integer"),
    ({"pp": 0}, "layout.pp: must be >= 1"),
    ({"stage_layers": [4]}, "layout.stage_layers: 1 stages given, pp is 2"),
    ({"stage_layers": [2, "x"]}, r"layout.stage_layers\[1\]: expected an integer"),
    ({"stage_layers": [2, 0]}, r"layout.stage_layers\[1\]: must be >= 1"),
    ({"slots": [0, 1, 2]}, r"layout.slots: expected 4 worker ids \(tp\*pp\*dp\), got 3"),
    ({"slots": [0, 1, 1, 3]}, r"layout.slots: worker\(s\) \[1\] appear in more than one slot"),
    ({"slots": [0, 1, 2, -3]}, r"layout.slots\[3\]: must be >= 0"),
    ({"slots": "0123"}, "layout.slots: expected a list of integers"),
    ({"extra": 1}, r"layout: unknown field\(s\) extra"),
])
def test_layout_validation_names_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout.from_dict({**GOOD, **change})


def test_layout_validation_structure() -> None:
    with pytest.raises(ValueError, match=r"layout: missing field\(s\) slots"):
        Layout.from_dict({k: v for k, v in GOOD.items() if k != "slots"})
    with pytest.raises(ValueError, match="layout: expected a JSON object, got list"):
        Layout.from_dict([1, 2])
    with pytest.raises(ValueError, match="stages between must hold equal layer counts"):
        Parallelism(1, 4, 1, (1, 2, 3, 2))


def test_model_shape_validation() -> None:
    good = ModelShape("gpt", 4, 64, 4, 256, 100, 32).to_dict()
    with pytest.raises(ValueError, match="model.kind: expected one of gpt, bert"):
        ModelShape.from_dict({**good, "kind": "t5"})
    with pytest.raises(ValueError, match="model.hidden_size: 64 is not a multiple of num_attention_heads 5"):
        ModelShape.from_dict({**good, "num_attention_heads": 5})
    with pytest.raises(ValueError, match=r"model: missing field\(s\) vocab_size"):
        ModelShape.from_dict({k: v for k, v in good.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="model.tied_embeddings: expected true or false"):
        ModelShape.from_dict({**good, "tied_embeddings": "yes"})
    shape = ModelShape.from_dict(good)
    with pytest.raises(ValueError, match="layout.stage_layers: sums to 6, the model has 4 layers"):
        shape.check(Parallelism(1, 2, 1, (3, 3)))
    with pytest.raises(ValueError, match="model.num_attention_heads 4 is not divisible by layout.tp 3; "
                                         "model.ffn_hidden_size 256 is not divisible by layout.tp 3"):
        shape.check(Parallelism(3, 1, 1, (4,)))
    with pytest.raises(ValueError, match="global_batch_size 6 is not divisible by micro_batch_size 2 x layout.dp 2"):
        shape.check(Parallelism(1, 1, 2, (4,)), micro_batch_size=2, global_batch_size=6)
    shape.check(Parallelism(2, 2, 2, (2, 2)), micro_batch_size=2, global_batch_size=8)


def test_model_shape_from_arguments() -> None:
    args = argparse.Namespace(model="bert", num_layers=24, hidden_size=1024, num_attention_heads=16,
                              ffn_hidden_size=4096, max_position_embeddings=512, bf16=True, fp16=False)
    assert ModelShape.from_args(args, 30592) == ModelShape("bert", 24, 1024, 16, 4096, 30592, 512,
                                                           param_bytes_per_param=2, optimizer_bytes_per_param=12)
    assert ModelShape.from_args(argparse.Namespace(**{**vars(args), "bf16": False}), 30592).state_bytes_per_param == 12
