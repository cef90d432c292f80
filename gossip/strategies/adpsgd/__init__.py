"""Asynchronous decentralized parallel SGD: pairwise averaging with a random neighbour, no
rounds (Lian et al., ICML 2018)."""

from gossip.strategies.adpsgd.exchange import ADPSGD
from gossip.strategies.adpsgd.options import ADPSGDOptions
from gossip.strategies.base import STRATEGIES

__all__ = ["ADPSGD", "ADPSGDOptions"]


@STRATEGIES.register("adpsgd", options=ADPSGDOptions)
def adpsgd(options: ADPSGDOptions) -> type:
    """AD-PSGD: asynchronous pairwise averaging with a random neighbour (lock-free
    exchange: equal and opposite moves, so the sum of models changes only by steps)."""
    return ADPSGD
