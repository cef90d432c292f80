"""Waiting on a live peer, and the deadlocks that would make such a wait endless.

A lockstep receive (``Transport.recv`` with ``src`` and the default timeout) keeps waiting as
long as the peer it waits for is alive: that peer computes (a longer local period, a slower
machine, an epoch longer than ``--timeout``), or waits in turn for one that computes. It gives
up only on a deadlock, a cycle of peers each waiting for the next, which no heartbeat reveals.

Deadlocks are found by edge chasing (Chandy, Misra and Haas, 1983): a peer whose wait outlasts
its timeout sends a probe to the peer it waits for; a peer that is itself waiting passes it on
to the peer *it* waits for; a probe that comes back to the peer that sent it, still in the same
wait, proves a cycle. A computing peer reads nothing, so a chain that ends at one never closes.

A probe is passed on only if nothing can still end the forwarder's wait: every message this
peer sent to the forwarder had been read there when it forwarded (``heard``, counted per pair).
Then, by induction along the cycle, no member can be woken by another: the probe's arrival back
home proves the deadlock, even with messages and probes overtaking each other between pairs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gossip.errors import ProtocolError
from gossip.transport.message import Message

PROBE = "wait.probe"


class Waits:
    """This peer's side of deadlock detection: what it waits for, and the per-peer counts of
    algorithm messages sent and read that tell a stale probe from a live one.

    Args:
        rank: This peer's rank.
        send: Sends a message to a rank (the transport's ``send``).
    """

    def __init__(self, rank: int, send: Callable[[int, Message], object]):
        self.rank, self._send = rank, send
        self.on: int | None = None  # the peer this one is blocked on, if one
        self.wait = 0  # which blocked wait this is: a probe names the wait it was sent in
        self.sent: Counter[int] = Counter()  # algorithm messages sent, per peer
        self.heard: Counter[int] = Counter()  # algorithm messages read, per peer
        self.cycle: list[int] | None = None  # the ranks of a deadlock this wait is in
        self.probes = 0  # sent in this wait

    def begin(self, src: int) -> None:
        """This peer now waits for a message from ``src`` only."""
        self.wait += 1
        self.on, self.cycle, self.probes = src, None, 0

    def end(self) -> None:
        self.on = None

    def probe(self) -> bool:
        """Ask whether the wait on ``self.on`` is part of a cycle (called as it outlasts the
        timeout, and again after each further timeout: a probe dropped as stale is renewed).
        True for the first probe of this wait."""
        self._pass(self.rank, self.wait, [self.rank])
        self.probes += 1
        return self.probes == 1

    def handle(self, msg: Message) -> None:
        """A probe arrived: drop it, pass it on, or (ours, back home) record the cycle."""
        initiator, wait, path = msg.meta["initiator"], msg.meta["wait"], msg.meta["path"]
        if self.on is None or self.sent[msg.src] != msg.meta["heard"]:
            return  # this peer can still make progress, or may have woken the forwarder
        if initiator == self.rank:
            if wait == self.wait:
                self.cycle = path
        elif self.rank not in path:  # else a cycle without its initiator: its members see it
            self._pass(initiator, wait, path + [self.rank])

    def _pass(self, initiator: int, wait: int, path: list[int]) -> None:
        dst = self.on
        self._send(dst, Message(kind=PROBE, round=-1, meta={
            "initiator": initiator, "wait": wait, "path": path, "heard": self.heard[dst]}))


def validate_probe(msg: Message, size: int | None) -> None:
    """Raise ProtocolError unless ``msg`` is a well-formed probe (any peer may send bytes)."""
    meta = msg.meta
    fields = ("initiator", "wait", "heard")
    if (not all(type(meta.get(f)) is int and meta[f] >= 0 for f in fields)
            or not isinstance(meta.get("path"), list)
            or not all(type(r) is int and r >= 0 for r in meta["path"])
            or (size is not None and (len(meta["path"]) > size or meta["initiator"] >= size))):
        raise ProtocolError(f"malformed {PROBE} message from peer {msg.src}: {dict(meta)}")


def describe_cycle(rank: int, path: list[int], describe: Callable[[int], str]) -> str:
    """``path`` (this peer first, each waiting for the next, the last for this peer) in words."""
    ring = [*path, rank]
    return ", ".join(f"{describe(a) if a != rank else 'this peer'} waits for "
                     f"{describe(b) if b != rank else 'this peer'}"
                     for a, b in zip(ring, ring[1:]))
