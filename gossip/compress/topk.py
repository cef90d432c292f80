"""Top-k sparsification: the k entries of largest magnitude, k = max(1, ceil(density * n))."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.compress.base import COMPRESSORS, derive_seed, one_of
from gossip.compress.selection import (
    SAMPLE_SIZE,
    sample_size_for,
    topk_select,
    topk_select_difference,
)
from gossip.compress.sparse import DensityOptions, DensitySparsifier, IndexedSparse, values_option
from gossip.options import option

METHODS = ("sampled", "exact")


@dataclass(frozen=True)
class TopKOptions(DensityOptions):
    """Options of ``topk``."""

    examples = ({}, {"density": 0.3, "method": "exact", "values": "fp16", "seed": 5})

    method: str = option("sampled", "sampled (threshold from a random sample, then exact among "
                                    "candidates: same indices, several times faster on large "
                                    "tensors) or exact (torch.topk)", check=one_of(*METHODS))
    values: str = values_option()
    seed: int = option(0, "seeds the sample positions (per key and round); never changes the "
                          "result")


@COMPRESSORS.register("topk")
class TopK(DensitySparsifier, IndexedSparse):
    """Keep exactly k largest-|x| entries; ω = k / d. Biased (use with error feedback)."""

    name = "topk"
    options_class = TopKOptions
    options: TopKOptions

    def select(self, flat: torch.Tensor, *, key: str,
               round: int) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_select(flat, self.k(flat.numel()), **self._sampling(flat, key, round))

    def select_difference(self, x: torch.Tensor, base: torch.Tensor, out: torch.Tensor, *,
                          key: str, round: int) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_select_difference(x, base, out, self.k(x.numel()),
                                      **self._sampling(x, key, round))

    def _sampling(self, flat: torch.Tensor, key: str, round: int) -> dict:
        gen = torch.Generator().manual_seed(derive_seed(self.options.seed, key, round))
        n = flat.numel()
        # Below 4x the default sample the exact method runs (as it always did); above, a
        # smaller sample: the same top-k, at 1M floats in half the time.
        sample = SAMPLE_SIZE if n < 4 * SAMPLE_SIZE else sample_size_for(n)
        return {"method": self.options.method, "generator": gen, "sample_size": sample}
