"""Receives that are not keyed by one round: the newest message in a window of rounds
(bounded staleness) and any message of a kind already here (asynchronous strategies, which
have no rounds). Both go through the transport's own checks, counters and buffer. And
``Silence``, the limit of a wait that serves while it waits (asynchronous strategies,
parameter servers)."""

from __future__ import annotations

from collections.abc import Iterable

from gossip.errors import ProtocolError
from gossip.transport.base import Transport
from gossip.transport.message import Message


def recv_latest(transport: Transport, *, src: int, kind: str, first: int, last: int,
                timeout: float | None = None) -> Message:
    """The newest ``kind`` message from ``src`` of a round in ``[first, last]``; older ones
    of that kind and source are dropped (they can no longer be used), later ones kept.
    Waits only when none has arrived, for the next one ``src`` sends.

    Raises:
        PeerTimeout, PeerGone: as ``Transport.recv``.
        ProtocolError: ``src`` skipped rounds (a later round came before any in the window).
    """
    clock = transport.clock
    deadline = clock.monotonic() + (transport.timeout if timeout is None else timeout)
    while True:
        kept = latest_arrived(transport, src=src, kind=kind, first=first, last=last)
        if kept is not None:
            return kept
        msg = transport.recv(src=src, kind=kind, timeout=max(deadline - clock.monotonic(), 0.0))
        if first <= msg.round <= last:
            return msg
        if msg.round > last:
            raise ProtocolError(f"rank {transport.rank}: peer {src} sent {kind} round "
                                f"{msg.round} before any of rounds {first}..{last}")
        # Older than the window (sent before the ones already used): never usable.


def latest_arrived(transport: Transport, *, src: int, kind: str, first: int,
                   last: int) -> Message | None:
    """``recv_latest`` without the wait: None if no message of the window has arrived."""
    at_round(transport, last)
    drain(transport)  # everything already here, so the newest is seen
    return transport.pending.take_latest(src, kind, first, last)


def at_round(transport: Transport, round: int) -> None:
    """This peer works on ``round`` now (as a ``recv`` of it says): kept messages too far
    behind it expire."""
    if round > transport.membership.round:
        transport.membership.round = round
        transport._expire(round)


def drain(transport: Transport) -> None:
    """Read every message already here into the transport's buffer, without waiting."""
    while transport._pump(0.0):
        pass


def poll(transport: Transport, kind: str, *, src: int | None = None) -> Message | None:
    """A ``kind`` message (from ``src``, if given) that has already arrived, any round,
    oldest first; None at once if there is none. Never waits."""
    while True:
        kept = transport.pending.take(src, kind, None)
        if kept is not None:
            return kept
        frames = transport._recv_frames(0.0)
        if frames is None:
            return None
        msg = transport._accept(frames, want=(src, kind, None))
        if msg is not None:
            return msg


def wait_any(transport: Transport, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for any message and keep it for a later receive;
    False if none came."""
    return transport._pump(timeout)


class Silence:
    """How long a wait has heard nothing from the peers it waits on: no message, and no
    sign of life from the transport's control path (``Transport.alive``). ``over`` once
    that lasted ``transport.timeout`` seconds. A peer that computes for longer (a long local
    period, a slow partner) is alive, so it is waited for; a dead one is declared dead by
    the transport after ``dead_after`` and the caller stops waiting for it."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.heard()

    def heard(self) -> None:
        """A message came: the silence starts again."""
        self.deadline = self.transport.clock.monotonic() + self.transport.timeout

    def over(self, waiting_on: Iterable[int]) -> bool:
        """Whether the wait should give up: none of ``waiting_on`` is alive and nothing was
        heard for ``timeout`` seconds."""
        if any(self.transport.alive(rank) for rank in waiting_on):
            self.heard()
            return False
        return self.transport.clock.monotonic() >= self.deadline

    def left(self) -> float:
        """Seconds until ``over`` (0 when due)."""
        return max(self.deadline - self.transport.clock.monotonic(), 0.0)
