"""The code's layout as docs/ARCHITECTURE.md describes it: every module listed, none over
~350 lines, no import cycles (lazy imports included, and a package's ``__init__`` importing
its own modules), and no import back up between gossip's top-level modules and packages."""

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


def import_graph() -> dict[str, set[str]]:
    """Module -> the gossip modules it imports (lazy imports included). A package's
    ``__init__`` importing its own modules counts wherever a module outside the package
    imports the package (importing ``gossip.cli`` from below runs all of ``gossip.cli``);
    where only its own modules import it, it is how a family registers, not a cycle."""
    paths = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"):
             path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from P import m` of a module m imports m; of any other name, P
                edges.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths
                             else node.module for a in node.names)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
    graph = {k: {t for t in v if t in paths and t != k} for k, v in graph.items()}
    imported_from_outside = {t for k, v in graph.items() for t in v
                             if not k.startswith(t + ".")}
    return {k: {t for t in v if k in imported_from_outside or not t.startswith(k + ".")}
            for k, v in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycles_lazy_imports_included():
    found = cycles(import_graph())
    assert not found, found


def test_no_import_runs_back_up_between_top_level_modules_and_packages():
    """Each top-level module or package of gossip/ is one layer: an import cycle between
    two of them (sim importing experiment analysis while experiment runs sim) is an import
    that runs back up, even where no modules cycle."""
    def layer(module: str) -> str:
        return ".".join(module.split(".")[:2])

    layers: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        layers.setdefault(layer(module), set()).update(
            layer(t) for t in targets if layer(t) != layer(module))
    found = cycles(layers)
    assert not found, found
