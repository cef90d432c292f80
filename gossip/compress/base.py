"""The Compressor interface, its options, its wire Payload, the registry and shared payload
checks.

A payload is self-describing: ``meta`` names the encoding and the original numel, dtype and
shape, so a receiver rebuilds the tensor from ``Payload(msg.meta, msg.buffers)`` alone.
Everything received is validated; a malformed payload raises ProtocolError naming the fault.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from gossip.errors import ConfigError, ProtocolError
from gossip.options import Check, Options
from gossip.registry import Registry

#: Dtypes a compressed tensor may have; the payload records which one by name.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_FLOAT_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


@dataclass(frozen=True, eq=False)  # tensors have no truth value: compare by identity
class Payload:
    """A compressed tensor as it crosses the wire.

    Attributes:
        meta: msgpack-able header values (str/int/float/bool/list/dict only).
        buffers: Contiguous CPU tensors sent as raw frames.
    """

    meta: Mapping[str, Any]
    buffers: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of the raw buffers (the header is not counted)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)


@dataclass(frozen=True)
class Header:
    """The common part of every payload's meta: what the original tensor was."""

    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Compressor(ABC):
    """Turns a float tensor into a Payload and back; configuration only, no state.

    Its options are an ``Options`` dataclass (``options_class``, fields declared with
    ``option(default, doc, check)``), parsed once when it is built: ``self.options``.
    Stateful behaviour (error feedback, momentum correction) wraps a compressor instead.
    ``quality(d)`` is ω in (0, 1] with E‖Q(v) − v‖² ≤ (1 − ω)‖v‖² (choco.md); for unbiased
    compressors it is the ω of the rescaled Q/(c + 1), c being the variance factor.
    """

    #: Registry name, also the payload encoding (wrappers report their inner one's).
    name: str = ""
    #: Sends a subset of entries (indices + values); such compressors offer ``unpack``.
    sparse: bool = False
    #: E[decompress(compress(x))] == x.
    unbiased: bool = False
    #: Sparsifiers: the entries kept are drawn at random, whatever their values (CHOCO's
    #: default step is smaller for such indiscriminate dropping: default_gamma).
    random_support: bool = False
    #: Sparsifiers: every peer compressing the same key and round keeps the same entries (a
    #: seed they share), so their values can be summed entry by entry (the compressed ring).
    shared_support: bool = False
    #: Its options (``gossip compressors`` lists their defaults and docs); none by default.
    options_class: type[Options] = Options

    def __init__(self, **options: Any):
        """Parse ``options`` into ``self.options``.

        Raises:
            ConfigError: One line naming this compressor and the unknown option (listing the
                allowed ones) or the option and the value that is not allowed.
        """
        allowed = self.options_class.names()
        for key in options:
            if key not in allowed:
                raise ConfigError(f"compressor {self.name!r} has no option {key!r}; options: "
                                  f"{', '.join(allowed) or 'none'}")
        try:
            self.options = self.options_class(**options)
        except ConfigError as error:
            raise ConfigError(f"compressor {self.name!r}: {error}") from None

    @abstractmethod
    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        """Compress ``x`` (any shape, floating point); ``key``/``round`` seed randomness."""

    @abstractmethod
    def decompress(self, p: Payload) -> torch.Tensor:
        """The dense tensor ``p`` stands for, in the original dtype and shape."""

    def add_to(self, p: Payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * decompress(p)`` in place; returns ``out``."""
        dense = self.decompress(p)
        check_out(out, dense.numel())
        return out.add_(dense.view(out.shape), alpha=alpha)

    @abstractmethod
    def quality(self, numel: int) -> float:
        """ω in (0, 1] for vectors of ``numel`` elements (see the class docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Internal state for checkpoints (none for plain compressors)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def __repr__(self) -> str:
        options = getattr(self, "options", None)
        given = ", ".join(f"{spec.name}={getattr(options, spec.name)!r}"
                          for spec in (fields(options) if options is not None else ()))
        return f"{type(self).__name__}({given})"


class CompressorRegistry(Registry[Compressor]):
    """``COMPRESSORS``: Compressor classes by name; their options come from ``options_class``."""

    def __init__(self):
        super().__init__("compressor")

    def register(self, name: str):
        """Class decorator registering a Compressor subclass under ``name``."""
        add = super().register(name)

        def decorate(cls: type[Compressor]) -> type[Compressor]:
            if not (isinstance(cls, type) and issubclass(cls, Compressor)):
                raise TypeError(f"compressor {name!r}: register a Compressor subclass, "
                                f"got {cls!r}")
            return add(cls)

        return decorate


COMPRESSORS = CompressorRegistry()


def create(name: str, /, **options: Any) -> Compressor:
    """Build the registered compressor ``name``.

    Raises:
        ConfigError: Unknown name (lists the known ones) or option (lists the allowed ones),
            or an invalid option value (names the compressor, the option and the value).
    """
    return COMPRESSORS.get(name)(**options)


def compressor_options(name: str) -> list[str]:
    """The options compressor ``name`` accepts."""
    return COMPRESSORS.get(name).options_class.names()


# ---------------------------------------------------------------- helpers for implementations


def flatten(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous 1-D float tensor (a view when possible)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_NAMES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ConfigError(f"compress expects a float16/bfloat16/float32/float64 tensor, got {got}")
    return x.detach().reshape(-1).contiguous()


def header(encoding: str, x: torch.Tensor) -> dict[str, Any]:
    """The meta every payload starts with; ``shape`` is left out for 1-D tensors."""
    meta: dict[str, Any] = {"c": encoding, "n": x.numel(), "dt": _FLOAT_NAMES[x.dtype]}
    if x.dim() != 1:
        meta["shape"] = list(x.shape)
    return meta


def parse_header(p: Payload, encoding: str) -> Header:
    """Validate the common meta of ``p`` against ``encoding``; raise ProtocolError if bad."""
    meta = p.meta
    if not isinstance(meta, Mapping):
        raise ProtocolError("compressed payload: meta is not a map")
    if not isinstance(p.buffers, tuple) or not all(isinstance(b, torch.Tensor) for b in p.buffers):
        raise ProtocolError("compressed payload: buffers must be a tuple of tensors")
    got = meta_value(meta, "c", str)
    if got != encoding:
        raise ProtocolError(f"compressed payload: encoding {got!r} is not {encoding!r}")
    numel = meta_int(meta, "n", 0, 1 << 40)
    dtype_name = meta_value(meta, "dt", str)
    if dtype_name not in FLOAT_DTYPES:
        raise ProtocolError(f"compressed payload: dtype {dtype_name!r} not one of "
                            f"{', '.join(FLOAT_DTYPES)}")
    shape: tuple[int, ...] = (numel,)
    if "shape" in meta:
        raw = meta["shape"]
        if (not isinstance(raw, (list, tuple)) or len(raw) > 8
                or not all(_is_int(d) and d >= 0 for d in raw) or math.prod(raw) != numel):
            raise ProtocolError(f"compressed payload: shape {raw!r} does not hold n={numel}")
        shape = tuple(raw)
    return Header(numel, FLOAT_DTYPES[dtype_name], shape)


def meta_value(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``meta[key]``, checked to be present and of ``kind``."""
    if key not in meta:
        raise ProtocolError(f"compressed payload: missing meta key {key!r}")
    value = meta[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ProtocolError(f"compressed payload: meta {key!r}={value!r} has the wrong type")
    return value


def meta_int(meta: Mapping[str, Any], key: str, low: int, high: int) -> int:
    """An int ``meta[key]`` in ``[low, high]``."""
    value = meta_value(meta, key, int)
    if not low <= value <= high:
        raise ProtocolError(f"compressed payload: meta {key!r}={value} not in [{low}, {high}]")
    return value


def meta_float(meta: Mapping[str, Any], key: str) -> float:
    """A finite, non-negative float ``meta[key]`` (ints accepted)."""
    value = float(meta_value(meta, key, (int, float)))
    if not math.isfinite(value) or value < 0:
        raise ProtocolError(f"compressed payload: meta {key!r}={value} is not finite and >= 0")
    return value


def buffers(p: Payload, count: int, encoding: str) -> tuple[torch.Tensor, ...]:
    """The flattened buffers of ``p``, checked to be exactly ``count``."""
    if len(p.buffers) != count:
        raise ProtocolError(f"{encoding} payload: expected {count} buffer(s), got {len(p.buffers)}")
    return tuple(b.reshape(-1) for b in p.buffers)


def check_buffer(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> torch.Tensor:
    """Raise ProtocolError unless ``t`` has ``dtype`` and ``numel`` elements."""
    if t.dtype != dtype:
        raise ProtocolError(f"{what}: dtype {t.dtype} where {dtype} was expected")
    if t.numel() != numel:
        raise ProtocolError(f"{what}: {t.numel()} elements where {numel} were expected")
    return t


def check_out(out: torch.Tensor, numel: int) -> None:
    """``out`` of ``add_to`` must hold as many elements as the payload."""
    if out.numel() != numel:
        raise ProtocolError(f"payload holds {numel} elements but out has {out.numel()}")


def derive_seed(seed: int, key: str, round: int) -> int:
    """A 63-bit seed that differs per (seed, key, round) and is the same on every machine."""
    digest = hashlib.blake2b(f"{seed}\x00{key}\x00{round}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(seed: int, key: str, round: int) -> torch.Generator:
    """A CPU generator seeded by ``derive_seed``."""
    return torch.Generator().manual_seed(derive_seed(seed, key, round))


_FRACTION = "must be a number in (0, 1]"


def fraction(value: float) -> str | None:
    """The check of a density option: (0, 1]."""
    return None if 0 < value <= 1 else _FRACTION


def one_of(*allowed: Any) -> Check:
    """The check of an option taking one of a few values (named as they are written)."""
    return lambda value: (None if value in allowed else
                          f"must be one of {', '.join(map(repr, allowed))}")


def check_density(density: Any) -> float:
    """A density outside an options dataclass (warm-up start, benchmarks), checked."""
    if not _is_number(density) or fraction(density):
        raise ConfigError(f"density {_FRACTION}, got {density!r}")
    return float(density)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
