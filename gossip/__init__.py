"""gossip: decentralized deep learning over ZeroMQ.

Public API: ``Peer``, ``Topology``, ``TrainConfig``, ``train``; to write and register a
strategy of your own, ``Strategy``, ``STRATEGIES``, ``TaggedOptions`` and ``option``; compressors
through ``Compressor`` and ``COMPRESSORS``; and the whole error family. Attributes load lazily,
so the command line starts without importing torch.
"""

from gossip.errors import (
    BenchmarkFailed,
    CheckpointError,
    CollectiveAborted,
    ConfigError,
    GossipError,
    LaunchFailed,
    NetnsError,
    NetnsUnavailable,
    PeerGone,
    PeerNotOpen,
    PeerTimeout,
    ProtocolError,
    RejoinError,
    RendezvousError,
    TopologyError,
    TransportBusy,
    TransportError,
)

__version__ = "0.1.0"

_LAZY = {
    "Peer": "gossip.peer",
    "Topology": "gossip.topology",
    "STRATEGIES": "gossip.strategies",
    "Strategy": "gossip.strategies",
    "Options": "gossip.options",
    "TaggedOptions": "gossip.options",
    "option": "gossip.options",
    "COMPRESSORS": "gossip.compress",
    "Compressor": "gossip.compress",
    "TrainConfig": "gossip.config",
    "train": "gossip.training.synchronous",
    "Clock": "gossip.clock",
    "ManualClock": "gossip.clock",
}

__all__ = ["GossipError", "ConfigError", "TopologyError", "CheckpointError", "PeerNotOpen",
           "TransportError", "PeerTimeout", "PeerGone", "CollectiveAborted", "RejoinError",
           "RendezvousError", "ProtocolError", "TransportBusy", "LaunchFailed", "NetnsError",
           "NetnsUnavailable", "BenchmarkFailed",
           *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossip' has no attribute {name!r}")
