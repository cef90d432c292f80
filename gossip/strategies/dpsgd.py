"""D-PSGD gossip: x_i <- sum_j W_ij x_j with Metropolis-Hastings weights of the topology.

With a compressor, the round is CHOCO-Gossip instead (choco.py): sparsified or quantized
models are exchanged as compressed differences, so the peers still reach consensus.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from gossip.compress import Compressor
from gossip.errors import ConfigError, PeerGone, RejoinError
from gossip.strategies.base import STRATEGIES, MixingGossip, Strategy
from gossip.strategies.choco import ChocoGossip, check_choco_compressor
from gossip.transport import Message

log = logging.getLogger("gossip.strategies")


@STRATEGIES.register("dpsgd")
def dpsgd(*, rank, topology, transport, tag: str = "gossip", compressor: Compressor | None = None,
          gamma: float | None = None) -> Strategy:
    """Exact D-PSGD, or CHOCO-Gossip with consensus step ``gamma`` when given a compressor."""
    if compressor is None:
        if gamma is not None:
            raise ConfigError("gamma is CHOCO's consensus step: it needs a compressor")
        return DPSGD(rank=rank, topology=topology, transport=transport, tag=tag)
    check_choco_compressor(compressor)
    return ChocoGossip(rank=rank, topology=topology, transport=transport, compressor=compressor,
                       gamma=gamma, tag=tag)


class DPSGD(MixingGossip):
    """One exact gossip round with every neighbour of the (static) graph.

    A neighbour the transport declares dead is dropped for good and its weight W_ij moves
    onto our own W_ii. Each survivor does this for its own row alone, with no agreement
    needed, and the matrix stays symmetric and doubly stochastic on the survivors, so they
    still average to consensus. Re-running Metropolis-Hastings on the smaller graph would
    change the weights of peers two hops away too, which all would have to switch in the
    same round: an agreement protocol for no gain in what they converge to.
    """

    def __init__(self, *, rank, topology, transport, tag: str = "gossip"):
        super().__init__(rank=rank, topology=topology, transport=transport, tag=tag)
        self.dropped: dict[int, int] = {}  # dead neighbour -> round it was dropped in
        transport.connect(self.neighbors)  # so a neighbour dying at once is noticed too

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        dead = self.transport.membership.firsthand()
        for j in self.neighbors:
            if j in dead:
                self.drop(j, round)
        msg = Message(kind=self.tag, round=round, meta={"n": flat.numel()}, buffers=(flat,))
        sent = {j: self.transport.send(j, msg, track=True) for j in self.neighbors}
        # Our own value is still being read by the sockets: accumulate apart, unless out is new.
        acc = dest if out is None else torch.empty_like(flat)
        torch.mul(flat, self.self_weight, out=acc)
        # Fixed neighbour order keeps the floating-point sum deterministic; early arrivals wait
        # in the transport's buffer meanwhile. (drop() rebinds self.neighbors, not this tuple.)
        for j in self.neighbors:
            try:
                reply = self.transport.recv(src=j, kind=self.tag, round=round)
            except PeerGone as exc:
                if exc.rank != j:
                    raise
                acc.add_(flat, alpha=self.drop(j, round))  # its weight is ours from now on
                continue
            acc.add_(self._expect(reply, flat.numel()), alpha=self.weights[j])
        for j, delivery in sent.items():
            if j in self.dropped:  # it will never read it
                continue
            try:
                delivery.wait()
            except PeerGone as exc:  # died after its message came: mixed in this round
                if exc.rank != j:
                    raise
                self.drop(j, round)
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)

    def drop(self, j: int, round: int) -> float:
        """Take dead neighbour ``j`` out for good; returns its weight, now part of ours."""
        weight = self.weights.pop(j)
        self.self_weight += weight
        self.neighbors = tuple(n for n in self.neighbors if n != j)
        self.dropped[j] = round
        log.warning("rank %d: dropped dead neighbour %d in round %d; its weight %.4g moves to "
                    "this peer's own (now %.4g)", self.rank, j, round, weight, self.self_weight)
        return weight

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for j, round in dict(state.get("dropped", {})).items():
            if int(j) in self.weights:
                self.drop(int(j), int(round))

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        """The earliest round a neighbour is at: it waits for our message of that round (its
        neighbours ahead re-send what we missed; our duplicates for them are ignored)."""
        at = [rounds[j] for j in self.neighbors if j in rounds]
        if not at:
            raise RejoinError(f"rank {self.rank}: no neighbour takes this peer back (they "
                              f"dropped it as dead before it returned: give them a --dead-after "
                              f"longer than a restart)")
        return min(at)
