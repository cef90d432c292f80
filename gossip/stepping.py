"""How ``Peer.step`` runs: a ``Stepper``, one per peer, chosen when the peer opens
(``LocalStep``) and replaced when a model is attached (``gossip.overlap.Overlap``), so the peer
never asks which mode it is in.

``LocalStep``, without a model attached, runs one synchronized optimizer step on the model's
persistent flat buffers. Gradient strategies average the gradients before the optimizer steps;
parameter strategies step locally, then synchronize the parameters (with the float buffers
and, if asked, the momentum: ``ModelVector``). The strategy's ``round_plan`` may vary this per round (local
SGD sends nothing between averages, gradients during a warm-up).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from gossip.model_vector import ModelVector, reset_optimizer_state
from gossip.overlap import FlatGrads, FlatParams, Overlap
from gossip.overlap.flat import FlatCache
from gossip.same_start import check_same_start, needs_check


class Stepper(Protocol):
    """What ``Peer`` asks of the way it steps (docs/ARCHITECTURE.md, Overlap)."""

    @property
    def busy(self) -> bool:
        """Whether a communication thread holds the transport now."""

    def attach(self, model: torch.nn.Module, *, bucket_mb: float,
               first_bucket_mb: float) -> Stepper:
        """The stepper that overlaps ``model``'s synchronization from now on."""

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             minibatches: int | None) -> None:
        """One synchronized optimizer step (``Peer.step``)."""

    def stop_requested(self, round: int) -> bool:
        """Whether to stop computing mini-batches of ``round`` now."""

    def computed_all(self, round: int) -> None:
        """This peer computed every mini-batch of ``round``."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Inside: backward synchronizes nothing."""

    def metrics(self) -> dict[str, Any] | None:
        """Overlap metrics since the last call; None without overlap."""

    def state_dict(self) -> Any:
        """The strategy state a checkpoint keeps."""

    def load_state_dict(self, state: Any) -> None:
        """Restore what ``state_dict`` returned."""

    def close(self, timeout: float | None) -> None:
        """Stop stepping (a communication thread ends, bounded by ``timeout``)."""


class LocalStep:
    """One peer's steps without a model attached; keeps each model's flat parameters or
    gradients across rounds, so a step flattens and allocates nothing. Whether a round goes
    through the flat buffers or ``ModelVector`` is the round's (its plan) and the model's
    (float buffers), so it is decided per step, not here once."""

    busy = False  # everything runs on the caller's thread

    def __init__(self, peer):
        self.peer = peer
        self.flats = FlatCache()
        self.started = False  # the same-start check ran (or was not needed)

    def attach(self, model: torch.nn.Module, *, bucket_mb: float,
               first_bucket_mb: float) -> Overlap:
        return Overlap(self.peer, model, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)

    def stop_requested(self, round: int) -> bool:
        with self.peer.communicating():  # it may read (and check) whatever messages wait
            return self.peer.strategy.stop_requested(round)

    def computed_all(self, round: int) -> None:
        with self.peer.communicating():
            self.peer.strategy.computed_all(round)

    def no_sync(self) -> AbstractContextManager[None]:
        return nullcontext()  # backward synchronizes nothing here anyway

    def metrics(self) -> None:
        return None

    def state_dict(self) -> Any:
        return self.peer.strategy.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.peer.strategy.load_state_dict(state)

    def close(self, timeout: float | None) -> None:
        pass

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             minibatches: int | None) -> None:
        minibatches = 1 if minibatches is None else minibatches
        peer = self.peer
        params = [p for p in model.parameters() if p.requires_grad]
        if not self.started:
            self.started = True
            if needs_check(peer):
                with peer.communicating():
                    check_same_start(peer, params)
        plan = peer.strategy.round_plan(peer.round)
        if plan.operates_on == "grads":
            flat = self.flats.get(model, params, FlatGrads)
            peer.strategy.use_layout([p.shape for p in params])
            with peer.communicating():  # gathering and copying back are ours too
                total = flat.bind()
                flat.store(peer.on_host(total, lambda x, out: peer.strategy.average_gradients(
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
                vector.assign(peer.on_host(vector.flatten(), lambda x, out: (
                    peer.strategy.synchronize_model(x, peer.round,
                                                    parameters=vector.parameters, out=out))))
            else:
                flat = self.flats.get(model, params, FlatParams)
                x = flat.bind()
                flat.store(peer.synchronize(x, peer.round, out=x))
        if plan.optimizer_state == "reset":
            reset_optimizer_state(optimizer)
