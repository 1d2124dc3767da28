"""The package's imports run one way (docs/design.md, "What it is, and for whom": "Its imports run one way"): no
module imports, directly or through others, a module that imports it, and no module imports one on a higher
floor. Read from the source with ``ast``, every import counted: top-level, inside functions, under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dflash_pipeline"
ROOT = "dflash_pipeline"

# The floors, lowest first: a module imports modules of its own floor or below. Keyed by the name under the package
# (a subpackage is one name).
FLOORS = [
    # plumbing and leaf algorithms that import nothing of the package above them
    {"atomic", "resources", "config", "jobs", "gpu_lease", "plots", "gguf_header", "s3_server", "bucket", "greedy",
     "muon", "losses", "loops"},
    # the target and the data before it reaches a GPU
    {"target", "tokenization", "prepare", "sources", "leakage", "mix"},
    {"store"},
    {"extract"},
    # the drafter and decoding with it
    {"drafter", "speculative", "tree"},
    {"train_data", "train"},
    # the jobs that run the target with a drafter or for data, and their reports
    {"regenerate", "chat_server", "evaluate", "evaluate_report"},
    {"plan", "cli", "__main__"},
]

def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = [ROOT, *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from X import name`` counts as importing ``X.name`` where that
    is a module, else ``X``; relative imports are resolved against the importing module's package."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            else:
                continue
            imported.update(t for t in targets if t in known and t != name)
        graph[name] = imported
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "active" on the current path, "done" when every path from it is explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "active"
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == "active":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def floor_of(module: str) -> int:
    top = module.split(".")[1] if module != ROOT else ""
    for floor, names in enumerate(FLOORS):
        if top in names:
            return floor
    raise AssertionError(f"{module}: on no floor of tests/test_imports.py's FLOORS; add it to the floor it belongs to")


def test_the_graph_reads_relative_function_level_and_package_imports():
    graph = import_graph()
    assert "dflash_pipeline.store.compact" in graph["dflash_pipeline.store.compact_codec"]  # from . import compact
    assert "dflash_pipeline.store" in graph["dflash_pipeline.train.trainer"]  # from ..store import HiddenStateStore
    assert "dflash_pipeline.plots" in graph["dflash_pipeline.train.checkpoint"]  # inside write_log
    assert "dflash_pipeline.bucket" in graph["dflash_pipeline.store.remote"]  # from ..bucket import ...


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_module_imports_one_on_a_higher_floor():
    upward = [f"{a} (floor {floor_of(a)}) imports {b} (floor {floor_of(b)})"
              for a, targets in sorted(import_graph().items()) for b in sorted(targets)
              if floor_of(b) > floor_of(a)]
    assert not upward, "imports up the floors:\n" + "\n".join(upward)


def test_checkpointing_takes_a_state_not_the_trainer():
    assert "dflash_pipeline.train.trainer" not in import_graph()["dflash_pipeline.train.checkpoint"]


def test_no_test_module_imports_another():
    """Shared test helpers live in helper modules (tests/*_helpers.py, conftest.py), not in test modules."""
    found = []
    for path in sorted((PACKAGE.parents[1] / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} imports {name}" for name in names if name.startswith("test_")]
    assert not found, "\n".join(found)
