"""Which of a peer's edges MATCHA activates in a round, and the neighbours it dropped.

Every peer computes the same plan (matchings, probabilities, alpha) from the topology and
the same activations from ``(seed, round)``, so no extra messages are needed. Shared by the
exact and the compressed MATCHA.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from gossip.errors import PeerGone, RejoinError
from gossip.topology import matcha
from gossip.transport import Message

log = logging.getLogger("gossip.strategies")


class MatchaSchedule:
    """One peer's view of the activation schedule, over its transport.

    An edge to a neighbour the transport declares dead is never active again.
    """

    def __init__(self, *, rank: int, topology, transport, budget: float, seed: int, tag: str):
        self.rank, self.transport, self.tag = rank, transport, tag
        self.plan = matcha.plan(topology, budget)
        self.seed = seed
        self.partners = self.plan.partners(rank)
        self.dropped: dict[int, int] = {}  # dead neighbour -> round it was dropped in
        # At once, so a neighbour dying before its edge is first active is noticed too.
        transport.connect(sorted({q for q in self.partners if q is not None}))

    def round_partners(self, round: int) -> tuple[int, ...]:
        """This peer's partners in ``round``, in matching order (distinct: each edge is in
        exactly one matching)."""
        return tuple(self.partners[j] for j in self.plan.active(round, self.seed)
                     if self.partners[j] is not None and self.partners[j] not in self.dropped)

    def live_partners(self, round: int) -> tuple[int, ...]:
        """``round_partners`` after dropping the neighbours the transport knows are dead."""
        for q in set(self.partners) & self.transport.membership.firsthand():
            self.drop(q, round)
        return self.round_partners(round)

    def drop(self, q: int, round: int) -> None:
        """Take dead neighbour ``q`` out for good: its edge is never active again."""
        if q not in self.dropped:
            self.dropped[q] = round
            log.warning("rank %d: dropped dead neighbour %d in round %d; its edge's weight "
                        "stays on this peer's own value", self.rank, q, round)

    def recv_from(self, q: int, round: int) -> Message | None:
        """``q``'s message of ``round``, or None if ``q`` is found dead meanwhile (dropped)."""
        try:
            return self.transport.recv(src=q, kind=self.tag, round=round)
        except PeerGone as exc:
            if exc.rank != q:
                raise
            self.drop(q, round)
            return None

    def await_sends(self, partners: tuple[int, ...], sent: list, round: int) -> None:
        """Wait until the partners' messages are sent, dropping one found dead meanwhile
        (its message then counted for this round)."""
        for q, delivery in zip(partners, sent):
            if q in self.dropped:  # it will never read it
                continue
            try:
                delivery.wait()
            except PeerGone as exc:
                if exc.rank != q:
                    raise
                self.drop(q, round)

    def load_dropped(self, dropped: Mapping) -> None:
        for q, round in dict(dropped).items():
            self.drop(int(q), int(round))

    def first_waiting_round(self, rounds: Mapping[int, int]) -> int:
        """The earliest round in which a neighbour will wait for us: for each, the first
        round from the one it is at in which our edge is active."""
        firsts = []
        for q in {q for q in self.partners if q is not None} - set(self.dropped):
            if q in rounds:
                # Bounded: an edge whose matching is never drawn never waits for us.
                first = next((k for k in range(rounds[q], rounds[q] + 10_000)
                              if q in self.round_partners(k)), None)
                if first is not None:
                    firsts.append(first)
        if not firsts:
            raise RejoinError(f"rank {self.rank}: no neighbour takes this peer back (they "
                              f"dropped it as dead before it returned: give them a --dead-after "
                              f"longer than a restart)")
        return min(firsts)
