"""Synchronization strategies, built by name from STRATEGIES."""

from gossip.strategies import allreduce, dpsgd  # noqa: F401  (registers them)
from gossip.strategies import gtopk, spardl, topk_allgather  # noqa: F401  (registers them)
from gossip.strategies import matcha  # noqa: F401  (registers it)
from gossip.strategies import nonblocking  # noqa: F401  (registers it)
from gossip.strategies.base import STRATEGIES, Strategy, create_strategy

__all__ = ["STRATEGIES", "Strategy", "create_strategy"]
