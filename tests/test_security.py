"""No module on a network path unpickles or evaluates data (issue 7, point 5).

Plans, notices and state arrive from etcd and from other processes; they are JSON read
through schemas and raw tensors. This scan finds every import or call that could run
code carried by data: pickle and its relatives, eval/exec, torch.load without
weights_only, numpy's allow_pickle, and torch.distributed's *_object collectives (which
pickle).
"""

from __future__ import annotations

import ast

from helpers import REPO

# Everything that runs in a training process, the coordinator or the emulator.
NETWORK_PATH = ["megatron_parcae", "reconfig", "predictor"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_CALLS = {"eval", "exec"}
# torch.distributed helpers that pickle Python objects across the wire
PICKLING_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "send_object_list", "recv_object_list"}


def unsafe_uses(source: str, filename: str) -> list[str]:
    """Every import or call in `source` that could run code carried by data."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno} import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{filename}:{node.lineno} from {node.module} import")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else ""
            keywords = {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_CALLS | PICKLING_COLLECTIVES or name == "__import__":
                found.append(f"{filename}:{node.lineno} {name}()")
            elif name == "load" and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "torch":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{filename}:{node.lineno} torch.load() without weights_only=True")
            elif name == "load" and isinstance(keywords.get("allow_pickle"), ast.Constant) and keywords["allow_pickle"].value is not False:
                found.append(f"{filename}:{node.lineno} load(allow_pickle=True)")
    return found


def test_scanner_catches_unsafe_code():
    source = "import pickle\nfrom marshal import loads\nimport torch\nx = eval('1')\ntorch.load(f)\nnp.load(f, allow_pickle=True)\ndist.broadcast_object_list(o)\ntorch.load(f, weights_only=True)\n"
    assert len(unsafe_uses(source, "bad.py")) == 6


def test_no_module_on_a_network_path_unpickles_or_evals():
    files = []
    for entry in NETWORK_PATH:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert any(f.name == "agent.py" for f in files) and any(f.parent.name == "etcd" for f in files)
    found = [use for f in files for use in unsafe_uses(f.read_text(), str(f.relative_to(REPO)))]
    assert found == []
