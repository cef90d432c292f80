"""Synchronization strategies, built by name from STRATEGIES."""

from gossip.strategies import (  # noqa: F401  (registers them)
    allreduce,
    dpsgd,
    gtopk,
    matcha,
    nonblocking,
    spardl,
    topk_allgather,
)
from gossip.strategies.base import STRATEGIES, Strategy, create_strategy

#: The strategy a peer runs when none is named.
DEFAULT = "dpsgd"
#: An exact all-reduce mean over every peer (the consensus probe measures with it).
EXACT_MEAN = "ring-allreduce"

__all__ = ["DEFAULT", "EXACT_MEAN", "STRATEGIES", "Strategy", "create_strategy"]
