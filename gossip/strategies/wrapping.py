"""What wrapper strategies (``nonblocking``, ``local``) share: their inner strategy's
options, parsed and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gossip.errors import ConfigError
from gossip.strategies.base import STRATEGIES
from gossip.strategies.options import Options


def inner_options(wrapper: str, inner: str, given: Any, *,
                  own: type[Options]) -> tuple[Options, type]:
    """The inner strategy's options (``given``: a mapping, an Options object or None) and
    the class they select; errors start with ``wrapper`` and name the option at fault.

    Raises:
        ConfigError: an unknown inner strategy, ``wrapper`` wrapping itself (its options
            class is ``own``), or a bad inner option.
    """
    try:
        entry = STRATEGIES.entry(inner)
    except ConfigError as exc:  # it lists the strategies
        raise ConfigError(f"{wrapper}: inner: {exc}") from None
    if entry.options is own:
        raise ConfigError(f"{wrapper}: inner: cannot wrap {wrapper} itself")
    if given is not None and not isinstance(given, (Mapping, Options)):
        raise ConfigError(f"{wrapper}: inner_options: expected a mapping, got {given!r}")
    try:
        parsed = STRATEGIES.options(inner, given)
    except ConfigError as exc:
        raise ConfigError(f"{wrapper}: inner_options: {exc}") from None
    return parsed, entry.select(parsed)
