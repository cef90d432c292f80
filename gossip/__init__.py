"""gossip: decentralized deep learning over ZeroMQ.

Public API: ``Peer``, ``Topology``, ``STRATEGIES``, ``TrainConfig``, ``train`` and the error
family. Attributes load lazily, so the command line starts without importing torch.
"""

from gossip.errors import (
    ConfigError,
    GossipError,
    PeerTimeout,
    ProtocolError,
    TopologyError,
    TransportError,
)

__version__ = "0.1.0"

_LAZY = {
    "Peer": "gossip.peer",
    "Topology": "gossip.topology",
    "STRATEGIES": "gossip.strategies",
    "TrainConfig": "gossip.config",
    "train": "gossip.training",
}

__all__ = ["GossipError", "ConfigError", "TopologyError", "TransportError", "PeerTimeout",
           "ProtocolError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossip' has no attribute {name!r}")
