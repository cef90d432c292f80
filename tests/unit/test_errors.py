"""The one exception family: every error a user can meet is a ``GossipError``, defined in
gossip.errors and exported from ``gossip``."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import gossip
import gossip.errors

PACKAGE = Path(gossip.__file__).resolve().parent
# Never reaches a user: thrown into a simulated peer's greenlet to stop it where it is.
INTERNAL = {("gossip/sim/scheduler.py", "Killed")}


def test_every_error_of_gossip_errors_is_a_gossip_error_exported_from_gossip():
    classes = {name: cls for name, cls in vars(gossip.errors).items()
               if inspect.isclass(cls) and cls.__module__ == "gossip.errors"}
    assert {"LaunchFailed", "RendezvousError", "TransportBusy", "NetnsError"} <= set(classes)
    for name, cls in classes.items():
        assert issubclass(cls, gossip.GossipError), name
        assert name in gossip.__all__, name
        assert getattr(gossip, name) is cls, name


def test_every_exported_exception_comes_from_gossip_errors():
    for name in gossip.__all__:
        value = getattr(gossip, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert value.__module__ == "gossip.errors", name


def test_no_module_defines_an_exception_outside_gossip_errors():
    """Read from the source (nothing imported): a class deriving from an exception anywhere
    else would be one a user meets outside the family."""
    exceptional = {"Exception", "BaseException", "RuntimeError", "ValueError", "OSError"}
    exceptional |= {name for name, cls in vars(gossip.errors).items()
                    if inspect.isclass(cls) and issubclass(cls, BaseException)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        if where == "gossip/errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (where, node.name) not in INTERNAL:
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases}
                if bases & exceptional:
                    found.append(f"{where}: {node.name}")
    assert not found, found


def test_every_public_exception_class_of_every_module_is_a_gossip_error_exported_from_gossip():
    """Walks gossip's modules, imported: an exception class a module defines or re-exports
    under a public name is one a user can catch, so it must be in the family and in
    ``gossip``. Modules whose optional dependencies are missing here are skipped."""
    found = []
    for info in pkgutil.walk_packages(gossip.__path__, "gossip."):
        if info.name == "gossip.__main__":
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            if (name.startswith("_") or not inspect.isclass(value)
                    or not issubclass(value, BaseException)
                    or not value.__module__.startswith("gossip")):
                continue
            where = (info.name.replace(".", "/") + ".py", value.__name__)
            if where in INTERNAL or (value.__module__.replace(".", "/") + ".py",
                                     value.__name__) in INTERNAL:
                continue
            if not issubclass(value, gossip.GossipError) or getattr(gossip, name, None) \
                    is not value:
                found.append(f"{info.name}.{name}")
    assert not found, found


def test_launch_failed_keeps_its_fields():
    exc = gossip.LaunchFailed(3, 1, "boom")
    assert (exc.rank, exc.code, exc.reason, str(exc)) == (3, 1, "boom",
                                                          "peer 3 failed (exit code 1): boom")
