"""Run a training script with every torch.distributed collective checked for its plane.

    python tests/collective_probe.py OUT_DIR SCRIPT [ARGS...]

Each collective that the project's own code calls (megatron_parcae/, reconfig/) must get
tensors that reconfig.planes made, on that plane's device: control-plane tensors on the
CPU, data-plane ones on `planes.data_device()`. A tensor made anywhere else is what went
wrong before GPU runs (CPU tensors handed to NCCL, CPU receive buffers for GPU payloads),
and on CPU nothing else would notice it. megatron-core's own collectives are not checked.
Each process appends its findings to OUT_DIR/probe-PID.jsonl as it goes (a killed worker
keeps what it found): one {"site", "plane"} line per distinct site, and {"violation"}
lines.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
OURS = (str(REPO / "megatron_parcae") + os.sep, str(REPO / "reconfig") + os.sep)
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "gather", "scatter",
                      "all_to_all_single")
# Collectives the project must not call itself: barrier picks NCCL on GPUs (planes has a
# control-plane one); object collectives pickle.
FORBIDDEN = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
             "batch_isend_irecv")


class Probe:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"probe-{os.getpid()}.jsonl"
        self.seen: set[tuple[str, str]] = set()

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def check(self, name: str, args: tuple, kwargs: dict) -> None:
        frame = sys._getframe(2)
        where = frame.f_code.co_filename
        if not where.startswith(OURS):
            return
        function = frame
        while function.f_code.co_name.startswith("<") and function.f_back is not None:  # <listcomp>
            function = function.f_back
        site = f"{os.path.relpath(where, REPO)}:{function.f_code.co_name}:{name}"
        if name in FORBIDDEN:
            self._write({"violation": f"{site}: the project calls {name}"})
            return
        from reconfig import planes

        first = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
        tensors = first if isinstance(first, (list, tuple)) else [first]
        for tensor in tensors:
            plane = planes.plane_of(tensor) if isinstance(tensor, torch.Tensor) else None
            if plane is None:
                self._write({"violation": f"{site}: a tensor reconfig.planes did not make"})
                continue
            expected = torch.device("cpu") if plane == planes.CONTROL else planes.data_device()
            if tensor.device != expected:
                self._write({"violation": f"{site}: {plane}-plane tensor on {tensor.device}, not {expected}"})
            if (site, plane) not in self.seen:
                self.seen.add((site, plane))
                self._write({"site": site, "plane": plane})

    def install(self) -> None:
        for name in TENSOR_COLLECTIVES + FORBIDDEN:
            setattr(dist, name, _Checked(self, name, getattr(dist, name)))
        dist.P2POp = _P2POp


class _Checked:
    """A collective that the probe checks first."""

    def __init__(self, probe: Probe, name: str, original) -> None:
        self.probe, self.name, self.original = probe, name, original

    def __call__(self, *args, **kwargs):
        self.probe.check(self.name, args, kwargs)
        return self.original(*args, **kwargs)


class _P2POp(dist.P2POp):
    """torch's P2POp with the original isend/irecv: batch_isend_irecv tells them apart by
    identity (megatron-core's pipeline sends, which are not checked)."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, getattr(op, "original", op), *args, **kwargs)

    def __init__(self, op, *args, **kwargs):
        super().__init__(getattr(op, "original", op), *args, **kwargs)


def read_findings(out_dir: Path) -> tuple[set[tuple[str, str]], list[str]]:
    """(site, plane) pairs seen and violations found, over every process's file."""
    sites, violations = set(), []
    for path in out_dir.glob("probe-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "violation" in record:
                violations.append(record["violation"])
            else:
                sites.add((record["site"], record["plane"]))
    return sites, violations


if __name__ == "__main__":
    out, script, *rest = sys.argv[1:]
    Probe(Path(out)).install()
    # Small chunks, so that the chunked gathers of optimizer state run in many pieces.
    from reconfig import optimizer_state

    optimizer_state.GATHER_CHUNK_ELEMENTS = 4096
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
