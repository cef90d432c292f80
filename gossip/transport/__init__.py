"""Point-to-point message transports (ZeroMQ TCP, in-process loopback)."""

from gossip.transport.base import TIMEOUT_S, Transport
from gossip.transport.loopback import LoopbackHub, LoopbackTransport
from gossip.transport.message import Message
from gossip.transport.stats import TransportStats
from gossip.transport.zmq import DEAD_AFTER_S, ZmqTransport

__all__ = ["DEAD_AFTER_S", "TIMEOUT_S", "LoopbackHub", "LoopbackTransport", "Message",
           "Transport", "TransportStats", "ZmqTransport"]
