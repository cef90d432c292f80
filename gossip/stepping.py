"""``Peer.step`` without a model attached: one synchronized optimizer step, on the model's
persistent flat buffers.

Gradient strategies average the gradients before the optimizer steps; parameter strategies
step locally, then synchronize the parameters (with the float buffers and, if asked, the
momentum: ``ModelVector``). The strategy's ``round_plan`` may vary this per round (local
SGD sends nothing between averages, gradients during a warm-up).
"""

from __future__ import annotations

import torch

from gossip.model_vector import ModelVector, reset_optimizer_state
from gossip.overlap import FlatGrads, FlatParams
from gossip.overlap.flat import FlatCache


class LocalStep:
    """One peer's steps; keeps each model's flat parameters or gradients across rounds, so
    a step flattens and allocates nothing."""

    def __init__(self, peer):
        self.peer = peer
        self.flats = FlatCache()

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 minibatches: int) -> None:
        peer = self.peer
        params = [p for p in model.parameters() if p.requires_grad]
        plan = peer.strategy.round_plan(peer.round)
        if plan.operates_on == "grads":
            flat = self.flats.get(model, params, FlatGrads)
            with peer.communicating():  # gathering and copying back are ours too
                total = flat.bind()
                flat.store(peer._on_host(total, lambda x, out: peer.strategy.average_gradients(
                    x, minibatches, peer.round, out=out), out=total))
            optimizer.step()
            return
        if minibatches:  # a peer that finished nothing keeps its parameters as they are
            if minibatches != 1:
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(1.0 / minibatches)
            optimizer.step()
        if plan.exchange:
            self._exchange(model, optimizer, params, plan)

    def _exchange(self, model, optimizer, params, plan) -> None:
        """The parameters in place through the flat buffer or, when the model has float
        buffers or the plan averages momentum, everything ``ModelVector`` gathers."""
        peer = self.peer
        average_momentum = plan.optimizer_state == "average"
        with torch.no_grad(), peer.communicating():
            if average_momentum or any(b.is_floating_point() for b in model.buffers()):
                vector = ModelVector(model, optimizer, momentum=average_momentum)
                vector.assign(peer.synchronize(vector.flatten(), peer.round))
            else:
                flat = self.flats.get(model, params, FlatParams)
                x = flat.bind()
                flat.store(peer.synchronize(x, peer.round, out=x))
        if plan.optimizer_state == "reset":
            reset_optimizer_state(optimizer)
