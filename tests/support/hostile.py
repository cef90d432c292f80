"""What can reach a peer over ZeroMQ, to attack it with (docs/ARCHITECTURE.md, Frame floods):

* a *stranger*: anyone may connect a DEALER to a peer's outbox and write into it (the outbox
  takes only hellos, so whatever it writes is rejected there);
* a *neighbour*: a raw ROUTER bound at a rank's endpoint, as that rank's outbox: every peer
  connects its receiving socket for that rank to it, says hello, and reads what it sends.
"""

from __future__ import annotations

import errno
import time

import msgpack
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
        self.endpoint = endpoint
        twin = local_ipc(endpoint)
        if twin:
            self.sock.bind(twin)
        self.routes: dict[int, bytes] = {}  # rank -> routing id of its latest hello

    def _read_hello(self) -> None:
        route, header = self.sock.recv_multipart()[:2]
        self.routes[msgpack.unpackb(header)["src"]] = route

    def wait_hello(self, rank: int, timeout: float = 10.0) -> None:
        """Until ``rank``'s receiving socket has said hello here."""
        deadline = time.monotonic() + timeout
        while rank not in self.routes:
            left = deadline - time.monotonic()
            assert left > 0, f"rank {rank} never connected to the neighbour"
            if self.sock.poll(int(left * 1000)):
                self._read_hello()

    def send(self, rank: int, frames: list, timeout: float = 10.0) -> None:
        """Send ``frames`` to ``rank`` as one message (once it has connected, or connected
        again: a peer's socket reconnects after a frame over its size limit)."""
        self.wait_hello(rank, timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.send_multipart([self.routes[rank], *frames])
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH or time.monotonic() > deadline:
                    raise
            if self.sock.poll(10):
                self._read_hello()

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.close(linger=1000)
        if self._own:
            self.ctx.term()
