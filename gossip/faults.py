"""Seeded delay injection: slow devices, random stragglers, slow senders.

``DelayConfig`` is the ``delays`` section of a run's config (what every peer reads);
``DelayModel`` is one rank's resolved share of it. Each mini-batch of rank ``r`` takes

    factor_r * (measured + compute) + X,   X = Exp(straggler_mean) with probability
                                           straggler_prob, else 0,

where the part beyond ``measured`` is slept, so emulated slowness costs no CPU (many peers
share few cores). ``X`` for the k-th mini-batch a rank computes is a pure function of
``(seed, rank, k)``: a blocking and a non-blocking run with the same seed meet the same
stragglers on the same data. ``send_delay`` is slept before each message of the algorithm a
peer sends (``Peer(send_delay=...)``, see ``Transport.delay_sends``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gossip.errors import ConfigError

_BLOCK = 1024  # straggler draws are generated this many at a time per (seed, rank)


def _number(source: str, value: Any, *, low: float, inclusive: bool = True) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value):
        raise ConfigError(f"{source}: expected a number, got {value!r}")
    if value < low or (value == low and not inclusive) or math.isinf(value):
        raise ConfigError(f"{source}: {value!r} must be {'>=' if inclusive else '>'} {low:g}")
    return float(value)


def _rank_key(source: str, key: Any) -> int:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if not isinstance(key, numbers.Integral) or isinstance(key, bool) or key < 0:
        raise ConfigError(f"{source}: {key!r} is not a rank")
    return int(key)


def _per_rank(source: str, value: Any, *, low: float) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: expected a mapping rank -> value, got {value!r}")
    return {_rank_key(source, k): _number(f"{source}[{k}]", v, low=low)
            for k, v in value.items()}


@dataclass(frozen=True)
class DelayConfig:
    """Injected delays of a run, the same on every peer (the ``delays`` config section).

    Attributes:
        compute: Emulated compute seconds added to every mini-batch (a slower device than
            this machine), scaled by the rank's slowdown.
        slowdown: ``{rank: factor >= 1}``; that rank's mini-batches take ``factor`` times as
            long (measured compute plus ``compute``). Unlisted ranks have factor 1.
        straggler_prob: Probability that a mini-batch is hit by a straggler delay.
        straggler_mean: Mean seconds of that delay (exponentially distributed).
        send_delay: Seconds slept before every message a peer sends: one number for all
            ranks, or ``{rank: seconds}``.
        seed: Seeds the straggler draws (default: the run's seed).
    """

    compute: float = 0.0
    slowdown: Mapping[int, float] = field(default_factory=dict)
    straggler_prob: float = 0.0
    straggler_mean: float = 0.0
    send_delay: float | Mapping[int, float] = 0.0
    seed: int | None = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("compute", _number("delays.compute", self.compute, low=0))
        set_("slowdown", _per_rank("delays.slowdown", self.slowdown, low=1))
        set_("straggler_prob", _number("delays.straggler_prob", self.straggler_prob, low=0))
        if self.straggler_prob > 1:
            raise ConfigError(f"delays.straggler_prob: {self.straggler_prob!r} must be <= 1")
        set_("straggler_mean", _number("delays.straggler_mean", self.straggler_mean, low=0))
        if self.straggler_prob > 0 and self.straggler_mean == 0:
            raise ConfigError("delays.straggler_mean: must be > 0 when straggler_prob > 0")
        if isinstance(self.send_delay, Mapping):
            set_("send_delay", _per_rank("delays.send_delay", self.send_delay, low=0))
        else:
            set_("send_delay", _number("delays.send_delay", self.send_delay, low=0))
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral)
                                      or isinstance(self.seed, bool)):
            raise ConfigError(f"delays.seed: expected an integer, got {self.seed!r}")

    @property
    def active(self) -> bool:
        """Whether any delay is injected at all."""
        sends = self.send_delay.values() if isinstance(self.send_delay, dict) else [
            self.send_delay]
        return bool(self.compute or self.slowdown or self.straggler_prob or any(sends))

    def check_ranks(self, size: int) -> None:
        """Raise ConfigError if a per-rank entry names a rank outside ``0..size-1``."""
        per_rank = {"slowdown": self.slowdown}
        if isinstance(self.send_delay, dict):
            per_rank["send_delay"] = self.send_delay
        for name, table in per_rank.items():
            for rank in table:
                if rank >= size:
                    raise ConfigError(f"delays.{name}: rank {rank} is not in the run "
                                      f"(ranks 0..{size - 1})")

    def for_rank(self, rank: int, *, seed: int) -> DelayModel:
        """This config resolved for ``rank``; ``seed`` is used unless ``self.seed`` is set."""
        send = (self.send_delay.get(rank, 0.0) if isinstance(self.send_delay, dict)
                else self.send_delay)
        return DelayModel(rank=rank, seed=seed if self.seed is None else self.seed,
                          factor=self.slowdown.get(rank, 1.0), compute=self.compute,
                          straggler_prob=self.straggler_prob,
                          straggler_mean=self.straggler_mean, send_delay=send)

    def to_dict(self) -> dict[str, Any]:
        send = dict(self.send_delay) if isinstance(self.send_delay, dict) else self.send_delay
        return {"compute": self.compute, "slowdown": dict(self.slowdown),
                "straggler_prob": self.straggler_prob, "straggler_mean": self.straggler_mean,
                "send_delay": send, "seed": self.seed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DelayConfig:
        """From a YAML mapping (None: no delays); errors name the field."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"delays: expected a mapping, got {data!r}")
        known = list(cls.__dataclass_fields__)
        for key in data:
            if key not in known:
                raise ConfigError(f"delays: unknown field {key!r}; fields: {', '.join(known)}")
        return cls(**{k: ({} if v is None and k == "slowdown" else v) for k, v in data.items()})


@functools.lru_cache(maxsize=64)
def _uniforms(seed: int, rank: int, block: int) -> np.ndarray:
    """Two uniforms per mini-batch for mini-batches ``block*_BLOCK ...``: [_BLOCK, 2]."""
    return np.random.default_rng([seed, rank, block]).random((_BLOCK, 2))


@dataclass(frozen=True)
class DelayModel:
    """The delays of one rank; pure: the same (seed, rank, index) gives the same delay."""

    rank: int
    seed: int
    factor: float = 1.0
    compute: float = 0.0
    straggler_prob: float = 0.0
    straggler_mean: float = 0.0
    send_delay: float = 0.0

    def straggler(self, index: int) -> float:
        """Extra seconds of this rank's ``index``-th mini-batch (0 for most)."""
        if self.straggler_prob <= 0:
            return 0.0
        hit, size = _uniforms(self.seed, self.rank, index // _BLOCK)[index % _BLOCK]
        if hit >= self.straggler_prob:
            return 0.0
        return -self.straggler_mean * math.log1p(-size)  # inverse CDF of Exp(mean)

    def minibatch_delay(self, index: int, measured: float) -> float:
        """Seconds to sleep after the ``index``-th mini-batch, whose compute took ``measured``."""
        return ((self.factor - 1.0) * measured + self.factor * self.compute
                + self.straggler(index))
