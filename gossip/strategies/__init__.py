"""Synchronization strategies, built by name from STRATEGIES; one subpackage per family."""

from gossip.strategies import (  # noqa: F401 (register)
    adpsgd, dpsgd, local, matcha, nonblocking, ps, ring, sgp, sparse)
from gossip.options import Options, TaggedOptions, option
from gossip.strategies.base import DEFAULT, EXACT_MEAN, STRATEGIES, Strategy

__all__ = ["DEFAULT", "EXACT_MEAN", "STRATEGIES", "Options", "Strategy", "TaggedOptions", "option"]
