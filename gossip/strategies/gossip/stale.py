"""Stale-synchronous D-PSGD (Ho et al. 2013; decentralized as in Hop, ASPLOS'19): in round
r each neighbour's newest model of rounds r-s..r is mixed (the one mixed last time again,
if nothing newer came); a peer waits only when a neighbour has none, i.e. is more than s
rounds behind.

The mix is no longer doubly stochastic in time (a peer mixes its neighbour's older model
while the neighbour mixes its newer one), so the peers' average is not preserved: it
drifts toward the slow peers, whose older models are counted more often.
"""

from __future__ import annotations

from typing import Any

from gossip.strategies.gossip.dpsgd import DPSGD
from gossip.transport import Message
from gossip.transport.windowed import latest_arrived, recv_latest


class StaleDPSGD(DPSGD):
    """D-PSGD with ``staleness`` s > 0: per neighbour the newest message within s rounds
    (older pending ones dropped, so at most s + 1 rounds of a neighbour are ever kept)."""

    preserves_mean = False

    def __init__(self, *, rank, topology, transport, options=None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.used = (-1, 0)  # (round, the largest staleness mixed in it): the latest only
        self.latest: dict[int, Message] = {}  # neighbour -> its newest message mixed so far

    def _receive(self, j: int, round: int) -> Message:
        first = round - self.options.staleness
        msg = latest_arrived(self.transport, src=j, kind=self.tag, first=first, last=round)
        if msg is None:
            mixed = self.latest.get(j)
            msg = mixed if mixed is not None and mixed.round >= first else recv_latest(
                self.transport, src=j, kind=self.tag, first=first, last=round)
        self.latest[j] = msg
        last, most = self.used
        self.used = (round, max(most if last == round else 0, round - msg.round))
        return msg

    def record_fields(self, round: int) -> dict[str, Any]:
        last, most = self.used
        return {"staleness": most if last == round else 0}
