"""Strategy options, declared once: a frozen dataclass per strategy with defaults, docs and checks.

Every way of configuring a strategy (``Peer(**options)``, the CLI's ``--option KEY=VALUE``,
a config or experiment YAML) ends in the same dataclass, so a value is checked in one place
and an error always names the option and what it may be::

    @dataclass(frozen=True)
    class MatchaOptions(Options):
        budget: float = option(0.5, "communication budget in (0, 1]", check=in_unit_interval)

Wrappers nest their inner strategy's options (``NonBlockingOptions.inner_options``).
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from gossip.errors import ConfigError

Check = Callable[[Any], "str | None"]


def option(default: Any, doc: str, *, choices: tuple | list | None = None,
           check: Check | None = None) -> Any:
    """A field of an ``Options`` dataclass.

    Args:
        default: Its value when not given.
        doc: One line saying what it does (``gossip strategies`` prints it).
        choices: The values allowed, if a few.
        check: ``check(value)`` returns why a value is not allowed (e.g. ``"must be >= 64"``),
            or None when it is.

    A mutable default (a dict) is copied for each object.
    """
    metadata = {"doc": doc, "choices": tuple(choices or ()), "check": check}
    if type(default).__hash__ is None:  # dataclasses refuse a shared mutable default
        return field(default_factory=functools.partial(copy.copy, default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Options:
    """Base of every strategy's options; values are checked when constructed.

    Raises:
        ConfigError: naming the option, the value and what is allowed.
    """

    #: Representative option sets (compressors included): the contract suite runs each.
    examples: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for spec in fields(self):
            value = getattr(self, spec.name)
            why = _wrong(value, hints[spec.name])
            if not why:
                value = _coerce(value, hints[spec.name])
                why = _refused(spec, value)
            if why:
                raise self.refusal(spec.name, value, why)
            object.__setattr__(self, spec.name, value)

    @classmethod
    def refusal(cls, name: str, value: Any, why: str) -> ConfigError:
        """The error for option ``name`` refusing ``value`` because ``why`` (one line)."""
        return ConfigError(f"{name} {why}, got {value!r}")

    @classmethod
    def names(cls) -> list[str]:
        return [spec.name for spec in fields(cls)]

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """One row per option: name, default and doc."""
        rows = []
        for spec in fields(cls):
            default = spec.default if spec.default is not MISSING else spec.default_factory()
            rows.append({"option": spec.name, "default": default,
                         "doc": spec.metadata.get("doc", "")})
        return rows


# -- checks shared by several strategies -----------------------------------------------------


def in_unit_interval(value: float) -> str | None:
    """(0, 1]"""
    return None if 0 < value <= 1 else "must be in (0, 1]"


def at_least(low: float) -> Check:
    return lambda value: None if value >= low else f"must be >= {low:g}"


def positive(value: float) -> str | None:
    """(0, inf): NaN, infinities, zero and negatives are refused."""
    return None if 0 < value < math.inf else "must be a positive finite number"


def _refused(spec, value: Any) -> str | None:
    """Why the field ``spec`` refuses ``value`` (its choices, its check); None: allowed."""
    choices = spec.metadata.get("choices")
    if choices and value not in choices:
        return f"must be one of {', '.join(map(str, choices))}"
    check = spec.metadata.get("check")
    return check(value) if check is not None and value is not None else None


# -- type coercion from annotations -----------------------------------------------------------


def _wrong(value: Any, hint: Any) -> str | None:
    """Why ``value`` is not of the annotation ``hint``'s type (None: it is; an int where a
    float is wanted is)."""
    if hint is Any or _match(value, hint) is not None:
        return None
    wanted = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
    args = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    described = " or ".join(wanted.get(typing.get_origin(a) or a,
                                       getattr(typing.get_origin(a) or a, "__name__", str(a)))
                            for a in args)
    return f"must be {described}"


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` wants it (after ``_wrong`` found it fits)."""
    if hint is Any:
        return value
    candidate = _match(value, hint)
    return value if candidate is type(None) else _convert(value, candidate)


def _match(value: Any, hint: Any) -> Any:
    """The type of ``hint`` (one of a union's) ``value`` fits; None if none."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        allowed = typing.get_args(hint)
        if value is None and type(None) in allowed:
            return type(None)
        return next((c for c in allowed if c is not type(None) and _fits(value, c)), None)
    return hint if _fits(value, hint) else None


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


def _convert(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return float(value)
    if origin is int:
        return int(value)
    return value
