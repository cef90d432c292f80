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

__all__ = ["STRATEGIES", "Strategy", "create_strategy"]
