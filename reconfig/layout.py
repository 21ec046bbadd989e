"""Model sizes, parallel layouts and the rank -> slot assignment, as plain data.

Planning must be cheap (the liveput optimizer plans thousands of migrations per decision)
and must travel through etcd as JSON, so nothing here imports torch: a model is reduced
to the parameter counts of its state units, and a layout to integers.

State units (what one pipeline stage can hold, by name):
- ``embedding.word``: the word embedding table, vocab x hidden, split over TP on the
  vocabulary dimension. Stage 0 holds it. With tied embeddings and P > 1 the last stage
  holds it too: megatron-core's ``output_layer.weight`` there is a copy kept equal to it
  (same all-reduced gradient, hence the same Adam moments), so either copy is a source.
- ``embedding.position``: learned position embeddings, none under RoPE (plus BERT's
  token-type embeddings), replicated over TP. Stage 0 only.
- ``layer.{i}``: transformer layer i (global index), on the stage whose range holds i.
- ``head``: final layernorm, plus the output layer when embeddings are untied, plus for
  BERT the LM head (dense + layernorm + output bias) and the pooler and binary head.
  Last stage only.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

WORD_EMBEDDING = "embedding.word"
POSITION_EMBEDDING = "embedding.position"
HEAD = "head"
MODEL_KINDS = ("gpt", "bert")
# How `ModelShape.problems` names what it checks; argument parsing passes flag names instead.
LAYOUT_NAMES = {
    "num_attention_heads": "model.num_attention_heads", "ffn_hidden_size": "model.ffn_hidden_size",
    "num_query_groups": "model.num_query_groups",
    "tp": "layout.tp", "dp": "layout.dp", "stage_layers": "layout.stage_layers",
    "micro_batch_size": "micro_batch_size", "global_batch_size": "global_batch_size",
}


def layer_unit(layer: int) -> str:
    """Name of the state unit of global transformer layer `layer`."""
    return f"layer.{layer}"


# Validation of JSON read from etcd or files, shared by reconfig: errors name the field.
def require_int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: must be >= {minimum}, got {value}")
    return value


def require_fields(where: str, d: Any, required: set[str], optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    missing = sorted(required - d.keys())
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = sorted(d.keys() - required - optional)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")


def require_int_list(where: str, value: Any, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list of integers, got {type(value).__name__}")
    return tuple(require_int(f"{where}[{i}]", v, minimum) for i, v in enumerate(value))


@dataclass(frozen=True)
class StateUnit:
    """A piece of model state that always moves whole between pipeline stages."""

    name: str
    split_params: int  # partitioned over TP (per full model): rank t holds [t/T, (t+1)/T)
    replicated_params: int  # held whole by every TP rank (layernorms, row-parallel biases)

    @property
    def params(self) -> int:
        return self.split_params + self.replicated_params


@dataclass(frozen=True)
class ModelShape:
    """What planning needs to know of a model: sizes only.

    `vocab_size` is the size of the embedding table as built (Megatron pads it to a
    multiple of 128 x T; padding rows carry no state worth counting). State bytes per
    parameter are split into what every data-parallel replica keeps (the parameter) and
    what the distributed optimizer shards over DP (fp32 main copy if any, Adam moments):
    fp32 training is 4 + 8 (Parcae's 12 bytes), bf16 with fp32 main params 2 + 12.
    """

    kind: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tied_embeddings: bool = True
    param_bytes_per_param: int = 4
    optimizer_bytes_per_param: int = 8
    num_query_groups: int | None = None  # grouped-query attention's key/value heads; None: one per head
    gated_mlp: bool = False  # SwiGLU: fc1 is twice as wide ([gate; up])
    learned_position_embeddings: bool = True  # False under RoPE, which has no parameters

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model.kind: expected one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "max_position_embeddings", "param_bytes_per_param"):
            require_int(f"model.{name}", getattr(self, name), 1)
        require_int("model.optimizer_bytes_per_param", self.optimizer_bytes_per_param, 0)
        for name in ("tied_embeddings", "gated_mlp", "learned_position_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.num_query_groups is not None:
            require_int("model.num_query_groups", self.num_query_groups, 1)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(f"model.num_query_groups: {self.num_query_groups} does not divide "
                                 f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size: {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")

    @property
    def state_bytes_per_param(self) -> int:
        return self.param_bytes_per_param + self.optimizer_bytes_per_param

    @cached_property
    def _units(self) -> dict[str, StateUnit]:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        # Pre-LN layer: QKV (q + 2 kv rows of h, kv = h under plain attention) and fc1 (f or,
        # gated, 2f rows of h) are column-parallel with split biases; proj (h x h) and fc2
        # (h x f) are row-parallel with replicated biases.
        groups = self.num_query_groups or self.num_attention_heads
        qkv = h + 2 * groups * (h // self.num_attention_heads)
        fc1 = 2 * f if self.gated_mlp else f
        layer_split = (qkv + h) * h + (fc1 + f) * h + qkv + fc1
        layer_replicated = 2 * h + h + 2 * h + h  # two layernorms, proj and fc2 biases
        output_weight = 0 if self.tied_embeddings else v * h
        learned = self.max_position_embeddings * h if self.learned_position_embeddings else 0
        if self.kind == "gpt":
            position = learned
            head = StateUnit(HEAD, output_weight, 2 * h)
        else:
            position = learned + 2 * h  # + 2 token types
            # final layernorm, LM-head dense + layernorm, pooler dense, binary head (h -> 2);
            # the output layer has a vocab-sized bias split like its weight.
            head = StateUnit(HEAD, output_weight + v, 2 * h + (h * h + h) + 2 * h + (h * h + h) + (2 * h + 2))
        units = [StateUnit(WORD_EMBEDDING, v * h, 0), StateUnit(POSITION_EMBEDDING, 0, position)]
        units += [StateUnit(layer_unit(i), layer_split, layer_replicated) for i in range(self.num_layers)]
        units.append(head)
        return {u.name: u for u in units}

    def units(self) -> tuple[StateUnit, ...]:
        """Every state unit of the model, each once (the tied copy is not a unit of its own)."""
        return tuple(self._units.values())

    def unit(self, name: str) -> StateUnit:
        try:
            return self._units[name]
        except KeyError:
            raise ValueError(f"unknown state unit {name!r} for a {self.num_layers}-layer {self.kind}") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace, vocab_size: int) -> ModelShape:
        """The model a run's Megatron-LM arguments describe, `vocab_size` as built; state
        bytes per parameter follow from --bf16/--fp16 (see the class docstring)."""
        half = args.bf16 or args.fp16
        return cls(args.model, args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size,
                   vocab_size, args.max_position_embeddings,
                   tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                   param_bytes_per_param=2 if half else 4, optimizer_bytes_per_param=12 if half else 8,
                   num_query_groups=getattr(args, "num_query_groups", None),
                   gated_mlp=getattr(args, "swiglu", False),
                   learned_position_embeddings=getattr(args, "position_embedding_type", "learned_absolute") != "rope")

    def problems(self, parallelism: Parallelism, micro_batch_size: int | None = None,
                 global_batch_size: int | None = None, names: Mapping[str, str] = LAYOUT_NAMES) -> list[str]:
        """Why megatron-core cannot train this model in `parallelism`; empty when it can.

        Given the batch sizes, D must also split the global batch into whole micro-batches.
        Every place that asks whether a layout fits a model asks here, so the argument
        parser, the live worker, the planner and the throughput models agree.
        """
        found = []
        if sum(parallelism.stage_layers) != self.num_layers:
            found.append(f"{names['stage_layers']}: sums to {sum(parallelism.stage_layers)}, "
                         f"the model has {self.num_layers} layers")
        for name in ("num_attention_heads", "ffn_hidden_size", *(("num_query_groups",) if self.num_query_groups else ())):
            if getattr(self, name) % parallelism.tp:
                found.append(f"{names[name]} {getattr(self, name)} is not divisible by {names['tp']} {parallelism.tp}")
        if global_batch_size is not None and global_batch_size % (micro_batch_size * parallelism.dp):
            found.append(f"{names['global_batch_size']} {global_batch_size} is not divisible by "
                         f"{names['micro_batch_size']} {micro_batch_size} x {names['dp']} {parallelism.dp}")
        return found

    def check(self, parallelism: Parallelism, micro_batch_size: int | None = None,
              global_batch_size: int | None = None) -> None:
        """Raise ValueError naming every one of `problems`."""
        found = self.problems(parallelism, micro_batch_size, global_batch_size)
        if found:
            raise ValueError("; ".join(found))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Any) -> ModelShape:
        fields = set(cls.__dataclass_fields__)
        require_fields("model", d, fields - {"tied_embeddings", "param_bytes_per_param", "optimizer_bytes_per_param",
                                             "num_query_groups", "gated_mlp", "learned_position_embeddings"},
                    frozenset(fields))
        return cls(**d)


def partition_layers(num_layers: int, pp: int, first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None) -> tuple[int, ...]:
    """Layers per stage as megatron-core builds them: given first/last stages, the rest even.

    Mirrors `num_layers_in_first/last_pipeline_stage`: the stages in between must split
    the remaining layers evenly, or megatron-core refuses the configuration.
    """
    require_int("num_layers", num_layers, 1)
    require_int("pp", pp, 1)
    if pp == 1:
        if first_stage_layers not in (None, num_layers) or last_stage_layers not in (None, num_layers):
            raise ValueError(f"first/last stage layers: a single stage holds all {num_layers} layers")
        return (num_layers,)
    first = require_int("first_stage_layers", first_stage_layers, 1) if first_stage_layers is not None else None
    last = require_int("last_stage_layers", last_stage_layers, 1) if last_stage_layers is not None else None
    middle_count = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < middle_count or (middle_count == 0 and rest != 0) or (middle_count and rest % middle_count):
        raise ValueError(f"stage layers: {num_layers} layers over {pp} stages with first={first}, last={last} "
                         f"leaves {rest} layers for {middle_count} even stages")
    even = rest // middle_count if middle_count else 0
    return ((first if first is not None else even),) + (even,) * (pp - 2) + ((last if last is not None else even),)


def buildable_partitions(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    """Every split `partition_layers` gives for some first and last stage, fewest layers
    per middle stage first, then the lightest first stage."""
    if pp == 1:
        return [partition_layers(num_layers, 1)]
    middles = range(1, (num_layers - 2) // (pp - 2) + 1) if pp > 2 else (0,)
    return [partition_layers(num_layers, pp, first, ends - first)
            for ends in (num_layers - (pp - 2) * middle for middle in middles) for first in range(1, ends)]


def balanced_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """The buildable split whose largest stage is smallest (ties: the most even, then the
    lighter first stage, which also holds the embedding)."""
    options = buildable_partitions(num_layers, pp)
    if not options:
        raise ValueError(f"{num_layers} layers cannot be split over {pp} pipeline stages")
    return min(options, key=lambda s: (max(s), max(s) - min(s), s[0]))


@dataclass(frozen=True)
class Slot:
    """A place in a layout: tensor-, pipeline- and data-parallel rank."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Parallelism:
    """(T, P, D) and the layer partition: a layout before workers are assigned to slots.

    This is what the liveput optimizer chooses and the planner takes as its target.
    """

    tp: int
    pp: int
    dp: int
    stage_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            require_int(f"layout.{name}", getattr(self, name), 1)
        layers = require_int_list("layout.stage_layers", self.stage_layers, 1)
        object.__setattr__(self, "stage_layers", layers)
        if len(layers) != self.pp:
            raise ValueError(f"layout.stage_layers: {len(layers)} stages given, pp is {self.pp}")
        if len(set(layers[1:-1])) > 1:
            raise ValueError(f"layout.stage_layers: {list(layers)}: megatron-core builds only the first and "
                             f"last stages uneven, the stages between must hold equal layer counts")

    @classmethod
    def even(cls, num_layers: int, tp: int, pp: int, dp: int) -> Parallelism:
        return cls(tp, pp, dp, partition_layers(num_layers, pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, slot: Slot) -> int:
        """Megatron's global rank of `slot` (order tp-cp-ep-dp-pp, cp = ep = 1)."""
        return slot.tp + self.tp * (slot.dp + self.dp * slot.pp)

    def slot(self, rank: int) -> Slot:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Slot(tp=rank % self.tp, pp=rank // (self.tp * self.dp), dp=(rank // self.tp) % self.dp)

    def layers_of_stage(self, stage: int) -> range:
        start = sum(self.stage_layers[:stage])
        return range(start, start + self.stage_layers[stage])

    def stage_units(self, shape: ModelShape, stage: int) -> tuple[StateUnit, ...]:
        """The state units a rank of `stage` holds (its TP slice of each, see StateUnit)."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} outside 0..{self.pp - 1}")
        names = [WORD_EMBEDDING, POSITION_EMBEDDING] if stage == 0 else []
        names += [layer_unit(i) for i in self.layers_of_stage(stage)]
        if stage == self.pp - 1:
            if shape.tied_embeddings and self.pp > 1:
                names.append(WORD_EMBEDDING)  # megatron-core's tied output_layer copy
            names.append(HEAD)
        return tuple(shape.unit(n) for n in names)

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "stage_layers": list(self.stage_layers)}

    @classmethod
    def from_dict(cls, d: Any) -> Parallelism:
        require_fields("layout", d, {"tp", "pp", "dp", "stage_layers"})
        return cls(d["tp"], d["pp"], d["dp"], require_int_list("layout.stage_layers", d["stage_layers"], 1))


@dataclass(frozen=True)
class Layout:
    """A parallelism plus which worker sits in each slot.

    Worker ids are stable process identities across generations, not ranks; `slots[r]`
    is the worker that gets Megatron global rank r in this layout.
    """

    parallelism: Parallelism
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.parallelism, Parallelism):
            raise ValueError(f"layout.parallelism: expected a Parallelism, got {type(self.parallelism).__name__}")
        slots = require_int_list("layout.slots", self.slots, 0)
        object.__setattr__(self, "slots", slots)
        if len(slots) != self.parallelism.world_size:
            raise ValueError(f"layout.slots: expected {self.parallelism.world_size} worker ids (tp*pp*dp), "
                             f"got {len(slots)}")
        if len(set(slots)) != len(slots):
            repeated = sorted({w for w in slots if slots.count(w) > 1})
            raise ValueError(f"layout.slots: worker(s) {repeated} appear in more than one slot")

    tp = property(lambda self: self.parallelism.tp)
    pp = property(lambda self: self.parallelism.pp)
    dp = property(lambda self: self.parallelism.dp)
    stage_layers = property(lambda self: self.parallelism.stage_layers)

    @cached_property
    def _rank_of(self) -> dict[int, int]:
        return {w: r for r, w in enumerate(self.slots)}

    @property
    def workers(self) -> frozenset[int]:
        return frozenset(self.slots)

    def rank_of(self, worker: int) -> int:
        try:
            return self._rank_of[worker]
        except KeyError:
            raise ValueError(f"worker {worker} has no slot in this layout") from None

    def slot_of(self, worker: int) -> Slot:
        return self.parallelism.slot(self.rank_of(worker))

    def dp_peers(self, worker: int) -> frozenset[int]:
        """The other workers of `worker`'s DP group: they hold the same slice of the model."""
        mine = self.slot_of(worker)
        return frozenset(self.worker_at(Slot(mine.tp, mine.pp, d)) for d in range(self.dp) if d != mine.dp)

    def worker_at(self, slot: Slot) -> int:
        return self.slots[self.parallelism.rank(slot)]

    def to_dict(self) -> dict[str, Any]:
        return {**self.parallelism.to_dict(), "slots": list(self.slots)}

    @classmethod
    def from_dict(cls, d: Any) -> Layout:
        require_fields("layout", d, {"tp", "pp", "dp", "stage_layers", "slots"})
        parallelism = Parallelism.from_dict({k: v for k, v in d.items() if k != "slots"})
        return cls(parallelism, require_int_list("layout.slots", d["slots"], 0))
