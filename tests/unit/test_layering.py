"""The import structure as docs/design.md §8 states it, checked on every module's source.

Imports are read from the source (``ast``), including those inside functions: a lazy import is still an
arrow. ``runtime`` imports nothing else of ours, ``planner`` nothing of ``hetu_cli``; no cycles; no
private name imported from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "planner", "hetu_cli")
# A package may import those to its right in this order, never those to its left.
LAYER = {"runtime": 0, "planner": 1, "hetu_cli": 2}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, str | None]]:
    """(imported module of ours, the name taken from it when that is not itself a module)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in MODULES:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, None) if sub in MODULES else (source, alias.name))
    return found


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for name in MODULES:
        for target, _ in _imports(name):
            if target != name:
                g.add_edge(name, target)
    return g


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    bad = [(a, b) for a, b in _graph().edges if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert bad == [], f"imports against the layering: {bad}"


def test_no_private_name_imported_from_another_module():
    bad = [(name, f"{src}.{attr}") for name in MODULES for src, attr in _imports(name)
           if attr is not None and attr.startswith("_") and not attr.startswith("__") and src != name]
    assert bad == [], f"private names imported across modules: {bad}"


def test_the_walker_sees_a_known_arrow():
    # Guards the checks above against passing because the walker found nothing.
    g = _graph()
    assert g.number_of_edges() > 100
    assert g.has_edge("hetu_cli.main", "hetu_cli.output")


# The emulated CPU cluster's harness, one module: a sleep-mode device's block targets and the cores its
# workers are pinned to. A test harness, not a target: the CLI hands its results to the runtime through
# generic options, and nothing in the planner or the runtime may reach it, not even through another module.
HARNESS = "hetu_cli.emulation"
# The worker's hooks that stretch or sleep out compute blocks: the runtime's, but the planner, the cost
# model and the simulator price GPUs and never reach them.
WORKER_EMULATION = "runtime.trace"


def test_neither_the_planner_nor_the_runtime_reaches_the_emulation_harness():
    g = _graph()
    reached = sorted(m for m in MODULES if m.split(".")[0] in ("planner", "runtime") and
                     HARNESS in nx.descendants(g, m))
    assert reached == []
    assert HARNESS in MODULES and g.has_edge("hetu_cli.commands.train", HARNESS)   # the check can fail


def test_the_planner_never_reaches_the_workers_emulation_hooks():
    g = _graph()
    reached = sorted(m for m in MODULES if m.split(".")[0] == "planner" and WORKER_EMULATION in nx.descendants(g, m))
    assert reached == []
    assert WORKER_EMULATION in MODULES


# runtime.torchfree: the half of the runtime that imports no torch, directly or through anything of ours.
TORCH_FREE = "runtime.torchfree"
TORCH_LOADERS = ("torch", "safetensors.torch", "transformers", "accelerate", "torchvision", "torchaudio")


def _foreign_imports(name: str) -> set[str]:
    """Every module not of ours that ``name`` imports (lazy imports included), as dotted names."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name not in MODULES}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module not in MODULES:
            out |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _loads_torch(name: str) -> bool:
    return any(f == t or f.startswith(t + ".") for f in _foreign_imports(name) for t in TORCH_LOADERS)


def _with_parents(names: set[str]) -> set[str]:
    # Importing a.b.c runs a and a.b first.
    return names | {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}


def _torch_free_package() -> set[str]:
    return {m for m in MODULES if m == TORCH_FREE or m.startswith(TORCH_FREE + ".")}


def test_the_torch_free_package_reaches_no_torch():
    g = _graph()
    free = _torch_free_package()
    assert len(free) > 10, "the torch-free package is missing or the walker found nothing"
    reached = _with_parents(free | {t for m in free for t in nx.descendants(g, m)})
    bad = sorted(m for m in reached if _loads_torch(m))
    assert bad == [], f"{TORCH_FREE} reaches torch through {bad}"
    outside = sorted(m for m in reached if m not in free and m != "runtime")
    assert outside == [], f"{TORCH_FREE} imports runtime modules outside it: {outside}"


def test_every_torch_free_runtime_module_lives_in_the_torch_free_package():
    # The layout says which half a module is in: one that reaches no torch belongs in runtime.torchfree.
    g = _graph()
    misplaced = sorted(m for m in MODULES if m.startswith("runtime.") and not _is_package(m)
                       and m not in _torch_free_package()
                       and not any(_loads_torch(t) for t in {m} | nx.descendants(g, m)))
    assert misplaced == [], f"torch-free modules outside {TORCH_FREE}: {misplaced}"
