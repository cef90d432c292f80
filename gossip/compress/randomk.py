"""Random-k sparsification: k uniformly random entries; no indices travel, only a seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gossip.compress.base import COMPRESSORS, derive_seed, meta_int
from gossip.compress.sparse import DensityOptions, DensitySparsifier, values_option
from gossip.errors import ProtocolError
from gossip.options import option

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


@dataclass(frozen=True)
class RandomKOptions(DensityOptions):
    """Options of ``randomk``."""

    examples = ({}, {"density": 0.3, "scale": True, "values": "same", "seed": 5})

    scale: bool = option(False, "multiply the values by d / k: unbiased, but not contractive "
                                "(off: the contractive version, ω = k / d, for error feedback "
                                "and CHOCO)")
    values: str = values_option()
    seed: int = option(0, "base seed of the index choice")


@COMPRESSORS.register("randomk")
class RandomK(DensitySparsifier):
    """Keep k = max(1, ceil(density * n)) random entries; the receiver regenerates them.

    The seed in the payload is derived from (``seed``, key, round), so each tensor and round
    gets fresh indices, and peers sharing ``seed`` pick the same ones. Peers must run the same
    torch version (the indices come from torch's generator). Scaled, the variance factor is
    d/k - 1: the ω of the rescaled Q is k/d too.
    """

    name = "randomk"
    options_class = RandomKOptions
    random_support = True
    shared_support = True  # the seed derives from (seed, key, round) alone
    options: RandomKOptions

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.options.scale

    def select(self, flat: torch.Tensor, *, key: str,
               round: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = random_subset(flat.numel(), self.k(flat.numel()),
                            derive_seed(self.options.seed, key, round))
        return idx, flat[idx]

    def value_scale(self, k: int, numel: int) -> float:
        return numel / k if self.options.scale and k else 1.0

    def pack_support(self, idx, numel, *, key, round):
        return {"seed": derive_seed(self.options.seed, key, round)}, ()

    def unpack_support(self, meta, extra, k, numel):
        seed = meta_int(meta, "seed", 0, _MAX_SEED)
        if extra:
            raise ProtocolError(f"randomk payload: expected 1 buffer (values), "
                                f"got {1 + len(extra)}")
        return random_subset(numel, k, seed)
