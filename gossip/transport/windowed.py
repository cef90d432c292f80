"""Receives that are not keyed by one round: the newest message in a window of rounds
(bounded staleness), through the transport's own checks, counters and inbox. And ``Silence``,
the limit of a wait that serves while it waits (asynchronous strategies, parameter servers).
The asynchronous strategies, which have no rounds, take the messages of a kind already here
from the inbox (``Transport.inbox.take_arrived``)."""

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
    transport.at_round(last)
    return transport.inbox.take_latest(src, kind, first, last)


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
