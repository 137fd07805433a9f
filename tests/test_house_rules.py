"""The house's rules, kept by the suite rather than by review:

- the rooms' import layering (docs/architecture.md): the engine reaches the workers only through
  the executor, so it never imports `kvflow.worker`; `core` (the scheduler side) never imports
  the torch-side rooms; nothing imports `kvflow.entrypoints` but itself (and the package's public
  names); workers never import the engine;
- no import cycles between modules, counting imports inside functions (a factory in a base module
  that imports its subclasses is one);
- ruff's checks pass on src, tests and benchmarks;
- every structure docs/structures.md names lives in the module it names (the map stays true).

Imports are read from the source (every `import`, at any depth, TYPE_CHECKING included), so a
rule holds whatever a run happens to import.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvflow"

# room → rooms it must never import
FORBIDDEN = {
    "kvflow.engine": ("kvflow.worker",),
    "kvflow.core": ("kvflow.worker", "kvflow.executor", "kvflow.engine", "kvflow.model", "kvflow.attention",
                    "kvflow.quant", "kvflow.distributed", "kvflow.lora.layers", "kvflow.lora.manager",
                    "kvflow.lora.batch", "kvflow.structured_output.manager", "kvflow.entrypoints"),
    "kvflow.worker": ("kvflow.engine", "kvflow.entrypoints"),
    "kvflow.executor": ("kvflow.engine", "kvflow.entrypoints"),
    "kvflow.model": ("kvflow.engine", "kvflow.worker", "kvflow.executor", "kvflow.entrypoints"),
    "kvflow.attention": ("kvflow.engine", "kvflow.worker", "kvflow.executor", "kvflow.entrypoints"),
    "kvflow.quant": ("kvflow.engine", "kvflow.worker", "kvflow.executor", "kvflow.entrypoints"),
}
# Only these may import kvflow.entrypoints: itself, and the package's public names (LLM).
ENTRYPOINT_IMPORTERS = ("kvflow.entrypoints", "kvflow")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every kvflow module `name` imports, wherever the statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {_owner(m) for m in found if m == "kvflow" or m.startswith("kvflow.")} - {None, name}


def _owner(module: str) -> str | None:
    while module not in MODULES and "." in module:
        module = module.rpartition(".")[0]
    return module if module in MODULES else None


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_rooms_import_only_what_lies_below_them():
    broken = sorted(f"{importer} imports {imported}"
                    for importer, imported_set in GRAPH.items() for imported in imported_set
                    for room, forbidden in FORBIDDEN.items() if _in(importer, room)
                    for below in forbidden if _in(imported, below))
    assert not broken, "\n".join(broken)


def test_nothing_imports_the_entrypoints():
    broken = sorted(f"{importer} imports {imported}" for importer, imported_set in GRAPH.items()
                    for imported in imported_set if _in(imported, "kvflow.entrypoints")
                    and not (_in(importer, "kvflow.entrypoints") or importer == "kvflow"))
    assert not broken, "\n".join(broken)


def test_no_import_cycles():
    graph = {name: {m for m in deps if m != "kvflow"} for name, deps in GRAPH.items() if name != "kvflow"}
    cycles = _strongly_connected(graph)
    assert not cycles, "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_ruff_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: it comes with the test extra (./scripts/setup.sh)")
    done = subprocess.run([ruff, "check", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_structures_map_names_what_exists():
    rows = re.findall(r"^\| `(\w+)` \| `([\w.]+)` \|", (ROOT / "docs" / "structures.md").read_text(), re.MULTILINE)
    assert len(rows) >= 10
    missing = [f"{module}.{name}" for name, module in rows
               if not hasattr(importlib.import_module(f"kvflow.{module}"), name)]
    assert not missing, f"docs/structures.md names structures that are not where it says: {missing}"
