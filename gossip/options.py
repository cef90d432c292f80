"""Options, declared once: a frozen dataclass per strategy or compressor with defaults, docs
and checks.

Every way of configuring one (``Peer(**options)``, the CLI's ``--option KEY=VALUE``, a config
or experiment YAML, ``compress.create(name, **options)``) ends in the same dataclass, so a value
is checked in one place, an error always names the option and what it may be, and the listings
(``gossip strategies``, ``gossip compressors``) are read from the fields::

    @dataclass(frozen=True)
    class MatchaOptions(Options):
        budget: float = option(0.5, "communication budget in (0, 1]", check=in_unit_interval)

A strategy that sends messages declares its options on ``TaggedOptions``, naming its tag
and kinds with the class (``class RingOptions(TaggedOptions, tag="ring", kinds=("rs", "ag"))``).
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
    """Base of every strategy's and compressor's options; values are checked when constructed.

    Raises:
        ConfigError: naming the option, the value and what is allowed.
    """

    #: Representative option sets (a strategy's may name a compressor and its options): the
    #: contract suite runs each strategy's, tests/unit/test_compress_options.py each compressor's.
    examples: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)
    #: Option sets that switch on a mode the defaults leave off (local's outer optimizer):
    #: the compatibility matrix (gossip/matrix.py) gives each a row of its own (a
    #: wrapper's: one with each inner strategy it takes).
    variants: ClassVar[tuple[Mapping[str, Any], ...]] = ()

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
    def from_mapping(cls, data: Any, where: str) -> Options:
        """A file's mapping ``data`` (e.g. an experiment's section) as these options;
        ConfigError at ``where`` naming the field at fault."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(cls.names())}, got "
                              f"{data!r}")
        for key in data:
            if key not in cls.names():
                raise ConfigError(f"{where}: unknown field {key!r}; fields: "
                                  f"{', '.join(cls.names())}")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """One row per option: name, default and doc."""
        rows = []
        for spec in fields(cls):
            default = spec.default if spec.default is not MISSING else spec.default_factory()
            rows.append({"option": spec.name, "default": default,
                         "doc": spec.metadata.get("doc", "")})
        return rows


TAG_DOC = "its message kind (or their prefix), distinct per instance on one transport"


@dataclass(frozen=True)
class TaggedOptions(Options):
    """Options of a strategy that sends messages: a ``tag`` option names them, so that two
    instances on one transport (overlap's buckets, a wrapper's inner strategy) keep apart.

    A subclass gives its default tag and the suffixes of its kinds with the class::

        class RingOptions(TaggedOptions, tag="ring", kinds=("rs", "ag")): ...

    ``kinds`` is then ``("ring.rs", "ring.ag")``; without ``kinds``, the tag alone. The
    ``tag`` field follows the class's own fields (a base without a tag has none).
    """

    #: Suffixes of its message kinds after ``tag.`` (``""``: the tag itself).
    kind_suffixes: ClassVar[tuple[str, ...]] = ("",)

    def __init_subclass__(cls, *, tag: str | None = None, kinds: tuple[str, ...] | None = None,
                          **kwargs):
        super().__init_subclass__(**kwargs)
        if tag is not None:  # declared here, before @dataclass reads the class's fields
            if "__annotations__" not in cls.__dict__:
                cls.__annotations__ = {}
            cls.__annotations__["tag"] = str
            cls.tag = option(tag, TAG_DOC)
        if kinds is not None:
            cls.kind_suffixes = tuple(kinds)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The message kinds these options name: ``tag``, or ``tag.suffix`` for each suffix."""
        return tuple(f"{self.tag}.{suffix}" if suffix else self.tag
                     for suffix in self.kind_suffixes)


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
    wanted = {float: "a number", int: "an integer", bool: "true or false", str: "a string",
              Mapping: "a mapping"}
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in (typing.get_args(hint) if union else (hint,)) if a is not type(None)]
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
