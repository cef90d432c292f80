"""Stale-synchronous D-PSGD (Ho et al. 2013; decentralized as in Hop, ASPLOS'19): in round
r each neighbour's newest model of rounds r-s..r is mixed (the one mixed last time again,
if nothing newer came); a peer waits only when a neighbour has none, i.e. is more than s
rounds behind.

A neighbour's model of round t < r is mixed as ``x_j(t) + x_i(r) - x_i(t)`` (``compensate``,
the default): its difference to ours when it was sent, applied to where we are now. Mixed
as it is, a late model pulls ours back in time by r - t rounds of progress (with 5
neighbours on an exponential graph, most of the model's weight), which cost D-PSGD's loss
per round more than the waiting it saves (measured on experiments/stragglers.yaml); with
the compensation, peers that agree move on as one whatever the staleness. It keeps this
peer's own sent models of the last s rounds.

The mix is no longer doubly stochastic in time (a peer mixes its neighbour's older model
while the neighbour mixes its newer one), so the peers' average is not preserved: it
drifts toward the slow peers, whose older models are counted more often (much less with
the compensation: the pair's differences are taken at the same round).
"""

from __future__ import annotations

from typing import Any

import torch

from gossip.strategies.dpsgd.exact import DPSGD
from gossip.transport import Message
from gossip.transport.windowed import latest_arrived, recv_latest


class StaleDPSGD(DPSGD):
    """D-PSGD with ``staleness`` s > 0: per neighbour the newest message within s rounds
    (older pending ones dropped, so at most s + 1 rounds of a neighbour are ever kept)."""

    preserves_mean = False
    symmetric_exchange = False  # a neighbour's model may be older
    mixes_on_views = False  # a window of rounds would span two views' graphs

    def __init__(self, *, rank, topology, transport, options=None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.used = (-1, 0)  # (round, the largest staleness mixed in it): the latest only
        self.latest: dict[int, Message] = {}  # neighbour -> its newest message mixed so far
        self.own: dict[int, torch.Tensor] = {}  # round -> the model we sent in it (s + 1)
        self.now = -1

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if self.options.compensate:
            first = round - self.options.staleness
            self.own = {r: v for r, v in self.own.items() if r >= first}
            self.own[round], self.now = x.detach().reshape(-1).clone(), round
        return super().synchronize(x, round, out=out)

    def _expect(self, msg: Message, numel: int) -> torch.Tensor:
        value = super()._expect(msg, numel)
        past = self.own.get(msg.round) if self.options.compensate else None
        if past is None or msg.round == self.now:
            return value
        return value + (self.own[self.now] - past)  # it moved on as we did since

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
