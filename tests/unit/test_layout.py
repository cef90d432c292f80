"""The code's layout as docs/ARCHITECTURE.md describes it: every module listed, none over
~350 lines, and no import cycles (lazy imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gossip"
MAX_LINES = 360


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def documented() -> set[str]:
    """Module paths the map names: in full, by file name in a section headed with its package
    (``**Transport** (`gossip/transport/`)``), or by file name in a package's row
    (``| `sparse/` | ... `wire.py` ...``)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Modules, one job each", 1)[1].split("\n## ", 1)[0]
    found = set(re.findall(r"`(gossip/[\w/]+\.py)`", table))
    section = "gossip"
    for line in table.splitlines():
        heading = re.match(r"^\*\*.*\*\* \(`(gossip/[\w/]+)/`", line)
        if heading:
            section = heading.group(1)
        if not line.startswith("|"):
            continue
        first, *rest = line.split("|")[1:]
        package = re.match(r"\s*`([\w/]+)/`", first)
        where = (package.group(1) if "/" in package.group(1)
                 else f"{section}/{package.group(1)}") if package else section
        for name in re.findall(r"`([\w]+\.py)`", "|".join([first, *rest])):
            found.add(f"{where}/{name}")
    return found


def test_every_module_is_in_the_architecture_map():
    missing = [p.relative_to(ROOT).as_posix() for p in modules()
               if p.relative_to(ROOT).as_posix() not in documented()]
    assert not missing, f"not in docs/ARCHITECTURE.md's module map: {missing}"


def test_no_module_is_over_350_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_cycles_lazy_imports_included():
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t.startswith("gossip."))
    graph = {k: {t for t in v if t in graph and t != k} for k, v in graph.items()}
    # A package's __init__ importing its own modules is how families register, not a cycle
    # between modules: ignore edges from a package to what it contains.
    graph = {k: {t for t in v if not t.startswith(k + ".")} for k, v in graph.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
