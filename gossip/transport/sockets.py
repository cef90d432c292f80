"""The ZeroMQ sockets of a ZmqTransport, as it sets them up: queue depths, kernel buffers,
size limit, heartbeats, IPv6 and CURVE."""

from __future__ import annotations

import logging

import zmq

from gossip.keys import CurveKeys
from gossip.transport import codec
from gossip.transport.auth import DOMAIN
from gossip.transport.router import routing_id

log = logging.getLogger("gossip.transport")

# Queue depth, in messages, of each peer's queue in an outbox and of each receiving socket.
# It bounds the count of messages a strategy may have in flight to one peer (reaching it makes
# send wait, then raise PeerTimeout), not memory: a receiving socket may hold up to HWM
# messages of up to max_message_bytes before the application reads them
# (docs/ARCHITECTURE.md).
HWM = 10_000
# A CURVE message frame carries its payload plus "\x07MESSAGE", an 8-byte nonce, a 16-byte MAC
# and a flags byte, and ZMQ_MAXMSGSIZE applies to that frame (measured with libzmq 4.3.5).
CURVE_FRAME_OVERHEAD = 33
# Kernel socket buffers: the 208 KiB default splits every large frame into many writes, each
# waking the receiver's I/O thread. 0 keeps the OS default. Capped by net.core.[rw]mem_max.
SOCKET_BUFFER_BYTES = 4 << 20
# ZMTP heartbeats on our connections: a ping every HEARTBEAT_S, the connection dropped when
# nothing answers within half the peer timeout, and never sooner than HEARTBEAT_MIN_S.
# Generous on purpose: a ping queues behind a large message, and a false alarm would drop a
# connection with messages on it.
HEARTBEAT_S = 1.0
HEARTBEAT_MIN_S = 5.0


def outbox_socket(context: zmq.Context, *, max_frame: int, timeout: float,
                  keys: CurveKeys | None, ipv6: bool = False) -> zmq.Socket:
    """A peer's outbox (router.py), not yet bound: a ROUTER every other peer's receiving
    socket connects to. A send waits at most ``timeout`` seconds for room in a connected
    peer's queue; with ``keys`` a CURVE server whose clients the context's ZAP handler
    (auth.py) must let in; ``ipv6`` to bind an IPv6 address."""
    sock = context.socket(zmq.ROUTER)
    # libzmq refuses IPv6 addresses unless asked ("No such device"); asked, it would also
    # turn an IPv4 one into an IPv4-mapped IPv6 one (::ffff:a.b.c.d), so only when needed.
    sock.setsockopt(zmq.IPV6, int(ipv6))
    sock.setsockopt(zmq.LINGER, 0)
    # EHOSTUNREACH for a peer not connected (router.py queues), not a silent drop.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A restarted peer's receiving socket takes its rank's routing id over at once.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    # Only hellos come in; the limit still refuses a stranger's huge frame before allocating.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES or -1)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    # Frames under ZERO_COPY_MIN_BYTES are handed over as arrays: pyzmq copies what is
    # below this (its default today, set here so the sender may change them at once anyway).
    sock.copy_threshold = codec.ZERO_COPY_MIN_BYTES
    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey = keys.secret.encode("ascii")
        sock.zap_domain = DOMAIN
        # Without this, libzmq lets every CURVE client in if the ZAP handler is gone.
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (AttributeError, zmq.ZMQError):  # libzmq < 4.3: the handler must not fail
            log.warning("rank %d: this libzmq cannot enforce ZAP (ZMQ_ZAP_ENFORCE_DOMAIN)",
                        keys.rank)
    return sock


def inbound_socket(context: zmq.Context, rank: int, src: int, *, max_frame: int,
                   timeout: float, keys: CurveKeys | None, ipv6: bool = False) -> zmq.Socket:
    """``rank``'s receiving socket for the messages of ``src``, not yet connected to its
    outbox: a DEALER whose routing id is ``rank``'s and fresh (router.py); with ``keys`` a CURVE client that only
    talks to ``src``'s key; ``ipv6`` to connect to an IPv6 address."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IPV6, int(ipv6))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id(rank))
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    # Refused by libzmq before it allocates; the header check also sees multi-frame totals.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES or -1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(max(timeout / 2, HEARTBEAT_MIN_S) * 1000))
    if keys is not None:
        sock.curve_serverkey = keys.peers[src].encode("ascii")
        sock.curve_publickey = keys.public.encode("ascii")
        sock.curve_secretkey = keys.secret.encode("ascii")
    return sock


class Tracker:
    """A zero-copy frame's tracker as ``Delivery`` waits for it."""

    def __init__(self, tracker: zmq.MessageTracker):
        self._tracker = tracker

    def wait(self, timeout: float) -> bool:
        """True once libzmq no longer reads the frame; False after ``timeout`` seconds."""
        try:
            self._tracker.wait(timeout)
            return True
        except zmq.NotDone:
            return False
