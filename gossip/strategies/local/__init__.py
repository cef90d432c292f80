"""Local SGD (periodic averaging), post-local SGD and hierarchical local SGD: ``local``."""

from gossip.strategies.local.options import LocalOptions
from gossip.strategies.local.strategy import Local

__all__ = ["Local", "LocalOptions"]
