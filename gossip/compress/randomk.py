"""Random-k sparsification: k uniformly random entries; no indices travel, only a seed."""

from __future__ import annotations

import copy

import numpy as np
import torch

from gossip.compress.base import (
    COMPRESSORS,
    check_density,
    check_seed,
    derive_seed,
    meta_int,
)
from gossip.compress.sparse import SparseCompressor, k_for
from gossip.errors import ConfigError, ProtocolError

_MAX_SEED = (1 << 63) - 1


def random_subset(numel: int, k: int, seed: int) -> torch.Tensor:
    """k distinct indices in [0, numel), uniform over k-subsets, sorted; same for same args.

    Draws with replacement and redraws what collided: the procedure is symmetric under any
    relabelling of [0, numel), so every k-subset is equally likely, and it costs O(k log k)
    instead of the O(numel) of a permutation (used only when k is a large fraction).
    """
    gen = torch.Generator().manual_seed(seed)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if 4 * k > numel:
        return torch.from_numpy(np.sort(torch.randperm(numel, generator=gen)[:k].numpy()))
    idx = _unique(torch.randint(numel, (k,), generator=gen).numpy())
    while idx.size < k:
        more = torch.randint(numel, (k - idx.size,), generator=gen).numpy()
        idx = _unique(np.concatenate([idx, more]))
    return torch.from_numpy(idx)


def _unique(a: np.ndarray) -> np.ndarray:
    # numpy's sort: torch's parallel sort/unique crawl when the few cores are oversubscribed.
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if a.size else a


@COMPRESSORS.register("randomk")
class RandomK(SparseCompressor):
    """Keep k = max(1, ceil(density * n)) random entries; the receiver regenerates them.

    The seed in the payload is derived from (``seed``, key, round), so each tensor and round
    gets fresh indices, and peers sharing ``seed`` pick the same ones. Peers must run the same
    torch version (the indices come from torch's generator).

    Args:
        density: Fraction of entries kept, in (0, 1].
        scale: Multiply the values by d / k: unbiased, but not contractive. Off by default
            (the contractive version, ω = k / d, for error feedback and CHOCO).
        values: Wire dtype of the kept values: fp32, fp16, bf16 or same (as the input).
        seed: Base seed of the index choice.
    """

    name = "randomk"

    def __init__(self, *, density: float = 0.01, scale: bool = False, values: str = "fp32",
                 seed: int = 0):
        super().__init__(values=values)
        self.density = check_density(density)
        if not isinstance(scale, bool):
            raise ConfigError(f"scale must be true or false, got {scale!r}")
        self.scale = scale
        self.unbiased = scale
        self.seed = check_seed(seed)

    def k(self, numel: int) -> int:
        """Entries kept of a tensor of ``numel``."""
        return k_for(self.density, numel)

    def with_density(self, density: float) -> RandomK:
        """A copy keeping ``density`` instead."""
        other = copy.copy(self)
        other.density = check_density(density)
        return other

    def select(self, flat: torch.Tensor, *, key: str,
               round: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = random_subset(flat.numel(), self.k(flat.numel()),
                            derive_seed(self.seed, key, round))
        return idx, flat[idx]

    def value_scale(self, k: int, numel: int) -> float:
        return numel / k if self.scale and k else 1.0

    def pack_support(self, idx, numel, *, key, round):
        return {"seed": derive_seed(self.seed, key, round)}, ()

    def unpack_support(self, meta, extra, k, numel):
        seed = meta_int(meta, "seed", 0, _MAX_SEED)
        if extra:
            raise ProtocolError(f"randomk payload: expected 1 buffer (values), "
                                f"got {1 + len(extra)}")
        return random_subset(numel, k, seed)

    def quality(self, numel: int) -> float:
        # Unscaled: ω = k/d. Scaled (variance factor d/k - 1): ω of the rescaled Q, also k/d.
        return self.k(numel) / numel if numel else 1.0

    def __repr__(self) -> str:
        return f"RandomK(density={self.density}, scale={self.scale}, values={self.values!r})"
