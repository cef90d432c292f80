"""What wrapper strategies (``nonblocking``, ``local``) share: their inner strategy's
options, parsed and checked in one place, and which inner strategies they accept (asked of
the inner strategy's capabilities, never its name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from gossip.errors import ConfigError
from gossip.options import Options
from gossip.strategies.base import STRATEGIES


class Wrapped(NamedTuple):
    """A wrapper's options as a run gives them (not parsed), split."""

    inner: str  # the strategy that combines
    inner_options: dict[str, Any]
    own: dict[str, Any]  # the wrapper's own (local's period)


def wrapped(strategy: str, options: Mapping[str, Any] | None = None) -> Wrapped | None:
    """What a registered wrapper (capability ``wraps``) runs with ``options``; None for a
    strategy that wraps none, or a name not registered here."""
    if strategy not in STRATEGIES or not STRATEGIES.strategy_class(strategy).wraps:
        return None
    own = dict(options or {})
    inner = own.pop("inner", STRATEGIES.options(strategy).inner)
    return Wrapped(inner, dict(own.pop("inner_options", None) or {}), own)


def inner_refusal(capabilities: Mapping[str, Any], *, asynchronous: bool) -> str | None:
    """Why a wrapper cannot wrap a strategy with these ``capabilities`` (None: it can).

    A wrapper combines through its inner strategy at points it decides itself, so the inner
    one must not decide them too; ``asynchronous``: the wrapper runs an inner strategy
    without lockstep rounds (forwarding its ``poll`` and ``finish``).
    """
    if capabilities.get("stops_rounds_early"):
        return ("it decides at run time when a round ends (stops_rounds_early), which the "
                "wrapper's rounds would not follow")
    if capabilities.get("plans_rounds"):
        return "it plans its own rounds (plans_rounds), which the wrapper's would override"
    if capabilities.get("synchronous") is False and not asynchronous:
        return "it is asynchronous: it has no lockstep rounds for the wrapper to close"
    if capabilities.get("operates_on") == "grads" and not capabilities.get("exact_mean"):
        return ("it averages gradients but not exactly (exact_mean): wrap an exact mean or a "
                "gossip (params) strategy")
    return None


def inner_options(wrapper: str, inner: str, given: Any, *,
                  own: type[Options]) -> tuple[Options, dict[str, Any]]:
    """The inner strategy's options (``given``: a mapping, an Options object or None) and
    the capabilities they give it; errors start with ``wrapper`` and name the option at
    fault. ``own`` is the wrapper's options class, whose ``accepts_inner`` decides.

    Raises:
        ConfigError: an unknown inner strategy, one the wrapper does not accept (itself
            included: a wrapper plans or ends its own rounds), or a bad inner option.
    """
    try:
        entry = STRATEGIES.entry(inner)
    except ConfigError as exc:  # it lists the strategies
        raise ConfigError(f"{wrapper}: inner: {exc}") from None
    if given is not None and not isinstance(given, (Mapping, Options)):
        raise ConfigError(f"{wrapper}: inner_options: expected a mapping, got {given!r}")
    try:
        parsed = STRATEGIES.options(inner, given)
    except ConfigError as exc:
        raise ConfigError(f"{wrapper}: inner_options: {exc}") from None
    # The class's capabilities_for, not its attributes: a wrapper sets some per instance.
    capabilities = entry.select(parsed).capabilities_for(parsed)
    why = own.accepts_inner(capabilities)
    if why:
        raise ConfigError(f"{wrapper}: inner: {inner!r} with these options: {why}")
    return parsed, capabilities
