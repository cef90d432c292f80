"""Strategies by name: each with its options dataclass and the class that runs it.

A registration names an ``Options`` dataclass and either one Strategy class or a selector
picking the class from the options (``dpsgd`` runs CHOCO-Gossip when given a compressor).
What a strategy can do is a class attribute (``operates_on``, ``exact_mean``, ``can_rejoin``,
...), so the class a name and options select tells any caller without building anything.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gossip.compress import COMPRESSORS, Compressor, WrapperOptions, build, compressor_options
from gossip.errors import ConfigError
from gossip.options import Options
from gossip.registry import Registry, summary


@dataclass(frozen=True)
class Entry:
    """One registered strategy."""

    name: str
    options: type[Options]
    select: Callable[[Options], type]  # options -> the Strategy class that runs them
    doc: str


@dataclass(frozen=True)
class Spec:
    """A strategy resolved once (``STRATEGIES.resolve``): the class that runs it and its
    checked options, or a factory built by hand; call it to build the strategy."""

    name: str
    cls: type | None  # None: a factory, known only once built
    options: Options | None
    factory: Callable[..., Any] | None = None

    def __call__(self, *, rank: int, topology, transport):
        if self.factory is not None:
            return self.factory(rank=rank, topology=topology, transport=transport)
        return self.cls(rank=rank, topology=topology, transport=transport, options=self.options)

    def capabilities(self) -> dict[str, Any] | None:
        """What the strategy can do (``Strategy.capabilities_for``); None for a factory."""
        return None if self.cls is None else self.cls.capabilities_for(self.options)

    @property
    def tag(self) -> str | None:
        """Its ``tag`` option, which names its messages (None: it has none)."""
        return getattr(self.options, "tag", None)

    def copy(self) -> Spec:
        """A copy with stateful options of its own (a compressor's error-feedback
        residuals): for each of several peers built from one spec in one process."""
        return copy.deepcopy(self)

    def retagged(self, tag: str) -> Spec:
        """The same strategy and options under another tag (its own messages and state)."""
        if self.tag is None:
            raise ConfigError(f"strategy {self.name!r} has no tag option to give it another")
        return dataclasses.replace(self, options=dataclasses.replace(self.options, tag=tag))


class StrategyRegistry(Registry):
    """``STRATEGIES``: register, parse options, build, describe."""

    def __init__(self):
        super().__init__("strategy")

    def register(self, name: str, *, options: type[Options] | None = None):
        """Decorator registering a Strategy class (its ``options_class`` holds its options),
        or, with ``options``, a selector ``options -> Strategy class``."""

        def decorate(target):
            if inspect.isclass(target):
                entry = Entry(name, options or target.options_class, lambda _: target,
                              summary(target))
            else:
                if options is None:
                    raise ConfigError(f"strategy {name!r}: a selector needs options=...")
                entry = Entry(name, options, target, summary(target))
            super(StrategyRegistry, self).register(name)(entry)
            return target

        return decorate

    def entry(self, name: str) -> Entry:
        """The registration of ``name``; ConfigError listing the known names."""
        return self.get(name)

    def options(self, name: str, given: Mapping[str, Any] | Options | None = None) -> Options:
        """``given`` (a mapping of option values, or an Options object) checked and complete.

        Compression options (``compressor``, its own options such as ``density``, and the
        wrappers' ``error_feedback``, ``momentum``, ``clip_norm``, ``warmup_rounds``) become
        one Compressor for strategies that take one; ``compressor`` may also be a Compressor
        object built by hand.

        Raises:
            ConfigError: an unknown strategy or option, or a value that is not allowed,
                naming it and what is allowed.
        """
        compressor = given.get("compressor") if isinstance(given, Mapping) else None
        if isinstance(compressor, str) and compressor in self and compressor not in COMPRESSORS:
            raise ConfigError(f"strategy {name!r}: {compressor!r} is a strategy, not a "
                              f"compressor (e.g. --strategy {compressor}); compressors: "
                              f"{', '.join(COMPRESSORS.names())}")
        return parse_options(self.entry(name).options, given, strategy=name)

    def strategy_class(self, name: str, options: Options | Mapping[str, Any] | None = None):
        """The Strategy class that runs ``name`` with ``options``."""
        return self.entry(name).select(self.options(name, options))

    def create(self, name: str, /, *, rank: int, topology, transport,
               options: Options | Mapping[str, Any] | None = None):
        """Build strategy ``name`` for ``rank`` on an open ``transport``."""
        parsed = self.options(name, options)
        cls = self.entry(name).select(parsed)
        return cls(rank=rank, topology=topology, transport=transport, options=parsed)

    def resolve(self, strategy, options: Mapping[str, Any] | Options | None = None) -> Spec:
        """``strategy`` parsed once, as a ``Spec`` (call it to build the strategy): a
        registered name, a Strategy class built by hand (options from its ``options_class``),
        a factory ``(*, rank, topology, transport) -> Strategy``, or a Spec already resolved.
        Options are checked now.

        Raises:
            ConfigError: an unknown name or option, a bad value, or options given with a
                factory (they belong in the factory) or a Spec (it holds its own).
        """
        if isinstance(strategy, str):
            parsed = self.options(strategy, options)
            return Spec(strategy, self.entry(strategy).select(parsed), parsed)
        if inspect.isclass(strategy) and hasattr(strategy, "synchronize"):
            parsed = parse_options(strategy.options_class, options, strategy=strategy.__name__)
            return Spec(strategy.__name__, strategy, parsed)
        if callable(strategy):
            if options:
                what = "resolved strategy" if isinstance(strategy, Spec) else "strategy factory"
                raise ConfigError(f"options {', '.join(options)} given with a {what}: they "
                                  f"belong in it")
            if isinstance(strategy, Spec):
                return strategy
            return Spec(getattr(strategy, "__name__", "factory"), None, None, factory=strategy)
        raise ConfigError(f"strategy must be a registered name ({', '.join(self.names())}), a "
                          f"Strategy class or a factory, got {strategy!r}")

    def where(self, **capabilities: Any) -> list[str]:
        """Names whose default class has every given capability value."""
        found = []
        for name in self.names():
            held = self.strategy_class(name).capabilities_for(self.options(name))
            if all(held.get(key) == value for key, value in capabilities.items()):
                found.append(name)
        return found

    def describe(self) -> list[dict[str, Any]]:
        """Per strategy: name, doc, its options (name, default, doc) and the capabilities
        of the class its default options select."""
        rows = []
        for name in self.names():
            entry = self.entry(name)
            cls = self.strategy_class(name)
            rows.append({"name": name, "doc": entry.doc, "options": entry.options.describe(),
                         "capabilities": cls.capabilities_for(self.options(name))})
        return rows


def parse_options(options_class: type[Options], given: Mapping[str, Any] | Options | None,
                  *, strategy: str) -> Options:
    """``given`` as an ``options_class`` (see ``StrategyRegistry.options``); ``strategy``
    names the strategy in errors."""
    if isinstance(given, Options):
        if not isinstance(given, options_class):
            raise ConfigError(f"strategy {strategy!r} takes {options_class.__name__}, got "
                              f"{type(given).__name__}")
        return given
    values = dict(given or {})
    allowed = options_class.names()
    own = {k: v for k, v in values.items() if k in allowed and k != "compressor"}
    rest = {k: v for k, v in values.items() if k not in own}
    if rest:
        own["compressor"] = _compressor(strategy, allowed, rest)
    return options_class(**own)


def _compressor(name: str, allowed: list[str], rest: dict[str, Any]) -> Compressor | None:
    """The compressor the options outside the strategy's own describe (None: none)."""
    compressor = rest.get("compressor")
    if compressor is None or compressor == "none" and len(rest) == 1:
        rest.pop("compressor", None)
        for key in rest:
            raise ConfigError(f"strategy {name!r} has no option {key!r}; options: "
                              f"{', '.join(a for a in allowed if a != 'compressor') or 'none'}"
                              + ("" if "compressor" not in allowed else
                                 " (compressor options need a compressor=...)"))
        return None
    if "compressor" not in allowed:
        raise ConfigError(f"strategy {name!r} takes no compressor (it has its own "
                          f"sparsification: options {', '.join(allowed) or 'none'})")
    if isinstance(compressor, Compressor):
        if len(rest) > 1:
            raise ConfigError(f"strategy {name!r}: compressor is a Compressor object; "
                              f"options {', '.join(sorted(set(rest) - {'compressor'}))} "
                              f"belong in it")
        return compressor
    if not isinstance(compressor, str):
        raise ConfigError(f"compressor must be a compressor's name or a Compressor, got "
                          f"{compressor!r}")
    known = ["compressor", *WrapperOptions.names(), *compressor_options(compressor)]
    for key in rest:
        if key not in known:
            own = [a for a in allowed if a != "compressor"]
            raise ConfigError(f"strategy {name!r} with compressor {compressor!r} has no option "
                              f"{key!r}; options: {', '.join(sorted(set(own) | set(known)))}")
    options = dict(rest)
    return build(options.pop("compressor"), **options)
