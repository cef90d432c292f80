"""Exact counters of a transport's traffic: bytes and messages each way, by kind, and what
was rejected."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

# by_kind entry of the bytes of rejected messages: their kind is unknown or untrusted.
# Not a valid kind, so it cannot collide with one.
REJECTED = "<rejected>"
_KIND_COUNTERS = ("bytes_sent", "bytes_recv", "messages_sent", "messages_recv")


@dataclass
class TransportStats:
    """Exact counters of what went over the socket (header + frames) and what was rejected.

    ``messages_rejected`` counts dropped messages and refused connections (a failed CURVE
    handshake, a frame libzmq dropped); ``rejections`` keeps the latest reasons.

    ``by_kind`` splits the four traffic counters by message kind; its entries add up to the
    totals (rejected messages' bytes are under ``"<rejected>"``, counted in no ``messages_*``).
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    messages_rejected: int = 0
    messages_expired: int = 0  # kept unclaimed until they fell too many rounds behind
    wait_s: float = 0.0  # time blocked waiting for a message
    rejections: deque = field(default_factory=lambda: deque(maxlen=32))
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def sent(self, kind: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += 1
        counts = self._kind(kind)
        counts["bytes_sent"] += nbytes
        counts["messages_sent"] += 1

    def received(self, kind: str, nbytes: int) -> None:
        """Count an accepted message (its bytes are already in ``bytes_recv``)."""
        self.messages_recv += 1
        counts = self._kind(kind)
        counts["bytes_recv"] += nbytes
        counts["messages_recv"] += 1

    def rejected(self, nbytes: int = 0) -> None:
        """Count a rejected message or refused connection; ``nbytes`` of a dropped message
        (already in ``bytes_recv``) move from no kind to ``"<rejected>"``."""
        self.messages_rejected += 1
        if nbytes:
            self._kind(REJECTED)["bytes_recv"] += nbytes

    def rejected_since(self, count: int) -> str:
        """The rejections since ``messages_rejected`` read ``count``, for an error: a
        neighbour whose messages are all rejected (e.g. a model gone NaN) looks silent."""
        rejected = self.messages_rejected - count
        return (f"; {rejected} message(s) rejected meanwhile, the last: "
                f"{self.rejections[-1]}" if rejected else "")

    def _kind(self, kind: str) -> dict[str, int]:
        counts = self.by_kind.get(kind)
        if counts is None:
            counts = self.by_kind[kind] = dict.fromkeys(_KIND_COUNTERS, 0)
        return counts

    def snapshot(self) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "messages_sent": self.messages_sent,
            "messages_recv": self.messages_recv,
            "messages_rejected": self.messages_rejected,
            "messages_expired": self.messages_expired,
            "wait_s": self.wait_s,
            "by_kind": {kind: dict(counts) for kind, counts in self.by_kind.items()},
        }
