"""Parameter (gossip) strategies overlapped with forward and backward: combine-then-adapt.

At the round's first training forward the parameters are snapshotted (s = x_t) and their
mixing is queued on the communication thread; forward and backward run meanwhile at x_t.
The step lets the optimizer step locally (x' = x_t - lr d_t), waits for m = W s, and sets
x_{t+1} = m + (x' - s) = W x_t - lr d_t, the form of Lian et al.'s D-PSGD analysis (the
blocking path is adapt-then-combine, W (x_t - lr d_t); both converge). Momentum stays local.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossip.overlap.flat import FlatParams
from gossip.overlap.worker import CommThread


class CombineThenAdapt:
    """Mix the round's snapshot in the background for one attached model.

    Args:
        params: The model's flat parameters (``.data`` are views into ``params.flat``).
        strategy: The peer's parameter strategy.
        thread: The peer's communication thread.
        run: ``run(strategy, x, out, round)`` writes the mix of ``x`` into ``out`` (the peer
            stages device tensors through host memory).
        current_round: The round the next step synchronizes (the peer's).
    """

    buckets = 1

    def __init__(self, params: FlatParams, strategy, thread: CommThread, run: Callable,
                 current_round: Callable[[], int]):
        self.params, self.strategy, self.thread = params, strategy, thread
        self._run, self._current_round = run, current_round
        self.snapshot = torch.empty_like(params.flat)
        self.mixed = torch.empty_like(params.flat)
        self.enabled = True  # no_sync() changes nothing here: the mix starts once per round
        self._started = False
        self.forwards = 0  # training forward passes since the last step

    def start(self) -> None:
        """Snapshot the parameters and queue their mixing (once per round)."""
        if self._started:
            return
        self._started = True
        with torch.no_grad():
            self.snapshot.copy_(self.params.bind())
        snapshot, mixed, round = self.snapshot, self.mixed, self._current_round()
        self.thread.submit(lambda: self._run(self.strategy, snapshot, mixed, round))

    def count_forward(self, module, args) -> None:
        """Forward pre-hook: the round's first training forward starts the mix."""
        if module.training and torch.is_grad_enabled():
            self.forwards += 1
            self.start()

    def finish(self, optimizer: torch.optim.Optimizer, minibatches: int | None) -> None:
        """Step locally (unless this peer finished no mini-batch), wait, add the step to
        the mixed snapshot. ``.grad`` is the sum over ``minibatches`` (default: the
        training forwards since the last step)."""
        self.start()  # a round without a training forward mixes now, without overlap
        if minibatches is None:
            minibatches = max(self.forwards, 1)
        try:
            if minibatches != 0:
                if minibatches != 1:
                    with torch.no_grad():
                        for p in self.params.layout.params:
                            if p.grad is not None:
                                p.grad.mul_(1.0 / minibatches)
                optimizer.step()
            self.thread.wait()
        finally:
            self._started, self.forwards = False, 0
        with torch.no_grad():
            self.params.bind().sub_(self.snapshot).add_(self.mixed)

    def state_dict(self) -> dict:
        return {"buckets": [self.strategy.state_dict()]}

    def load_state_dict(self, state) -> None:
        (entry,) = state["buckets"]
        self.strategy.load_state_dict(entry)

    def detach(self) -> None:
        pass
