"""Shared memory between peers on one machine: large frames skip the socket.

Over a Unix socket the kernel copies every byte twice (into the socket, out of it into
memory libzmq allocates per message), and on a small machine that is most of a large
all-reduce's CPU. Between peers on the same machine the sender instead copies a large frame
once into a segment of its own that the receiver has mapped, and ZeroMQ carries the header
plus where the bytes are (an *envelope*). The receiver reads and updates them in place:
they are its own memory until it drops them, like any received frame.

This module is the handshake: the sender offers (pid, fd, size, token) of its segment for
the receiver; the receiver maps it, checks that it is a gossip memfd holding the token (the
same memory, not a namesake pid on another host) and belongs to this user (no other could
change frames under it), and accepts; only then do frames go through it. A receiver that
cannot (another user, a hardened /proc) refuses and everything keeps going over the socket.
The segments themselves, their records and the envelope are shm_segments.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from gossip.errors import PeerTimeout, ProtocolError
from gossip.transport.message import Message
from gossip.transport.shm_segments import MIN_FRAME_BYTES, Inbox, Outbox

log = logging.getLogger("gossip.transport")

# The handshake's message kinds, handled by the transport itself.
OFFER, ACCEPT, REFUSE = "shm.offer", "shm.accept", "shm.refuse"
KINDS = frozenset({OFFER, ACCEPT, REFUSE})


def available() -> bool:
    """Whether this platform has the segments: memfd and /proc, i.e. Linux (elsewhere, e.g.
    macOS, every frame goes over the socket)."""
    return hasattr(os, "memfd_create")


def validate(msg: Message) -> None:
    """Raise ProtocolError if a handshake message's meta is malformed."""
    meta = msg.meta
    token = meta.get("token")
    fields = {"token": isinstance(token, str) and len(token) == 32
              and all(c in "0123456789abcdef" for c in token)}
    if msg.kind == OFFER:
        fields.update({name: isinstance(meta.get(name), int)
                       and not isinstance(meta.get(name), bool) for name in ("pid", "fd", "size")})
    elif msg.kind == REFUSE:
        fields["why"] = isinstance(meta.get("why"), str)
    bad = [name for name, ok in fields.items() if not ok]
    if bad:
        raise ProtocolError(f"{msg.kind} from peer {msg.src}: bad meta: "
                            + ", ".join(f"{name}={meta.get(name)!r}" for name in bad))


class SharedMemory:
    """One transport's shared memory with the peers on its machine: its segments to them,
    theirs to it, and the handshake between the two.

    Args:
        rank: The transport's rank, for log lines.
        send: ``send(dst, kind, meta)`` sends a handshake message.
        describe: How to name a rank in log lines.
        enabled: Offer segments and accept offers; False refuses every offer.
        reachable: Whether a rank is on this machine, so that it may be offered a segment.
    """

    def __init__(self, rank: int, send: Callable[[int, str, dict], None],
                 describe: Callable[[int], str], enabled: bool, *,
                 reachable: Callable[[int], bool]):
        self.rank, self._send, self._describe = rank, send, describe
        self.enabled, self._reachable = enabled, reachable
        self._outboxes: dict[int, Outbox | None] = {}  # None: the socket only
        self._inbox = Inbox() if enabled else None

    def outbox(self, dst: int, frames: list) -> Outbox | None:
        """The segment for ``dst`` once it accepted it, else None. The first large frame for
        a peer on this machine offers it one."""
        if dst in self._outboxes:
            return self._outboxes[dst] if self.shares_with(dst) else None
        if not any(f.numel() >= MIN_FRAME_BYTES for f in frames):
            return None
        outbox = None
        if self.enabled and self._reachable(dst):
            try:
                outbox = Outbox()
            except OSError as exc:
                log.info("rank %d: no shared memory for %s (%s)", self.rank,
                         self._describe(dst), exc)
        self._outboxes[dst] = outbox
        if outbox is not None:
            self._send(dst, OFFER, outbox.offer())
        return None

    def shares_with(self, rank: int) -> bool:
        """Whether large frames to ``rank`` go through shared memory now."""
        outbox = self._outboxes.get(rank)
        return outbox is not None and outbox.accepted

    def handle(self, msg: Message) -> None:
        """Answer an offer, or take an answer to ours."""
        if msg.kind == OFFER:
            why = (self._inbox.attach(msg.src, msg.meta) if self._inbox is not None
                   else "shared memory is off here")
            token = msg.meta.get("token")
            try:
                if why is None:
                    self._send(msg.src, ACCEPT, {"token": token})
                else:
                    self._send(msg.src, REFUSE, {"token": token, "why": why})
            except PeerTimeout:
                pass  # it is not reading: it will not send either
            return
        outbox = self._outboxes.get(msg.src)
        if outbox is None or msg.meta.get("token") != outbox.token.hex():
            # An answer to an offer since withdrawn (the peer restarted meanwhile), or to none.
            log.info("rank %d: ignored %s from %s: not about its current segment", self.rank,
                     msg.kind, self._describe(msg.src))
        elif msg.kind == ACCEPT:
            outbox.accepted = True
        else:
            log.info("rank %d: %s cannot map shared memory (%s); large frames to it go over "
                     "the socket", self.rank, self._describe(msg.src), msg.meta.get("why"))
            self._outboxes[msg.src] = None
            outbox.close()

    def restarted(self, rank: int) -> None:
        """``rank`` restarted: records its old process held stay busy for good, so its
        successor gets a fresh segment, offered with the next large frame."""
        outbox = self._outboxes.pop(rank, None)
        if outbox is not None:
            outbox.close()

    def open(self, frames: list) -> list:
        """An envelope's message with its frames mapped in place (see ``Inbox.open``)."""
        if self._inbox is None:
            raise ProtocolError("frames in shared memory, which is off here")
        return self._inbox.open(frames)

    def close(self) -> None:
        for outbox in self._outboxes.values():
            if outbox is not None:
                outbox.close()
        self._outboxes.clear()
        if self._inbox is not None:
            self._inbox.close()
