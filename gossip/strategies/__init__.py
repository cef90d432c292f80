"""Synchronization strategies, built by name from STRATEGIES."""

from gossip.strategies import allreduce, dpsgd  # noqa: F401  (registers them)
from gossip.strategies.base import STRATEGIES, Strategy, create_strategy

__all__ = ["STRATEGIES", "Strategy", "create_strategy"]
