"""The import rules of docs/structure.md, read from the source: no import cycles (imports inside functions and
under TYPE_CHECKING count), `speculation/` never imports `engine/`, the leaves (`types`, `sampling`,
`config`) import nothing above them, and the API imports no torch when it is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what each leaf may import from server/ (a package's __init__ that imports nothing itself is a leaf too)
LEAVES = {
    "server.types": set(),
    "server.failsafe": set(),
    "server.speculation.tuning": set(),
    "server.draft_head": set(),
    "server.config": {"server.types", "server.draft_head"},
    "server.sampling": {"server.types"},
}


def modules() -> dict[str, Path]:
    """Every module under server/, by its dotted name (a package by its own name)."""
    found = {}
    for path in (ROOT / "server").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The server modules `name` imports anywhere in its file (a `from package import module` names the
    module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_there_are_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_speculation_never_imports_the_engine():
    bad = {(m, i) for m, deps in graph().items() if m.startswith("server.speculation")
           for i in deps if i.startswith("server.engine")}
    assert not bad


def test_the_leaves_import_nothing_above_them():
    edges = graph()
    for leaf, allowed in LEAVES.items():
        assert edges[leaf] <= allowed, (leaf, edges[leaf] - allowed)


@pytest.mark.slow
def test_the_api_imports_no_torch():
    names = sorted(m for m in modules() if m.startswith("server.api"))
    code = "import sys\n" + "".join(f"import {m}\n" for m in names) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
