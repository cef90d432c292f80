"""Build components from names; an unknown name lists the ones that exist."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

from gossip.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> factory table for one family of components (strategies, compressors...)."""

    def __init__(self, family: str):
        self.family = family
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory`` under ``name``."""

        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ConfigError(f"{self.family} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return decorate

    def get(self, name: str) -> Callable[..., T]:
        """The factory for ``name``; raises ConfigError listing the known names."""
        try:
            return self._factories[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.family} {name!r}; available: {', '.join(self.names())}"
            ) from None

    def create(self, name: str, /, **kwargs) -> T:
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring as one line: what a listing says of it."""
    doc = (inspect.getdoc(obj) or "").strip()
    return " ".join(doc.split("\n\n")[0].split())
