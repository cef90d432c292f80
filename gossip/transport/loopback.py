"""In-process transport for fast unit tests: same codec and matching, queues instead of sockets."""

from __future__ import annotations

import queue

from gossip.errors import TransportError
from gossip.transport.base import Transport


class LoopbackHub:
    """The shared 'network' of a group of LoopbackTransports in one process."""

    def __init__(self, size: int):
        self.queues = [queue.SimpleQueue() for _ in range(size)]

    def transport(self, rank: int, **kwargs) -> LoopbackTransport:
        return LoopbackTransport(rank, self, **kwargs)


class LoopbackTransport(Transport):
    """Messages are encoded and copied exactly as on a socket, then queued for the receiver."""

    def __init__(self, rank: int, hub: LoopbackHub, **kwargs):
        super().__init__(rank, size=len(hub.queues), **kwargs)
        self.hub = hub
        self.closed = False

    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False,
                     received=()) -> list:
        if self.closed:
            raise TransportError(f"rank {self.rank}: transport is closed")
        if not 0 <= dst < len(self.hub.queues):
            raise TransportError(f"rank {self.rank}: no peer {dst}")
        # bytearray: a private, writable copy, as a socket would deliver; being a copy, the
        # sender's tensors are free at once, so there is nothing to track.
        self.hub.queues[dst].put([header] + [bytearray(f.numpy()) for f in frames])
        return []

    def _recv_frames(self, timeout: float) -> list | None:
        inbox = self.hub.queues[self.rank]
        try:
            if not self.clock.virtual:
                return inbox.get(timeout=timeout)
            return inbox.get_nowait()
        except queue.Empty:
            self.clock.sleep(timeout if self.clock.virtual else 0.0)  # waited in virtual time
            return None

    def close(self, linger: float = 0.0) -> None:
        self.closed = True
