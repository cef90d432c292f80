"""What can reach a peer over ZeroMQ, to attack it with (docs/ARCHITECTURE.md, Frame floods):

* a *stranger*: anyone may connect a DEALER to a peer's outbox and write into it (the outbox
  takes only hellos, so whatever it writes is rejected there);
* a *neighbour*: a raw ROUTER bound at a rank's endpoint, as that rank's outbox: every peer
  connects its receiving socket for that rank to it, says hello, and reads what it sends.
"""

from __future__ import annotations

import time

import zmq

from gossip.transport.endpoints import local_ipc


def stranger_send(endpoint: str, parts: list, *, linger_s: float = 10.0) -> None:
    """Write one multipart message into the outbox at ``endpoint`` as nobody of the
    topology (queued until the peer there binds)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart(parts)
        sock.close(linger=int(linger_s * 1000))
    finally:
        ctx.term()


class Neighbour:
    """A raw outbox bound at ``endpoint`` (and its ipc twin on loopback): sends any frames
    to the peers that connect to it."""

    def __init__(self, endpoint: str, context: zmq.Context | None = None):
        self._own = context is None
        self.ctx = context or zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(endpoint)
        twin = local_ipc(endpoint)
        if twin:
            self.sock.bind(twin)
        self.hellos: set[bytes] = set()  # routing ids of the peers connected

    def wait_hello(self, rank: int, timeout: float = 10.0) -> None:
        """Until ``rank``'s receiving socket has said hello here."""
        rid = str(rank).encode()
        deadline = time.monotonic() + timeout
        while rid not in self.hellos:
            left = deadline - time.monotonic()
            assert left > 0, f"rank {rank} never connected to the neighbour"
            if self.sock.poll(int(left * 1000)):
                self.hellos.add(self.sock.recv_multipart()[0])

    def send(self, rank: int, frames: list) -> None:
        """Send ``frames`` to ``rank`` as one message (once it has connected)."""
        self.wait_hello(rank)
        self.sock.send_multipart([str(rank).encode(), *frames])

    def close(self) -> None:
        self.sock.close(linger=1000)
        if self._own:
            self.ctx.term()
