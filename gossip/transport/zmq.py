"""ZeroMQ TCP transport: one PULL socket bound per peer, one PUSH socket per destination.

PUSH queues messages while a destination is still starting, so peers may start in any
order. Per-pair ordering is FIFO, which the strategies rely on for multi-part exchanges.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from typing import Sequence
from urllib.parse import urlsplit

import zmq

from gossip.errors import PeerTimeout, TransportError
from gossip.transport import codec
from gossip.transport.base import Transport
from gossip.transport.memory import keep_freed_buffers

# Queue depth per socket. Messages are large tensors, so this bounds memory, not the count
# of messages a strategy may have in flight: ring pieces are sized so this is never reached.
HWM = 10_000
# Kernel socket buffers: the 208 KiB default splits every large frame into many writes, each
# waking the receiver's I/O thread. 0 keeps the OS default. Capped by net.core.[rw]mem_max.
SOCKET_BUFFER_BYTES = 4 << 20


class ZmqTransport(Transport):
    """Messages over ZeroMQ TCP between ranks whose endpoints are ``tcp://host:port``.

    Args:
        rank: This peer's rank; it binds ``endpoints[rank]``.
        endpoints: Every rank's endpoint, indexed by rank.
        local_ipc: Reach peers on loopback addresses through a Unix socket (faster).
        **kwargs: See Transport.
    """

    def __init__(self, rank: int, endpoints: Sequence[str], *, local_ipc: bool = True,
                 **kwargs):
        super().__init__(rank, **kwargs)
        self.use_ipc = local_ipc
        if not 0 <= rank < len(endpoints):
            raise TransportError(f"rank {rank} has no endpoint (there are {len(endpoints)})")
        self.endpoints = list(endpoints)
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._push: dict[int, zmq.Socket] = {}
        self._ipc_path: str | None = None
        self._poller = zmq.Poller()

    def open(self) -> "ZmqTransport":
        """Bind this rank's endpoint. Raises TransportError naming the address if it cannot."""
        keep_freed_buffers()  # before the I/O thread starts, so it shares the tuned arena
        self._ctx = zmq.Context(io_threads=1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, HWM)
        self._pull.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._pull.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES or -1)
        self._poller.register(self._pull, zmq.POLLIN)
        endpoint = self.endpoints[self.rank]
        twin = local_ipc(endpoint)
        try:
            self._pull.bind(_bind_address(endpoint))
            # The TCP bind above is the lock on this port, so the ipc path is ours to take.
            if twin:  # bound even if we do not use it: others may
                self._pull.bind(twin)
                self._ipc_path = twin.removeprefix("ipc://")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"rank {self.rank} cannot listen on {endpoint}: {exc}") from None
        return self

    def describe(self, rank: int) -> str:
        where = self.endpoints[rank] if 0 <= rank < len(self.endpoints) else "?"
        return f"peer {rank} ({where})"

    def _socket_to(self, dst: int) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            if self._ctx is None:
                raise TransportError(f"rank {self.rank}: transport is not open")
            if not 0 <= dst < len(self.endpoints):
                raise TransportError(f"rank {self.rank}: no peer {dst} (there are "
                                     f"{len(self.endpoints)})")
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES or -1)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))
            endpoint = self.endpoints[dst]
            sock.connect((self.use_ipc and local_ipc(endpoint)) or endpoint)
            self._push[dst] = sock
        return sock

    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False) -> list:
        parts, trackers = [header], []
        for f in frames:
            array = f.numpy()
            # Zero-copy pays off only for large frames; small ones are cheaper to copy.
            if array.nbytes < codec.ZERO_COPY_MIN_BYTES:
                parts.append(zmq.Frame(array, copy=True))
            else:
                frame = zmq.Frame(array, copy=False, track=track)
                parts.append(frame)
                if track:
                    trackers.append(_Tracker(frame.tracker))
        try:
            self._socket_to(dst).send_multipart(parts, copy=False)
            return trackers
        except zmq.Again:
            raise PeerTimeout(f"rank {self.rank}: sending to {self.describe(dst)} timed out "
                              f"after {self.timeout:g} s (is it running?)") from None

    def _recv_frames(self, timeout: float) -> list | None:
        if self._pull is None:
            raise TransportError(f"rank {self.rank}: transport is not open")
        try:
            return self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        if not self._poller.poll(timeout * 1000):
            return None
        return self._pull.recv_multipart(copy=False)

    def close(self, linger: float = 0.0) -> None:
        # libzmq leaves the ipc socket file behind. Remove it while our TCP bind still guards
        # the path: a successor on the same port may bind it as soon as the port is free.
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
            self._ipc_path = None
        for sock in self._push.values():
            sock.close(linger=int(linger * 1000))
        self._push.clear()
        if self._pull is not None:
            self._poller.unregister(self._pull)
            self._pull.close(linger=0)
            self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self):
        if self._ctx is None:
            self.open()
        return self


class _Tracker:
    def __init__(self, tracker: zmq.MessageTracker):
        self._tracker = tracker

    def wait(self, timeout: float) -> bool:
        try:
            self._tracker.wait(timeout)
            return True
        except zmq.NotDone:
            return False


def local_ipc(endpoint: str) -> str | None:
    """The Unix-socket twin of a loopback TCP endpoint, else None.

    Peers on a loopback address are on this machine, and a Unix socket moves bytes with less
    kernel work than TCP (like MPI's shared-memory path within a node). Both ends derive the
    path from the port alone, so they agree without talking.
    """
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname not in _LOOPBACK:
        return None
    return f"ipc://{tempfile.gettempdir()}/gossip-{parts.port}.sock"


_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _bind_address(endpoint: str) -> str:
    """Bind to the endpoint's IP; a host name binds every interface (it may not resolve here)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return endpoint
    try:
        ipaddress.ip_address(parts.hostname or "")
        return endpoint
    except ValueError:
        return f"{parts.scheme}://*:{parts.port}"
