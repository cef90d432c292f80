"""Point-to-point message transports (ZeroMQ TCP, in-process loopback)."""

from gossip.transport.base import Transport, TransportStats
from gossip.transport.loopback import LoopbackHub, LoopbackTransport
from gossip.transport.message import Message
from gossip.transport.zmq import ZmqTransport

__all__ = ["Message", "Transport", "TransportStats", "ZmqTransport", "LoopbackHub",
           "LoopbackTransport"]
