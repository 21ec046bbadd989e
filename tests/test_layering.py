"""The rooms import downwards only (docs/design.md): predictor/ and reconfig/ import nothing
of megatron_parcae, and no module imports itself back through others."""

from __future__ import annotations

import ast

from helpers import REPO

PACKAGES = ("megatron_parcae", "reconfig", "predictor")


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (top level or inside functions)."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_leaves_import_nothing_above_them():
    wrong = {(m, d) for m, deps in _imports().items() for d in deps
             if m.startswith(("reconfig", "predictor")) and d.startswith("megatron_parcae")}
    assert not wrong, sorted(wrong)


def test_no_import_circle():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# megatron_parcae's rooms, lowest first (docs/design.md): a module imports only its own
# room and rooms of a lower rank; the rank-0 rooms import only the leaves.
RANKS = {"events": 0, "scalars": 0, "liveput": 0, "provisioning": 0, "control": 1, "training": 2, "tools": 3, "cli": 4}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron_parcae" and len(parts) > 1 else None


def test_rooms_import_only_rooms_below_them():
    graph = _imports()
    assert {_room(m) for m in graph} - {None} == set(RANKS), "a room docs/design.md does not rank"
    wrong = {(m, d) for m, deps in graph.items() if _room(m) for d in deps
             if _room(d) and _room(d) != _room(m) and RANKS[_room(d)] >= RANKS[_room(m)]}
    assert not wrong, sorted(wrong)


def test_the_coordinator_loads_without_torch():
    """The coordinator runs beside etcd, off the training hosts: it plans with reconfig's
    plain-data modules and must not load torch (hundreds of MiB, seconds of start-up)."""
    import subprocess
    import sys

    probe = "import sys, megatron_parcae.control.coordinator; print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False", found.stderr[-2000:]
