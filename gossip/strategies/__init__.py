"""Synchronization strategies, built by name from STRATEGIES; one subpackage per family."""

from gossip.strategies import gossip, matcha, nonblocking, ring, sgp, sparse  # noqa: F401 (register)
from gossip.strategies.base import DEFAULT, EXACT_MEAN, STRATEGIES, Strategy
from gossip.strategies.options import Options, option

__all__ = ["DEFAULT", "EXACT_MEAN", "STRATEGIES", "Options", "Strategy", "option"]
