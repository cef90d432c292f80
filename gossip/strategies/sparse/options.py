"""The sparse all-reduce strategies' options."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.options import TaggedOptions, in_unit_interval, option
from gossip.strategies.robust import GatheredRobustOptions

INDEX_CODINGS = ("compact", "int32")
RESIDUAL_MODES = ("conserve", "reference")


@dataclass(frozen=True)
class SparseOptions(TaggedOptions, tag="sparse"):
    """Options shared by the sparse all-reduce strategies."""

    examples = ({"density": 0.3}, {"density": 1.0}, {"density": 0.2, "indices": "int32"},
                {"density": 0.3, "error_feedback": False})

    density: float = option(0.01, "fraction of entries kept, in (0, 1]; k = max(1, "
                                  "ceil(density * n))", check=in_unit_interval)
    error_feedback: bool = option(True, "add what a round left out to the next round's input")
    indices: str = option("compact", "index wire encoding: the smallest of the compact codes, "
                                     "or plain int32 (cheaper to encode)",
                          choices=INDEX_CODINGS)


@dataclass(frozen=True)
class TopKAllGatherOptions(GatheredRobustOptions, SparseOptions, tag="tkag"):
    """Options of ``topk-allgather``: each peer holds all P sets, so it may aggregate them
    robustly (a set's missing entries are zeros of that peer's vector)."""

    examples = SparseOptions.examples + ({"density": 0.3, "robust": "median"},)


@dataclass(frozen=True)
class GTopKOptions(SparseOptions, tag="gtopk", kinds=("up", "down")):
    """Options of ``gtopk``."""

    examples = SparseOptions.examples + ({"density": 0.3, "residual_mode": "reference"},)

    residual_mode: str = option("conserve", "what a merge drops: kept in the merging peer's "
                                            "residual (conserve), or the paper's rule "
                                            "(reference: loses mass for P >= 3)",
                                choices=RESIDUAL_MODES)


@dataclass(frozen=True)
class SparDLOptions(SparseOptions, tag="spardl", kinds=("rs", "ag")):
    """Options of ``spardl``."""

