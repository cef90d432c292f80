"""Tasks of the user's own: ``--task package.module:factory`` names a factory
``factory(*, seed, **task_options) -> gossip.tasks.Task`` to import (README, Your own task)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gossip.errors import ConfigError


def import_factory(name: str) -> Callable:
    """The factory ``package.module:factory`` names.

    Raises:
        ConfigError: its module or factory cannot be had (one line naming the path).
    """
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"task {name!r}: expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is this path's fault
        raise ConfigError(f"task {name!r}: cannot import {module_name}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                          ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"task {name!r}: module {module_name} has no callable {attribute!r}")
    return factory
