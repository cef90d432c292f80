"""Messages that arrived before anyone asked for them, indexed by (kind, round, source).

A receive asks for one kind and round, usually from one source, so it finds its message
without looking at the others: however many messages wait for rounds that never come, a
receive costs the same (a linear scan made 20,000 of them slow every dpsgd round 3-13x).

What is kept is bounded three ways (docs/ARCHITECTURE.md, Hostile input):

* **bytes** and **count**: a message that would exceed either is refused;
* **rounds behind**: a peer works through rounds in order, so a message of a round more than
  ``rounds_behind`` before the latest round this peer asked for can never be claimed. One
  arriving that late is refused; one kept that falls that far behind is dropped (expired).
  Messages of later rounds are kept: a neighbour may legitimately run ahead (an inactive
  MATCHA edge lets it, a STOP comes from any peer).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from gossip.transport.message import Message

DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_MAX_MESSAGES = 100_000
# Strategies look back at most this many rounds (nonblocking drains STOPs 3 rounds back).
DEFAULT_ROUNDS_BEHIND = 16

_Entry = tuple[int, Message, int]  # (arrival number, message, bytes)


class PendingMessages:
    """The unclaimed-message buffer of one transport.

    Args:
        max_bytes: Most bytes kept at once.
        max_messages: Most messages kept at once.
        rounds_behind: Messages of rounds further behind the current round are not kept.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_messages: int = DEFAULT_MAX_MESSAGES,
                 rounds_behind: int = DEFAULT_ROUNDS_BEHIND):
        self.max_bytes, self.max_messages = max_bytes, max_messages
        self.rounds_behind = rounds_behind
        self.bytes = 0
        self._count = 0
        self._arrivals = 0
        self._queues: dict[tuple[str, int, int], deque[_Entry]] = {}  # (kind, round, src)
        self._sources: dict[tuple[str, int], set[int]] = {}  # (kind, round) -> src with some
        self._by_round: dict[int, set[tuple[str, int, int]]] = {}  # round -> its queues
        self._rounds: list[int] = []  # heap of the rounds in _by_round
        self._floor = None  # messages of rounds below this are not kept

    def __len__(self) -> int:
        return self._count

    def refusal(self, msg: Message, size: int) -> str | None:
        """Why ``msg`` (of ``size`` bytes) cannot be kept, or None if it can."""
        if self._floor is not None and msg.round < self._floor:
            return (f"{msg.kind} round {msg.round} from peer {msg.src} is more than "
                    f"{self.rounds_behind} rounds behind this peer (round "
                    f"{self._floor + self.rounds_behind}): it can never be claimed")
        if self.bytes + size > self.max_bytes or self._count >= self.max_messages:
            return (f"{msg.kind} round {msg.round} from peer {msg.src}: unclaimed-message "
                    f"buffer full ({self._count} messages, {self.bytes} bytes)")
        return None

    def keep(self, msg: Message, size: int) -> None:
        """Keep ``msg``; the caller checked ``refusal`` first."""
        key = (msg.kind, msg.round, msg.src)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._sources.setdefault(key[:2], set()).add(msg.src)
            if msg.round not in self._by_round:
                self._by_round[msg.round] = set()
                heapq.heappush(self._rounds, msg.round)
            self._by_round[msg.round].add(key)
        self._arrivals += 1
        queue.append((self._arrivals, msg, size))
        self._count += 1
        self.bytes += size

    def take(self, src: int | None, kind: str | None, round: int | None) -> Message | None:
        """Remove and return the oldest kept message matching every given field."""
        if kind is None or round is None:  # not asked by any strategy: scan
            found = min(((queue[0][0], key) for key, queue in self._queues.items()
                         if _matches(key, src, kind, round)), default=None)
            return None if found is None else self._pop(found[1])
        if src is not None:
            key = (kind, round, src)
            return self._pop(key) if key in self._queues else None
        sources = self._sources.get((kind, round))
        if not sources:
            return None
        oldest = min(sources, key=lambda s: self._queues[(kind, round, s)][0][0])
        return self._pop((kind, round, oldest))

    def take_latest(self, src: int, kind: str, first: int, last: int) -> Message | None:
        """Remove and return the newest kept ``kind`` message from ``src`` of a round in
        ``[first, last]`` (bounded staleness), dropping every older one of that kind and
        source, which can no longer be used; None (older ones dropped) if there is none."""
        rounds = [r for (k, r, s) in self._queues if k == kind and s == src and r <= last]
        usable = [r for r in rounds if r >= first]
        newest = max(usable, default=None)
        for r in rounds:
            if newest is None or r < newest:
                self._drop_queue((kind, r, src))
        if newest is None:
            return None
        queue = self._queues[(kind, newest, src)]
        while len(queue) > 1:  # a duplicate of the same round: keep the newest
            self._pop((kind, newest, src))
        return self._pop((kind, newest, src))

    def advance(self, round: int) -> list[Message]:
        """This peer now works on ``round``: drop what fell ``rounds_behind`` behind it;
        returns the dropped messages."""
        floor = round - self.rounds_behind
        if self._floor is not None and floor <= self._floor:
            return []
        self._floor = floor
        return self._drop_before(floor)

    def discard_before(self, round: int) -> int:
        """Drop every message of a round before ``round``; returns how many."""
        return len(self._drop_before(round))

    def _drop_before(self, round: int) -> list[Message]:
        dropped = []
        while self._rounds and self._rounds[0] < round:
            dropped += self._drop_round(heapq.heappop(self._rounds))
        return dropped

    def __iter__(self) -> Iterator[Message]:
        """The kept messages, oldest first."""
        entries = sorted((entry for queue in self._queues.values() for entry in queue),
                         key=lambda entry: entry[0])
        return (msg for _, msg, _ in entries)

    def _pop(self, key: tuple[str, int, int]) -> Message:
        queue = self._queues[key]
        _, msg, size = queue.popleft()
        self._count -= 1
        self.bytes -= size
        if not queue:
            self._forget(key)
        return msg

    def _drop_round(self, round: int) -> list[Message]:
        dropped = []
        for key in self._by_round.pop(round, ()):
            queue = self._queues.pop(key)
            dropped += [msg for _, msg, _ in queue]
            self._count -= len(queue)
            self.bytes -= sum(size for _, _, size in queue)
            self._unindex(key)
        return dropped

    def _drop_queue(self, key: tuple[str, int, int]) -> None:
        queue = self._queues[key]
        while queue:
            self._pop(key)

    def _forget(self, key: tuple[str, int, int]) -> None:
        del self._queues[key]
        self._unindex(key)
        # An emptied round stays until the floor passes it: its heap entry is still there.
        self._by_round[key[1]].discard(key)

    def _unindex(self, key: tuple[str, int, int]) -> None:
        kind, round, src = key
        sources = self._sources[(kind, round)]
        sources.discard(src)
        if not sources:
            del self._sources[(kind, round)]


def _matches(key: tuple[str, int, int], src: int | None, kind: str | None,
             round: int | None) -> bool:
    k, r, s = key
    return ((src is None or s == src) and (kind is None or k == kind)
            and (round is None or r == round))
