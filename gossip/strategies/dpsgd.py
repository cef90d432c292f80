"""D-PSGD gossip: x_i <- sum_j W_ij x_j with Metropolis-Hastings weights of the topology."""

from __future__ import annotations

import torch

from gossip.strategies.base import STRATEGIES, Strategy
from gossip.transport import Message


@STRATEGIES.register("dpsgd")
class DPSGD(Strategy):
    """One gossip round with every neighbour of the (static) graph.

    Args:
        tag: Message kind, distinct per instance sharing one transport.
    """

    operates_on = "params"

    def __init__(self, *, rank, topology, transport, tag: str = "gossip"):
        super().__init__(rank=rank, topology=topology, transport=transport)
        self.tag = tag
        weights = topology.mixing_matrix()[rank]
        self.neighbors = topology.neighbors(rank)
        self.self_weight = float(weights[rank])
        self.weights = {j: float(weights[j]) for j in self.neighbors}

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.tag,)

    def synchronize(self, x: torch.Tensor, round: int) -> torch.Tensor:
        flat = x.reshape(-1)
        msg = Message(kind=self.tag, round=round, meta={"n": flat.numel()}, buffers=(flat,))
        sent = [self.transport.send(j, msg, track=True) for j in self.neighbors]
        out = flat * self.self_weight
        # Fixed neighbour order keeps the floating-point sum deterministic; early arrivals wait
        # in the transport's buffer meanwhile.
        for j in self.neighbors:
            reply = self.transport.recv(src=j, kind=self.tag, round=round)
            out.add_(self._expect(reply, flat.numel()), alpha=self.weights[j])
        for delivery in sent:
            delivery.wait()
        return out.view_as(x)
