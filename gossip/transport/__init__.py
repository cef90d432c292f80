"""Point-to-point message transports (ZeroMQ TCP, in-process loopback)."""

from gossip.transport.base import Transport
from gossip.transport.loopback import LoopbackHub, LoopbackTransport
from gossip.transport.message import Message
from gossip.transport.stats import TransportStats
from gossip.transport.zmq import ZmqTransport

__all__ = ["LoopbackHub", "LoopbackTransport", "Message", "Transport", "TransportStats",
           "ZmqTransport"]
