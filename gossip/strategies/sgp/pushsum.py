"""Push-sum (SGP): each peer keeps a numerator x and a weight w and trains the de-biased
model z = x / w. A step pushes the share 1/(d_out + 1) of (x, w) to each out-neighbour of
that step, keeps one share, and adds what its in-neighbours pushed. The mix is only column
stochastic, so it works on directed and time-varying graphs: sum x and sum w never change,
and z reaches the average of the numerators.

The peers' models are z: the optimizer steps z (the numerator moves by w times the step,
which is the step itself where w stays 1, e.g. on the one-peer exponential schedule), and
``synchronize`` turns the stepped z back into x = z * w before pushing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from gossip.errors import PeerGone, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.sgp.options import SGPOptions
from gossip.topology.directed import push_graph
from gossip.transport import Message

log = logging.getLogger("gossip.strategies")


class PushSum(Strategy):
    """One push-sum step per round; with ``overlap`` tau, a message is mixed in the first
    step it has arrived by, and at the latest tau steps after it was sent (every message is
    mixed exactly once, so mass is conserved all the same)."""

    options_class = SGPOptions
    operates_on = "params"

    def __init__(self, *, rank, topology, transport, options: SGPOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.tag = self.options.tag
        self.graph = push_graph(self.options.schedule, topology, self.options.edges)
        self.weight = 1.0
        self.awaited: dict[int, set[int]] = {}  # round -> senders not yet mixed
        self.gone: set[int] = set()  # dead senders: their pushes never come
        transport.connect(self.graph.partners(rank))  # so a sender dying at once is noticed

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        targets = self.graph.out_neighbors(self.rank, round)
        share = 1.0 / (len(targets) + 1)
        pushed = torch.mul(flat, self.weight * share)  # our numerator's share, x = z * w
        message = Message(kind=self.tag, round=round, meta={"n": flat.numel(),
                                                           "w": self.weight * share},
                          buffers=(pushed,))
        for j in targets:
            self.transport.send(j, message)
        numerator = pushed.clone()  # ``pushed`` may still be read by the sockets
        senders = set(self.graph.in_neighbors(self.rank, round)) - self.gone
        if senders:
            self.awaited[round] = senders
        weight = self.weight * share + self._receive(numerator, round)
        self.weight = weight
        torch.div(numerator, weight, out=dest)
        return dest.view_as(x)

    def _receive(self, numerator: torch.Tensor, round: int) -> float:
        """Add the pushes due by ``round`` into ``numerator`` in a fixed order (round,
        sender); returns the weight they carried."""
        tau = self.options.overlap
        self.transport.at_round(round)
        if tau:
            self.transport.inbox.drain()
        added = 0.0
        for r in sorted(self.awaited):
            must = r <= round - tau
            for i in sorted(self.awaited[r]):
                if must:
                    try:
                        msg = self.transport.recv(src=i, kind=self.tag, round=r)
                    except PeerGone as exc:
                        if exc.rank != i:
                            raise
                        self._lose(i, r)
                        continue
                else:
                    msg = self.transport.inbox.take(i, self.tag, r)
                    if msg is None:
                        continue
                numerator.add_(self._expect(msg, numerator.numel()))
                added += self._weight_of(msg)
                self.awaited[r].discard(i)
            if not self.awaited[r]:
                del self.awaited[r]
        return added

    def finish(self) -> None:
        """Take the pushes of the last ``overlap`` steps that were still due: they are not
        mixed (the model has left this strategy's hands), but their senders must not wait
        for a goodbye from a peer that never heard from them."""
        late = 0
        for r in sorted(self.awaited):
            for i in sorted(self.awaited[r] - self.gone):
                try:
                    self.transport.recv(src=i, kind=self.tag, round=r)
                    late += 1
                except PeerGone:
                    pass
        self.awaited.clear()
        if late:
            log.info("rank %d: %d push(es) of the last %d step(s) arrived after this peer's "
                     "last step and were not mixed", self.rank, late, self.options.overlap)

    def _weight_of(self, msg: Message) -> float:
        w = msg.meta.get("w")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                or w <= 0:
            raise ProtocolError(f"rank {self.rank}: peer {msg.src} pushed {msg.kind} round "
                                f"{msg.round} with weight {w!r}, expected a positive number")
        return float(w)

    def _lose(self, i: int, round: int) -> None:
        self.gone.add(i)
        for senders in self.awaited.values():
            senders.discard(i)
        log.warning("rank %d: peer %d is dead; its pushes from round %d on are lost (push-sum "
                    "goes on with the mass that is left)", self.rank, i, round)

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weight = float(state.get("weight", 1.0))
