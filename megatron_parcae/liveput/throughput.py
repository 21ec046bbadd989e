"""How fast a parallel layout trains, and whether it fits at all.

The liveput optimizer only asks two questions of a layout (T, P, D): its training
throughput in samples per second, and whether it can run (memory, divisibility). Two
sources answer them behind one interface, `ThroughputModel`:

`ProfileTable` reads measured throughputs, a CSV in the format of Parcae's published
tables (benchmarks/anchors/parcae/*.csv)::

    # any comment; key=value words in comments are metadata, e.g.
    # model=gpt-1.5b micro_batch_size=1 global_batch_size=128
    data_parallel,pipeline_stages,iteration_ms,samples_per_s[,tensor_parallel]
    4,8,2944.728,43.468

A configuration absent from the table is infeasible. `tensor_parallel` is optional (1).

`PipelineModel` predicts throughput with a 1F1B pipeline model from a per-layer profile,
a JSON file that `parcae profile` writes (format ``megatron-parcae-layer-profile``,
version 1)::

    {
      "format": "megatron-parcae-layer-profile", "version": 1,
      "model": "gpt-1.5b",                  # a name, for reports
      "device": "Tesla V100-SXM2-16GB",      # free text
      "micro_batch_size": 1, "global_batch_size": 128,
      "gpu_memory_bytes": 17179869184,       # usable memory of one GPU
      "link_bytes_per_second": 1.25e9,       # between workers (pipeline p2p, DP all-reduce)
      "tensor_parallel_bytes_per_second": 1.25e9,  # TP all-reduce (NVLink inside a node)
      "max_tensor_parallel": 8,
      "memory_bytes_per_param": 16,          # weights + grads + optimizer state on the GPU
      "gradient_bytes_per_param": 2,         # what the DP all-reduce moves
      "model_shape": {...},                  # reconfig.layout.ModelShape.to_dict()
      "embedding": UNIT, "layers": [UNIT, ...one per transformer layer], "head": UNIT
    }
    UNIT = {"forward_ms": f, "backward_ms": b, "optimizer_ms": o,
            "activation_bytes": a,   # kept per in-flight micro-batch until its backward
            "output_bytes": y}       # sent to the next stage per micro-batch

Times are for one micro-batch on one GPU at T = 1; parameter counts come from the model
shape. A micro-batch on stage s takes the sum of its units' forward and backward times
divided by T, plus four TP all-reduces of `output_bytes` per layer (ring all-reduce),
plus the p2p send of its output; an iteration takes (m + P - 1) micro-batch slots of
the slowest stage (m = global batch / (micro batch x D)), plus the DP gradient
all-reduce and the optimizer step of the slowest stage. A stage keeps min(P - s, m)
micro-batches of activations in flight (1F1B); a layout whose busiest rank needs more
than `gpu_memory_bytes` is infeasible, as is one whose D does not divide the global
batch into whole micro-batches or whose T does not divide the heads.
"""

from __future__ import annotations

import abc
import bisect
import csv
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Collection

from reconfig.layout import LAYOUT_NAMES, ModelShape, Parallelism, balanced_partition, buildable_partitions
from reconfig.placement import Placement

PROFILE_FORMAT = "megatron-parcae-layer-profile"
PROFILE_VERSION = 1
_CSV_COLUMNS = ("data_parallel", "pipeline_stages", "iteration_ms", "samples_per_s")


class ProfileError(ValueError):
    """A profile that cannot be used; the message says which file, where and why."""


class ThroughputModel(abc.ABC):
    """Throughput of every feasible layout of one model at one global batch size."""

    model: str
    global_batch_size: int
    model_shape: ModelShape
    link_bytes_per_second: float | None = None  # between workers, as priced; None: a table measured its own

    def with_link(self, bytes_per_second: float) -> ThroughputModel:
        """This model with the network between workers measured at `bytes_per_second`; a
        table's throughputs were measured on its own network and stay."""
        return self

    @abc.abstractmethod
    def layouts(self) -> tuple[Parallelism, ...]:
        """Every feasible layout, fewest workers first."""

    @abc.abstractmethod
    def samples_per_second(self, layout: Parallelism) -> float:
        """Training throughput of `layout`; 0.0 when it is infeasible."""

    @cached_property
    def _table(self) -> dict[Parallelism, float]:
        return {p: self.samples_per_second(p) for p in self.layouts()}

    @property
    def max_workers(self) -> int:
        return max(p.world_size for p in self.layouts())

    @cached_property
    def _sizes(self) -> list[int]:
        return [p.world_size for p in self.layouts()]

    def fitting(self, workers: int) -> tuple[Parallelism, ...]:
        """Feasible layouts that need at most `workers` workers."""
        return self.layouts()[:bisect.bisect_right(self._sizes, workers)]

    def best(self, workers: int) -> Parallelism | None:
        """The highest-throughput layout on `workers` workers (ties: fewer workers)."""
        fits = self.fitting(workers)
        if not fits:
            return None
        return max(fits, key=lambda p: (self._table[p], -p.world_size))

    def best_samples_per_second(self, workers: int) -> float:
        best = self.best(workers)
        return 0.0 if best is None else self._table[best]


def _metadata(comment: str) -> dict[str, str]:
    words = comment.lstrip("#").split()
    return dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("="))


class ProfileTable(ThroughputModel):
    """Measured throughputs per (T, P, D), from a CSV (format in the module docstring)."""

    def __init__(self, rows: dict[tuple[int, int, int], float], model: str, global_batch_size: int,
                 model_shape: ModelShape):
        self.model = model
        self.global_batch_size = global_batch_size
        self.model_shape = model_shape
        self._rows: dict[Parallelism, float] = {}
        for (tp, pp, dp), rate in rows.items():
            try:
                parallelism = Parallelism(tp, pp, dp, balanced_partition(model_shape.num_layers, pp))
            except ValueError:
                continue  # more stages than layers
            if not model_shape.problems(parallelism):  # else a row this model shape cannot build
                self._rows[parallelism] = rate
        if not self._rows:
            raise ProfileError(f"profile of {model}: no configuration fits a {model_shape.num_layers}-layer model")
        self._layouts = tuple(sorted(self._rows, key=lambda p: (p.world_size, p.tp, p.pp, p.dp)))

    @staticmethod
    def read_metadata(path: str | Path) -> dict[str, str]:
        """The key=value words of the CSV's comment lines (model name, batch sizes)."""
        try:
            with open(path, encoding="utf-8") as f:
                return {k: v for line in f if line.startswith("#") for k, v in _metadata(line).items()}
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None

    @classmethod
    def load(cls, path: str | Path, model_shape: ModelShape) -> ProfileTable:
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        meta: dict[str, str] = {}
        header: list[str] | None = None
        rows: dict[tuple[int, int, int], float] = {}
        for number, line in enumerate(lines, start=1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            if line.startswith("#"):
                meta.update(_metadata(line))
                continue
            fields = [f.strip() for f in next(csv.reader([line]))]
            if header is None:
                missing = [c for c in _CSV_COLUMNS if c not in fields]
                if missing:
                    raise ProfileError(f"{where}: header lacks column(s) {', '.join(missing)}")
                header = fields
                continue
            if len(fields) != len(header):
                raise ProfileError(f"{where}: {len(fields)} fields, the header has {len(header)}")
            row = dict(zip(header, fields))
            dp, pp = _csv_size(where, row, "data_parallel"), _csv_size(where, row, "pipeline_stages")
            tp = _csv_size(where, row, "tensor_parallel") if "tensor_parallel" in row else 1
            _csv_number(where, row, "iteration_ms")
            rate = _csv_number(where, row, "samples_per_s")
            if (tp, pp, dp) in rows:
                raise ProfileError(f"{where}: configuration T={tp} P={pp} D={dp} appears twice")
            rows[(tp, pp, dp)] = rate
        if header is None or not rows:
            raise ProfileError(f"{path}: no configurations (expected a header {','.join(_CSV_COLUMNS)} and rows)")
        try:
            gbs = int(meta.get("global_batch_size", "0"))
        except ValueError:
            raise ProfileError(f"{path}: global_batch_size={meta['global_batch_size']!r} is not an integer") from None
        return cls(rows, meta.get("model", path.stem), gbs, model_shape)

    def layouts(self) -> tuple[Parallelism, ...]:
        return self._layouts

    def samples_per_second(self, layout: Parallelism) -> float:
        return self._rows.get(layout, 0.0)


def _csv_size(where: str, row: dict[str, str], column: str) -> int:
    """A parallel size of a table row; the error names the file, line and column."""
    try:
        value = int(row[column])
    except ValueError:
        value = 0
    if value < 1:
        raise ProfileError(f"{where}: column {column}: expected a positive integer, got {row[column]!r}")
    return value


def _csv_number(where: str, row: dict[str, str], column: str) -> float:
    """A measured figure of a table row, positive and finite; the error as `_csv_size`'s."""
    try:
        value = float(row[column])
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ProfileError(f"{where}: column {column}: expected a positive number, got {row[column]!r}")
    return value


@dataclass(frozen=True)
class UnitProfile:
    """Measured cost of one state unit for one micro-batch at T = 1."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    activation_bytes: float
    output_bytes: float


def _number(where: str, d: dict[str, Any], key: str, positive: bool = False) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ProfileError(f"{where}.{key}: expected a {kind} number, got {value!r}")
    return float(value)


def _integer(where: str, d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{where}.{key}: expected a positive integer, got {value!r}")
    return value


def _unit(where: str, d: Any) -> UnitProfile:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected an object with forward_ms, backward_ms, optimizer_ms, "
                           f"activation_bytes, output_bytes")
    fields = ("forward_ms", "backward_ms", "optimizer_ms", "activation_bytes", "output_bytes")
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    return UnitProfile(*(_number(where, d, f) for f in fields))


class PipelineModel(ThroughputModel):
    """1F1B throughput and memory model from a per-layer profile (format in the module docstring)."""

    def __init__(self, profile: dict[str, Any], max_workers: int, source: str = "<profile>"):
        where = source
        if not isinstance(profile, dict):
            raise ProfileError(f"{where}: expected a JSON object")
        if profile.get("format") != PROFILE_FORMAT or profile.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}: not a {PROFILE_FORMAT} version {PROFILE_VERSION} file "
                               f"(format={profile.get('format')!r}, version={profile.get('version')!r})")
        try:
            self.model_shape = ModelShape.from_dict(profile.get("model_shape"))
        except (ValueError, TypeError) as exc:
            raise ProfileError(f"{where}: model_shape: {exc}") from None
        self.model = str(profile.get("model", "model"))
        self._profile, self._source = profile, source
        self.micro_batch_size = _integer(where, profile, "micro_batch_size")
        self.global_batch_size = _integer(where, profile, "global_batch_size")
        self.gpu_memory_bytes = _number(where, profile, "gpu_memory_bytes", positive=True)
        self.link_bytes_per_second = _number(where, profile, "link_bytes_per_second", positive=True)
        self.tp_bytes_per_second = _number(where, profile, "tensor_parallel_bytes_per_second", positive=True)
        self.max_tensor_parallel = _integer(where, profile, "max_tensor_parallel")
        self.memory_bytes_per_param = _number(where, profile, "memory_bytes_per_param", positive=True)
        self.gradient_bytes_per_param = _number(where, profile, "gradient_bytes_per_param", positive=True)
        layers = profile.get("layers")
        if not isinstance(layers, list) or len(layers) != self.model_shape.num_layers:
            raise ProfileError(f"{where}.layers: expected a list of {self.model_shape.num_layers} unit profiles")
        self._embedding = _unit(f"{where}.embedding", profile.get("embedding"))
        self._layers = tuple(_unit(f"{where}.layers[{i}]", u) for i, u in enumerate(layers))
        self._head = _unit(f"{where}.head", profile.get("head"))
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ProfileError(f"max_workers must be a positive integer, got {max_workers!r}")
        self._max_workers = max_workers
        self._rates: dict[Parallelism, float] = {}
        self._layouts = self._enumerate()

    @classmethod
    def load(cls, path: str | Path, max_workers: int) -> PipelineModel:
        try:
            profile = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"{path}: not JSON: {exc}") from None
        return cls(profile, max_workers, str(path))

    def with_link(self, bytes_per_second: float) -> PipelineModel:
        return PipelineModel({**self._profile, "link_bytes_per_second": bytes_per_second}, self._max_workers,
                             self._source)

    def _stage_params(self, parallelism: Parallelism, stage: int, tp: int) -> float:
        """Parameters one rank of `stage` holds at tensor-parallel size `tp`."""
        return sum(u.split_params / tp + u.replicated_params
                   for u in parallelism.stage_units(self.model_shape, stage))

    def _stage_units(self, pp: int, stage: int, stage_layers: tuple[int, ...]) -> list[UnitProfile]:
        start = sum(stage_layers[:stage])
        units = list(self._layers[start:start + stage_layers[stage]])
        if stage == 0:
            units.append(self._embedding)
        if stage == pp - 1:
            units.append(self._head)
        return units

    def _partition(self, pp: int) -> tuple[int, ...]:
        """Layers per stage: the megatron-buildable split with the fastest slowest stage."""
        options = buildable_partitions(self.model_shape.num_layers, pp)

        def slowest(stage_layers: tuple[int, ...]) -> float:
            return max(sum(u.forward_ms + u.backward_ms for u in self._stage_units(pp, s, stage_layers))
                       for s in range(pp))
        return min(options, key=lambda layers: (slowest(layers), max(layers) - min(layers)))

    def _iteration_seconds(self, p: Parallelism) -> float | None:
        """Seconds per iteration of `p`, or None when it does not fit in memory."""
        T, P, D = p.tp, p.pp, p.dp
        micro_batches = self.global_batch_size // (self.micro_batch_size * D)
        ring_tp = 2 * (T - 1) / T / self.tp_bytes_per_second
        ring_dp = 2 * (D - 1) / D / self.link_bytes_per_second
        slot = sync = 0.0
        for stage in range(P):
            units = self._stage_units(P, stage, p.stage_layers)
            layers = p.stage_layers[stage]
            params = self._stage_params(p, stage, T)
            in_flight = min(P - stage, micro_batches)
            memory = params * self.memory_bytes_per_param + in_flight * sum(u.activation_bytes for u in units) / T
            if memory > self.gpu_memory_bytes:
                return None
            compute = sum(u.forward_ms + u.backward_ms for u in units) / 1000 / T
            tp_comm = 4 * layers * (units[0].output_bytes if layers else 0.0) * ring_tp
            p2p = 2 * units[-1].output_bytes / self.link_bytes_per_second if P > 1 else 0.0
            slot = max(slot, compute + tp_comm + p2p)
            optimizer = sum(u.optimizer_ms for u in units) / 1000 / T
            sync = max(sync, params * self.gradient_bytes_per_param * ring_dp + optimizer)
        return (micro_batches + P - 1) * slot + sync

    def _enumerate(self) -> tuple[Parallelism, ...]:
        shape = self.model_shape
        partitions: dict[int, tuple[int, ...]] = {}
        found = []
        for tp in range(1, self.max_tensor_parallel + 1):
            for pp in range(1, min(shape.num_layers, self._max_workers // tp) + 1):
                for dp in range(1, self._max_workers // (tp * pp) + 1):
                    if pp not in partitions:
                        partitions[pp] = self._partition(pp)
                    p = Parallelism(tp, pp, dp, partitions[pp])
                    if shape.problems(p, self.micro_batch_size, self.global_batch_size):
                        continue
                    seconds = self._iteration_seconds(p)
                    if seconds is not None:
                        self._rates[p] = self.global_batch_size / seconds
                        found.append(p)
        if not found:
            raise ProfileError(f"profile of {self.model}: no layout fits in {self.gpu_memory_bytes:.3g} bytes "
                               f"of GPU memory on up to {self._max_workers} workers")
        return tuple(sorted(found, key=lambda p: (p.world_size, p.tp, p.pp, p.dp)))

    def layouts(self) -> tuple[Parallelism, ...]:
        return self._layouts

    def samples_per_second(self, layout: Parallelism) -> float:
        return self._rates.get(layout, 0.0)


class _Subset(ThroughputModel):
    """Some layouts of `base`, priced as `base` prices them."""

    def __init__(self, base: ThroughputModel, layouts: tuple[Parallelism, ...]):
        self.base = base
        self.model, self.global_batch_size, self.model_shape = base.model, base.global_batch_size, base.model_shape
        self.link_bytes_per_second = base.link_bytes_per_second
        self._layouts = layouts
        self._fits = frozenset(layouts)

    def with_link(self, bytes_per_second: float) -> ThroughputModel:
        return _Subset(self.base.with_link(bytes_per_second), self._layouts)  # the link decides no layout's fit

    def layouts(self) -> tuple[Parallelism, ...]:
        return self._layouts

    def samples_per_second(self, layout: Parallelism) -> float:
        return self.base.samples_per_second(layout) if layout in self._fits else 0.0


class OnInstances(_Subset):
    """The layouts of `base` whose tensor-parallel groups stay inside instances of G GPUs
    (T divides G): a TP group all-reduces in every layer, which needs the instance's own
    GPU links, and a preemption takes an instance whole (reconfig/placement.py)."""

    def __init__(self, base: ThroughputModel, gpus_per_instance: int):
        placement = Placement(gpus_per_instance)
        layouts = tuple(p for p in base.layouts() if placement.fits(p))
        if not layouts:
            sizes = ", ".join(map(str, sorted({p.tp for p in base.layouts()})))
            raise ProfileError(f"profile of {base.model}: no layout fits instances of {gpus_per_instance} GPU(s): "
                               f"its tensor-parallel sizes ({sizes}) do not divide {gpus_per_instance}")
        super().__init__(base, layouts)


# How `ForModels` names what rules a layout out: the workers' flags, the profile's sizes.
_WORKER_NAMES = {**LAYOUT_NAMES, "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
                 "num_query_groups": "--num-query-groups", "tp": "tensor-parallel size",
                 "stage_layers": "layers per stage"}


class ForModels(_Subset):
    """The layouts of `base` that megatron-core can build each of `shapes` in: the models
    the workers train. A throughput table takes its shape from the cost constants by name,
    which need not split as the workers' model does (grouped-query attention, say), and a
    worker refuses a plan its model cannot take."""

    def __init__(self, base: ThroughputModel, shapes: Collection[ModelShape]):
        layouts = tuple(p for p in base.layouts() if not any(s.problems(p) for s in shapes))
        if not layouts:
            why = dict.fromkeys(f for p in base.layouts() for s in shapes for f in s.problems(p, names=_WORKER_NAMES))
            raise ProfileError(f"profile of {base.model}: no layout of it can train the workers' model: "
                               f"{'; '.join(why)}")
        super().__init__(base, layouts)


def load_profile(path: str | Path, shapes: dict[str, ModelShape], model: str | None,
                 max_workers: int) -> ThroughputModel:
    """A layer profile (.json, analytic model) or a throughput table (CSV) for `model`.

    A table does not describe the model, so its shape comes from `shapes` under `model`,
    or under the name in the table's `model=` metadata when `model` is None.
    """
    if Path(path).suffix.lower() == ".json":
        return PipelineModel.load(path, max_workers)
    name = model or ProfileTable.read_metadata(path).get("model")
    if name is None:
        raise ProfileError(f"{path}: the table names no model (a '# model=NAME' comment); say which with --model")
    if name not in shapes:
        raise ProfileError(f"{path}: no shape for model {name!r} (known: {', '.join(sorted(shapes)) or 'none'})")
    return ProfileTable.load(path, shapes[name])
