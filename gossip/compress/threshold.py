"""Threshold sparsification: keep every entry with |x| >= t (k varies per message)."""

from __future__ import annotations

import math

import torch

from gossip.compress.base import COMPRESSORS
from gossip.compress.selection import abs_at_least
from gossip.compress.sparse import IndexedSparse
from gossip.errors import ConfigError


@COMPRESSORS.register("threshold")
class Threshold(IndexedSparse):
    """Keep the entries with ``|x| >= threshold``; biased, the message size depends on data.

    Args:
        threshold: Magnitude kept, a finite number >= 0 (0 keeps everything).
        values: Wire dtype of the kept values: fp32, fp16, bf16 or same (as the input).
    """

    name = "threshold"

    def __init__(self, *, threshold: float = 1e-3, values: str = "fp32"):
        super().__init__(values=values)
        if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
                or not math.isfinite(threshold) or threshold < 0):
            raise ConfigError(f"threshold must be a finite number >= 0, got {threshold!r}")
        self.threshold = float(threshold)

    def select(self, flat: torch.Tensor, *, key: str,
               round: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = abs_at_least(flat, self.threshold)
        return idx, flat[idx]

    def quality(self, numel: int) -> float:
        # No data-independent guarantee: a vector entirely below t is dropped. 1/d is the
        # ω of keeping a single (the largest) entry, a nominal value for step-size rules.
        return 1.0 / numel if numel else 1.0

    def __repr__(self) -> str:
        return f"Threshold(threshold={self.threshold}, values={self.values!r})"
