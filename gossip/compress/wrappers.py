"""Compressors that wrap another: the Wrapper base, local clipping and density warm-up.

A wrapper changes what is compressed (or, in feedback.py, remembers what was not sent); the
payload is always the inner compressor's, so receivers decode it with the inner one alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gossip.compress.base import Compressor, Payload, check_density, flatten
from gossip.compress.dense import work_dtype
from gossip.compress.sparse import DensitySparsifier, Sparse
from gossip.errors import ConfigError


class Wrapper(Compressor):
    """Delegates everything to ``inner``; subclasses override ``compress``."""

    def __init__(self, inner: Compressor):
        if not isinstance(inner, Compressor):
            raise ConfigError(f"{type(self).__name__} wraps a Compressor, got {inner!r}")
        self.inner = inner
        self.name = inner.name  # the payload encoding is the inner one's
        self.sparse = inner.sparse
        self.unbiased = inner.unbiased
        self.random_support = inner.random_support
        self.shared_support = inner.shared_support

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        return self.inner.compress(x, key=key, round=round)

    def decompress(self, p: Payload) -> torch.Tensor:
        return self.inner.decompress(p)

    def add_to(self, p: Payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return self.inner.add_to(p, out, alpha)

    def unpack(self, p: Payload) -> Sparse:
        """The inner sparsifier's decoded header, indices and values."""
        if not self.sparse:
            raise TypeError(f"{self.inner!r} is not a sparsifier")
        return self.inner.unpack(p)  # type: ignore[attr-defined]

    def compress_unpacked(self, x: torch.Tensor, *, key: str = "",
                          round: int = 0) -> tuple[Payload, Sparse]:
        """``compress`` and its decoded form (sparsifiers only, see SparseCompressor)."""
        payload = self.compress(x, key=key, round=round)
        return payload, self.unpack(payload)

    def compress_difference(self, x: torch.Tensor, base: torch.Tensor, out: torch.Tensor, *,
                            key: str = "", round: int = 0) -> tuple[Payload, Sparse]:
        """``compress_unpacked(x - base)``, the difference taken into ``out``."""
        return self.compress_unpacked(torch.sub(x, base, out=out), key=key, round=round)

    def quality(self, numel: int) -> float:
        return self.inner.quality(numel)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class Clip(Wrapper):
    """Scale ``x`` down to L2 norm ``max_norm`` (if above) before compressing it.

    Args:
        inner: The compressor of the clipped tensor.
        max_norm: Largest L2 norm passed on, a finite number > 0.
    """

    def __init__(self, inner: Compressor, max_norm: float):
        super().__init__(inner)
        if (not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool)
                or not math.isfinite(max_norm) or max_norm <= 0):
            raise ConfigError(f"clip max_norm must be a finite number > 0, got {max_norm!r}")
        self.max_norm = float(max_norm)

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        norm = float(torch.linalg.vector_norm(work_dtype(flatten(x)))) if x.numel() else 0.0
        if norm > self.max_norm:
            x = x * (self.max_norm / norm)
        return self.inner.compress(x, key=key, round=round)

    def __repr__(self) -> str:
        return f"Clip({self.inner!r}, max_norm={self.max_norm})"


class DensityWarmup(Wrapper):
    """Send more in the first rounds: density decays exponentially to the inner one's.

    Round r < ``rounds`` uses ``start · (target / start) ** (r / rounds)``, later rounds the
    target; with start 0.25, 4 rounds and target 0.25⁵ ≈ 0.001 that is DGC's schedule 0.25,
    0.0625, 0.0156, 0.0039, then 0.001.

    Args:
        inner: A ``DensitySparsifier`` (topk, randomk).
        rounds: Warm-up rounds, an int >= 0.
        start: Density of round 0, in [target, 1].
    """

    inner: DensitySparsifier

    def __init__(self, inner: Compressor, rounds: int, start: float = 0.25):
        super().__init__(inner)
        if not isinstance(inner, DensitySparsifier):
            raise ConfigError(f"density warm-up needs a compressor with a density "
                              f"(topk, randomk), got {inner!r}")
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ConfigError(f"warm-up rounds must be an int >= 0, got {rounds!r}")
        self.rounds = rounds
        self.start = check_density(start)
        self.target = inner.density
        if self.start < self.target:
            raise ConfigError(f"warm-up start density {self.start} is below the target "
                              f"density {self.target}")
        self._by_density: dict[float, Compressor] = {}

    def density_at(self, round: int) -> float:
        """The density used in ``round``."""
        if round >= self.rounds or round < 0:
            return self.target
        return max(self.target, self.start * (self.target / self.start) ** (round / self.rounds))

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        density = self.density_at(round)
        inner = self._by_density.get(density)
        if inner is None:
            inner = self.inner.with_density(density)
            self._by_density[density] = inner
        return inner.compress(x, key=key, round=round)

    def __repr__(self) -> str:
        return f"DensityWarmup({self.inner!r}, rounds={self.rounds}, start={self.start})"
