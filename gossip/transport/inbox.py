"""The inbox of one transport: the messages kept until someone asks for them (pending.py) and
the reading of the next ones off the wire, each decoded and checked by the transport that owns
the inbox. ``Transport.recv`` waits for one matching message; the windowed receives, the
asynchronous strategies and leaving use these operations.

Verbs, as across gossip/transport: ``take`` removes and returns a message already here (kept,
or arrived and not yet read) and never waits; ``wait`` blocks, up to a timeout, for the next
message; ``keep`` stores one for a later receive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from gossip.transport.message import Message
from gossip.transport.pending import PendingMessages
from gossip.transport.stats import TransportStats

log = logging.getLogger("gossip.transport")


class Inbox:
    """What has reached this peer and what is still on the wire.

    Args:
        rank: The owner's rank (for log lines).
        pending: The kept messages.
        stats: The owner's counters (expired messages).
        receive: ``receive(timeout)``: the next received frames, or None after ``timeout``
            seconds.
        accept: ``accept(frames, want=, keep=)``: decode, check and handle them; the message
            if it matches ``want``, else None (kept for later with ``keep``).
    """

    def __init__(self, rank: int, pending: PendingMessages, stats: TransportStats, *,
                 receive: Callable[[float], list | None],
                 accept: Callable[..., Message | None]):
        self.rank = rank
        self.pending = pending
        self.stats = stats
        self._receive = receive
        self._accept = accept

    def __len__(self) -> int:
        return len(self.pending)

    def __iter__(self) -> Iterator[Message]:
        """The kept messages, oldest first."""
        return iter(self.pending)

    def take(self, src: int | None = None, kind: str | None = None,
             round: int | None = None) -> Message | None:
        """Remove and return the oldest kept message matching every given field; None if
        there is none. Reads nothing off the wire."""
        return self.pending.take(src, kind, round)

    def put_back(self, msg: Message) -> None:
        """Keep ``msg``, taken from here, for a later receive again (an attacker reads the
        round's messages before its strategy does: gossip/attacks/sender.py)."""
        self.pending.keep(msg, sum(b.numel() * b.element_size() for b in msg.buffers))

    def take_latest(self, src: int, kind: str, first: int, last: int) -> Message | None:
        """The newest ``kind`` message from ``src`` of a round in ``[first, last]`` among
        those here (read off the wire first), older ones of that kind and source dropped."""
        self.drain()
        return self.pending.take_latest(src, kind, first, last)

    def take_arrived(self, kind: str, *, src: int | None = None) -> Message | None:
        """The oldest ``kind`` message (from ``src``, if given) of any round that has
        arrived, kept or still unread; None at once if there is none. Never waits."""
        while True:
            kept = self.pending.take(src, kind, None)
            if kept is not None:
                return kept
            frames = self._receive(0.0)
            if frames is None:
                return None
            msg = self._accept(frames, want=(src, kind, None))
            if msg is not None:
                return msg

    def wait(self, timeout: float, *, keep: bool = True) -> bool:
        """Wait up to ``timeout`` seconds for the next message and handle it, keeping it for
        a later receive (with ``keep``) unless the transport handles it itself; False if
        none came."""
        frames = self._receive(timeout)
        if frames is None:
            return False
        self._accept(frames, keep=keep)
        return True

    def drain(self) -> None:
        """Read every message already here, without waiting."""
        while self.wait(0.0):
            pass

    def expire(self, round: int) -> None:
        """This peer works on ``round`` now: drop kept messages that fell too many rounds
        behind it (they can never be claimed)."""
        dropped = self.pending.advance(round)
        if dropped:
            self.stats.messages_expired += len(dropped)
            log.info("rank %d: dropped %d unclaimed message(s) of rounds before %d, never asked "
                     "for (e.g. duplicates re-sent to a restarted peer): %s", self.rank,
                     len(dropped), round - self.pending.rounds_behind,
                     ", ".join(sorted({f"{m.kind} from peer {m.src}" for m in dropped})))
