"""A peer's outbox: one ROUTER socket every other peer's receiving socket connects to, and
a queue of our own for peers not connected yet.

Each peer binds its endpoint as a ROUTER and connects one DEALER to every other peer's
(zmq.py): the DEALER is its receiving socket for that peer, so a flood from one peer fills
only that peer's socket (drain.py). A DEALER's routing id is its rank and a random part, and it
says hello as soon as it is connected (libzmq queues the hello until then): the outbox sends
to a rank by the routing id of its latest valid hello only. With CURVE keys that hello came
over a connection whose key is that rank's (auth.py), so another member cannot take a
rank's messages over by connecting with its routing id (it cannot know it), even though a
restarted peer's socket takes its old one's place at once (``ROUTER_HANDOVER``). A ROUTER cannot queue for a
peer it has no connection to (with ``ROUTER_MANDATORY`` it says EHOSTUNREACH rather than
dropping the message), and peers start in any order: messages for a peer not connected yet
wait here, in order, and go as soon as it says hello. They
go only while this peer's transport runs (a send, a receive, closing with a linger), so the
first send to a peer that never said hello waits up to FIRST_HELLO_S for it: a peer that
opened its transport just before has connected by then.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import deque
from collections.abc import Callable

import zmq

from gossip.errors import PeerTimeout

log = logging.getLogger("gossip.transport")

# How long the first send to a peer waits for its hello before queueing (once per peer).
FIRST_HELLO_S = 0.5
# Plain ints: combining pyzmq's enum flags per frame costs a Python call each.
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def send_parts(socket: zmq.Socket, parts: list, flags: int = 0) -> None:
    """``socket.send_multipart(parts, copy=False, flags=flags)`` without its per-call type
    checks (the transport makes the parts: bytes, arrays, zmq.Frame) and enum arithmetic.
    A full or unreachable destination raises at the first part, so nothing is sent then."""
    send, more = socket.send, flags | _MORE
    for part in parts[:-1]:
        send(part, more, copy=False)
    send(parts[-1], flags, copy=False)


def routing_id(rank: int) -> bytes:
    """A fresh routing id for a receiving socket of ``rank``: its rank, for the logs, and
    12 random bytes (never a leading zero byte, which libzmq keeps for ids it makes up)."""
    return b"%d-" % rank + os.urandom(12)


class RouterOutbox:
    """Sends through a ROUTER socket, queueing per destination until it is connected.

    Args:
        socket: The bound ROUTER (``ROUTER_MANDATORY``; ``SNDTIMEO``: how long a send waits
            for room in a connected peer's queue).
        max_queued: Messages a destination may have waiting here (the socket's high-water
            mark: the same bound as once it is connected).
        describe: How to name a rank in an error.
        now: The transport's clock (seconds, monotonic).
    """

    def __init__(self, socket: zmq.Socket, *, max_queued: int,
                 describe: Callable[[int], str], now: Callable[[], float]):
        self.socket = socket
        self.max_queued = max_queued
        self._describe = describe
        self._now = now
        self._queued: dict[int, deque] = {}  # destination -> messages (lists of parts)
        self._greeted: set[int] = set()  # peers whose hello came (or that we waited for)
        self._routes: dict[int, bytes] = {}  # rank -> routing id of its latest hello

    def send(self, dst: int, parts: list, *, wait: Callable[[float], None],
             timeout: float) -> None:
        """Send ``parts`` to ``dst`` or queue them behind what waits for it already.
        ``wait(seconds)`` reads incoming messages (a hello may make room) while a full queue
        waits; after ``timeout`` seconds it raises PeerTimeout."""
        queue = self._queued.get(dst)
        if queue is not None:
            self.flush(dst)
            queue = self._queued.get(dst)
        if queue is None:
            if self._send_now(dst, parts, timeout):
                return
            if dst not in self._greeted:
                self._greeted.add(dst)
                deadline = self._now() + FIRST_HELLO_S
                while self._now() < deadline:
                    wait(0.01)
                    if self._send_now(dst, parts, timeout):
                        return
            queue = self._queued.setdefault(dst, deque())
        if len(queue) >= self.max_queued:
            self._wait_for_room(dst, wait, timeout)
            queue = self._queued.setdefault(dst, deque())
        queue.append(parts)

    def _send_now(self, dst: int, parts: list, timeout: float) -> bool:
        """Send ``parts`` to ``dst`` if it is connected (waiting at most ``timeout`` for room
        in its queue); False if it is not."""
        route = self._routes.get(dst)
        if route is None:
            return False
        try:
            send_parts(self.socket, [route, *parts])
            return True
        except zmq.Again:  # connected, and its queue stayed full for SNDTIMEO
            raise PeerTimeout(f"sending to {self._describe(dst)} timed out after "
                              f"{timeout:g} s (is it running?)") from None
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            return False

    def greeted(self, dst: int, route: bytes) -> None:
        """``dst``'s hello came with routing id ``route``: send what waits for it there."""
        self._greeted.add(dst)
        self._routes[dst] = route
        self.flush(dst)

    def _wait_for_room(self, dst: int, wait: Callable[[float], None], timeout: float) -> None:
        deadline = self._now() + timeout
        while len(self._queued.get(dst, ())) >= self.max_queued:
            if self._now() >= deadline:
                raise PeerTimeout(f"sending to {self._describe(dst)} timed out after "
                                  f"{timeout:g} s: {self.max_queued} messages wait for it to "
                                  f"connect (is it running?)")
            wait(0.05)
            self.flush(dst)

    def flush(self, dst: int | None = None) -> None:
        """Send what waits for ``dst`` (every destination if None), in order, as far as the
        socket takes it now."""
        for rank in [dst] if dst is not None else list(self._queued):
            queue, route = self._queued.get(rank), self._routes.get(rank)
            while queue and route is not None:
                try:
                    send_parts(self.socket, [route, *queue[0]], _NOBLOCK)
                except zmq.ZMQError:  # not connected (EHOSTUNREACH), or full (EAGAIN)
                    break
                queue.popleft()
            if queue is not None and not queue:
                del self._queued[rank]

    def waiting(self) -> bool:
        """Whether any message waits for its destination to connect."""
        return bool(self._queued)

    def close(self, linger: float) -> None:
        """Close the socket, giving what it holds at most ``linger`` seconds (what still
        waits here for a peer that never connected is dropped, and logged)."""
        for dst, queue in self._queued.items():
            log.info("%d message(s) for %s dropped at close: it never connected to this "
                     "peer's outbox", len(queue), self._describe(dst))
        self._queued.clear()
        self.socket.close(linger=int(linger * 1000))
