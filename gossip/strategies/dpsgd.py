"""D-PSGD gossip: x_i <- sum_j W_ij x_j with Metropolis-Hastings weights of the topology.

With a compressor, the round is CHOCO-Gossip instead (choco.py): sparsified or quantized
models are exchanged as compressed differences, so the peers still reach consensus.
"""

from __future__ import annotations

import torch

from gossip.compress import Compressor, ErrorFeedback, MomentumCorrection
from gossip.compress.wrappers import Clip, Wrapper
from gossip.errors import ConfigError
from gossip.strategies.base import STRATEGIES, MixingGossip, Strategy
from gossip.strategies.choco import ChocoGossip
from gossip.transport import Message


@STRATEGIES.register("dpsgd")
def dpsgd(*, rank, topology, transport, tag: str = "gossip", compressor: Compressor | None = None,
          gamma: float | None = None) -> Strategy:
    """Exact D-PSGD, or CHOCO-Gossip with consensus step ``gamma`` when given a compressor."""
    if compressor is None:
        if gamma is not None:
            raise ConfigError("gamma is CHOCO's consensus step: it needs a compressor")
        return DPSGD(rank=rank, topology=topology, transport=transport, tag=tag)
    _reject_gradient_wrappers(compressor)
    return ChocoGossip(rank=rank, topology=topology, transport=transport, compressor=compressor,
                       gamma=gamma, tag=tag)


def _reject_gradient_wrappers(compressor: Compressor) -> None:
    """CHOCO compresses model differences; gradient-only wrappers would corrupt them."""
    layer = compressor
    while isinstance(layer, Wrapper):
        if isinstance(layer, (ErrorFeedback, MomentumCorrection)):
            raise ConfigError("dpsgd with a compressor runs CHOCO, whose public copies already "
                              "feed back what compression drops: drop error_feedback/momentum")
        if isinstance(layer, Clip):
            raise ConfigError("clip_norm clips gradients; dpsgd compresses model differences")
        layer = layer.inner


class DPSGD(MixingGossip):
    """One exact gossip round with every neighbour of the (static) graph."""

    def __init__(self, *, rank, topology, transport, tag: str = "gossip"):
        super().__init__(rank=rank, topology=topology, transport=transport, tag=tag)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        msg = Message(kind=self.tag, round=round, meta={"n": flat.numel()}, buffers=(flat,))
        sent = [self.transport.send(j, msg, track=True) for j in self.neighbors]
        # Our own value is still being read by the sockets: accumulate apart, unless out is new.
        acc = dest if out is None else torch.empty_like(flat)
        torch.mul(flat, self.self_weight, out=acc)
        # Fixed neighbour order keeps the floating-point sum deterministic; early arrivals wait
        # in the transport's buffer meanwhile.
        for j in self.neighbors:
            reply = self.transport.recv(src=j, kind=self.tag, round=round)
            acc.add_(self._expect(reply, flat.numel()), alpha=self.weights[j])
        for delivery in sent:
            delivery.wait()
        if acc is not dest:
            dest.copy_(acc)
        return dest.view_as(x)
