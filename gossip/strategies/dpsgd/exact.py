"""D-PSGD gossip: x_i <- sum_j W_ij x_j with Metropolis-Hastings weights of the topology."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gossip.errors import PeerGone, RejoinError
from gossip.strategies.base import Strategy
from gossip.strategies.dpsgd.neighbourhood import Neighbourhood
from gossip.strategies.dpsgd.options import DPSGDOptions
from gossip.strategies.robust import Mixed
from gossip.transport import Message


class DPSGD(Strategy):
    """One exact gossip round with every neighbour of the (static) graph.

    A neighbour the transport declares dead (or, in an elastic run, that left) is dropped
    for good and its weight moves onto our own (see Neighbourhood); an elastic run's views
    rebuild the graph (``regroup``). With a ``robust`` option, the round's models are mixed by
    its aggregator (gossip/strategies/robust.py) instead of the weighted sum.
    """

    options_class = DPSGDOptions
    operates_on = "params"
    preserves_mean = True
    symmetric_exchange = True
    can_rejoin = True
    mixes_on_views = True

    def __init__(self, *, rank, topology, transport, options: DPSGDOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.tag = self.options.tag
        self.mixing = Neighbourhood(topology, rank)
        self.robust = self.options.aggregator_for(topology)
        if self.robust is not None:
            held = self.capabilities_for(self.options)
            self.preserves_mean, self.checks_own_result, self.mixes_on_views = (
                held["preserves_mean"], held["checks_own_result"], held["mixes_on_views"])
        self.robust_stats: Mixed | None = None  # what robust mixing did in the latest round
        transport.connect(self.mixing.neighbors)  # so a neighbour dying at once is noticed

    @classmethod
    def capabilities_for(cls, options: DPSGDOptions) -> dict[str, Any]:
        return options.robust_capabilities(super().capabilities_for(options))

    def regroup(self, slot: int, members, epoch: int) -> None:
        """Mix on the view ``epoch`` of ``members`` (ids) from now on: the graph the
        topology's rule gives them, with Metropolis-Hastings weights (an elastic run)."""
        self.mixing = Neighbourhood(self.topology, self.rank, members)
        self.transport.connect(self.mixing.neighbors)

    @property
    def neighbors(self) -> tuple[int, ...]:
        return self.mixing.neighbors

    @property
    def dropped(self) -> dict[int, int]:
        return self.mixing.dropped

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        mixing = self.mixing
        dead = self.transport.membership.firsthand()
        for j in mixing.neighbors:
            if j in dead:
                mixing.drop(j, round)
        neighbors = mixing.neighbors  # fixed for this round (drop() rebinds the attribute)
        msg = Message(kind=self.tag, round=round, meta={"n": flat.numel()}, buffers=(flat,))
        sent = {j: self.transport.send(j, msg, track=True) for j in neighbors}
        # Our own value is still being read by the sockets: accumulate apart, unless out is new.
        acc = dest if out is None else torch.empty_like(flat)
        robust, received = self.robust, {}  # robust: neighbour -> its model, mixed at the end
        if robust is None:
            torch.mul(flat, mixing.self_weight, out=acc)
        # Fixed neighbour order keeps the floating-point sum deterministic; early arrivals wait
        # in the transport's buffer meanwhile.
        for j in neighbors:
            try:
                reply = self._receive(j, round)
            except PeerGone as exc:
                if exc.rank != j:
                    raise
                weight = mixing.drop(j, round)  # its weight is ours from now on
                if robust is None:
                    acc.add_(flat, alpha=weight)
                continue
            value = self._expect(reply, flat.numel())
            if robust is None:
                acc.add_(value, alpha=mixing.weights[j])
            else:
                received[j] = value
        if robust is not None:  # before the waits below, which may move weights again
            self.robust_stats = robust.mix(flat, list(received.values()),
                                    [mixing.weights[j] for j in received], mixing.self_weight,
                                    out=acc)
        for j, delivery in sent.items():
            if j in mixing.dropped:  # it will never read it
                continue
            try:
                delivery.wait()
            except PeerGone as exc:  # died after its message came: mixed in this round
                if exc.rank != j:
                    raise
                mixing.drop(j, round)
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)

    def _receive(self, j: int, round: int) -> Message:
        """Neighbour ``j``'s model to mix in ``round``: the one of that very round."""
        return self.transport.recv(src=j, kind=self.tag, round=round)

    def record_fields(self, round: int) -> dict[str, Any]:
        return {} if self.robust_stats is None else self.robust_stats.fields()

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.mixing.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for j, round in dict(state.get("dropped", {})).items():
            if int(j) in self.mixing.weights:
                self.mixing.drop(int(j), int(round))

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        """The earliest round a neighbour is at: it waits for our message of that round (its
        neighbours ahead re-send what we missed; our duplicates for them are ignored)."""
        at = [rounds[j] for j in self.mixing.neighbors if j in rounds]
        if not at:
            raise RejoinError(f"rank {self.rank}: no neighbour takes this peer back (they "
                              f"dropped it as dead before it returned: give them a --dead-after "
                              f"longer than a restart)")
        return min(at)
