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
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.errors import ConfigError
from gossip.options import Check, Options, option

_BLOCK = 1024  # straggler draws are generated this many at a time per (seed, rank)


def _finite_at_least(low: float) -> Check:
    """A check: a finite number >= ``low``."""
    return lambda value: None if low <= value < math.inf else f"must be a finite number >= {low:g}"


def _rank(key: Any) -> int | None:
    """``key`` as a rank (``3`` or ``"3"``, as YAML and flags give them); None: no rank."""
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if not isinstance(key, numbers.Integral) or isinstance(key, bool) or key < 0:
        return None
    return int(key)


def _per_rank(low: float) -> Check:
    """A check of ``{rank: number >= low}`` (a single number is left to the type's check)."""
    number = _finite_at_least(low)

    def check(value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return number(value)
        for key, entry in value.items():
            if _rank(key) is None:
                return f"names {key!r}, which is not a rank"
            if not isinstance(entry, numbers.Real) or isinstance(entry, bool):
                return f"gives rank {key} {entry!r}, which is not a number"
            why = number(entry)
            if why:
                return f"gives rank {key} {entry!r}, which {why}"
        return None
    return check


@dataclass(frozen=True)
class DelayConfig(Options):
    """Injected delays of a run, the same on every peer (the ``delays`` config section).

    Each field is declared once, with its default, doc and check; `gossip peer`, `launch`
    and `simulate` generate their delay flags (``--compute-delay``, ``--slowdown RANK:VALUE``,
    ...) from them (gossip/cli/flags.py). Per-rank values are ``{rank: value}``.
    """

    compute: float = option(
        0.0, "Emulated compute seconds slept per mini-batch (a slower device), scaled by the "
             "rank's slowdown.", check=_finite_at_least(0))
    slowdown: Mapping[int, float] = option(
        {}, "Per rank: its mini-batches (measured plus emulated compute) take VALUE >= 1 "
            "times as long; unlisted ranks 1.", check=_per_rank(1))
    straggler_prob: float = option(
        0.0, "Probability that a mini-batch is hit by a straggler delay.",
        check=lambda value: None if 0 <= value <= 1 else "must be in [0, 1]")
    straggler_mean: float = option(0.0, "Mean seconds of the (exponential) straggler delay.",
                                   check=_finite_at_least(0))
    send_delay: float | Mapping[int, float] = option(
        0.0, "Seconds slept before every message a peer sends: one number for all ranks, or "
             "per rank.", check=_per_rank(0))
    seed: int | None = option(None, "Seed of the straggler draws (none: the run's seed).")

    @classmethod
    def refusal(cls, name: str, value: Any, why: str) -> ConfigError:
        """Errors name the section: ``delays.compute: -1.0 must be a finite number >= 0``."""
        return ConfigError(f"delays.{name}: {value!r} {why}")

    def __post_init__(self):
        super().__post_init__()  # every field's type and check
        for name in ("slowdown", "send_delay"):  # YAML's and the flags' keys, as ranks
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, {_rank(k): float(v) for k, v in value.items()})
        if self.straggler_prob > 0 and self.straggler_mean == 0:
            raise ConfigError("delays.straggler_mean: must be > 0 when straggler_prob > 0")

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
        known = cls.names()
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
