"""Threshold sparsification: keep every entry with |x| >= t (k varies per message)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gossip.compress.base import COMPRESSORS
from gossip.compress.selection import abs_at_least
from gossip.compress.sparse import IndexedSparse, values_option
from gossip.options import Options, option


def magnitude(value: float) -> str | None:
    """A threshold: finite and >= 0."""
    return None if 0 <= value < math.inf else "must be a finite number >= 0"


@dataclass(frozen=True)
class ThresholdOptions(Options):
    """Options of ``threshold``."""

    examples = ({}, {"threshold": 0.5, "values": "bf16"})

    threshold: float = option(1e-3, "magnitude kept, a finite number >= 0 (0 keeps everything)",
                              check=magnitude)
    values: str = values_option()


@COMPRESSORS.register("threshold")
class Threshold(IndexedSparse):
    """Keep the entries with ``|x| >= threshold``; biased, the message size depends on data."""

    name = "threshold"
    options_class = ThresholdOptions
    options: ThresholdOptions

    def select(self, flat: torch.Tensor, *, key: str,
               round: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = abs_at_least(flat, self.options.threshold)
        return idx, flat[idx]

    def quality(self, numel: int) -> float:
        # No data-independent guarantee: a vector entirely below t is dropped. 1/d is the
        # ω of keeping a single (the largest) entry, a nominal value for step-size rules.
        return 1.0 / numel if numel else 1.0
