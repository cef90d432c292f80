"""The code's layout as docs/ARCHITECTURE.md describes it: every module listed, none using
another module's private names, no import cycles (lazy imports included, and a package's
``__init__`` importing its own modules), and no import back up between gossip's top-level
modules and packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gossip"
# Public API spelled with an underscore: namedtuple's methods, os._exit.
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_exit"}
# Reaches whose removal is another part of issue 26, in flight on other branches (the options'
# generated flags, the layers' public field check): delete each line as its fix merges.


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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORED


def private_reaches(path: Path, source: str) -> list[str]:
    """Where ``source`` uses an underscored name that is not its own: ``x._name`` on anything
    but ``self``, ``cls`` or ``super()`` (another module, or an object made elsewhere), and
    ``from module import _name``. A split that needs a private name leaks: give the owner a
    public operation instead."""
    where = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            own = ((isinstance(base, ast.Name) and base.id in ("self", "cls"))
                   or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                       and base.func.id == "super"))
            if not own:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{where}: from {node.module} import {alias.name}"
                      for alias in node.names if private(alias.name)]
    return found


def test_no_module_uses_another_modules_private_names():
    """Cohesion over line counts: a module may be long when one job needs it; what must not
    happen is a split that reaches into the other half's private state."""
    reaches = [r for p in sorted(PACKAGE.rglob("*.py"))
               for r in private_reaches(p, p.read_text())]
    assert not reaches, "private names used outside their module:\n" + "\n".join(reaches)


def test_the_private_reach_check_sees_what_it_must():
    source = ("from gossip.a import _hidden, shown\n"
              "def f(peer, self):\n"
              "    peer._add(); peer.transport._pump(0.0); self._own(); self.__class__\n"
              "    super()._expect(); point._replace(x=1)\n")
    reaches = private_reaches(PACKAGE / "example.py", source)
    assert reaches == ["gossip/example.py: from gossip.a import _hidden",
                       "gossip/example.py:3: peer._add",
                       "gossip/example.py:3: peer.transport._pump"]


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
