"""AD-PSGD's options."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.options import TaggedOptions, at_least, option


@dataclass(frozen=True)
class ADPSGDOptions(TaggedOptions, tag="adpsgd", kinds=("req", "rep", "done", "hello")):
    """Options of ``adpsgd``."""

    examples = ({}, {"seed": 4})  # bipartite: the contract's odd rings are not bipartite

    bipartite: bool = option(False, "the paper's split: only one colour of a 2-colouring of "
                                    "the graph starts exchanges, the other answers (the graph "
                                    "must be bipartite)")
    seed: int = option(0, "seeds each peer's choice of partner (with its rank)",
                       check=at_least(0))
