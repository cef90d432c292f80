"""Gradient strategies overlapped with backward: buckets launched as their gradients are
ready (wait-free back-propagation), the step waits for them and steps.

A hook per parameter (``register_post_accumulate_grad_hook``) counts the gradients of its
bucket; once a bucket is complete and every bucket before it was launched, it is launched:
its strategy instance averages its slice of the flat gradient buffer in place on the
communication thread. Strictly in bucket order, so the messages go out in one order on every
rank. ``Peer.step`` launches what backward left (a parameter that got no gradient counts as
zeros), waits, and steps the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossip.errors import ConfigError
from gossip.overlap.buckets import Bucket
from gossip.overlap.flat import FlatGrads
from gossip.overlap.worker import CommThread


class GradientOverlap:
    """Bucketed gradient averaging during backward for one attached model.

    Args:
        params: The model's trainable parameters, in its order.
        grads: The flat gradient buffer of ``params`` (``.grad`` are views into it).
        buckets: The plan (``plan_buckets``).
        strategies: One gradient strategy per bucket, each with its own message kinds.
        thread: The peer's communication thread.
        run: ``run(strategy, x, minibatches, round)`` averages ``x`` in place (the peer
            stages device tensors through host memory).
        current_round: The round the next step synchronizes (the peer's).
    """

    def __init__(self, params: list[torch.Tensor], grads: FlatGrads, buckets: list[Bucket],
                 strategies: list, thread: CommThread, run: Callable,
                 current_round: Callable[[], int]):
        self.params, self.grads, self.buckets = params, grads, buckets
        self.strategies, self.thread, self._run = strategies, thread, run
        self._current_round = current_round
        self._bucket_of = {i: b.index for b in buckets for i in b.indices}
        self.enabled = True  # False inside Peer.no_sync()
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(params)]

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched = 0  # buckets 0.._launched-1 are queued
        self.forwards = 0  # training forward passes since the last step

    def _hook_for(self, i: int):
        bucket = self._bucket_of[i]

        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if bucket < self._launched:  # its buffer is on the wire now
                raise ConfigError("a second backward reached a gradient whose bucket was "
                                  "already sent this step: run all but the last backward "
                                  "of a step inside peer.no_sync()")
            self._ready[bucket] += 1
            while (self._launched < len(self.buckets)
                   and self._ready[self._launched] >= len(self.buckets[self._launched].indices)):
                self._launch(self._launched)
        return hook

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        self.grads.bind(bucket.indices)  # a grad autograd allocated itself is copied in
        x = self.grads.flat[bucket.start:bucket.stop]
        strategy, round, count = self.strategies[index], self._current_round(), self.minibatches
        self._launched = index + 1
        self.thread.submit(lambda: self._run(strategy, x, count, round))

    @property
    def minibatches(self) -> int:
        return max(self.forwards, 1)

    def count_forward(self, module, args) -> None:
        """Forward pre-hook: the mini-batches of this step are the training forwards."""
        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    def finish(self, optimizer: torch.optim.Optimizer, minibatches: int | None) -> None:
        """Launch what is left in order, wait for every bucket, step; ``minibatches``
        (if given) must be the training forwards the buckets were averaged over."""
        counted = self.minibatches
        try:
            for index in range(self._launched, len(self.buckets)):
                self._launch(index)
            self.thread.wait()
        finally:
            self._reset()
        if minibatches is not None and minibatches != counted:
            raise ConfigError(f"step(minibatches={minibatches}), but the attached model ran "
                              f"{counted} training forward passes since the last step (the "
                              f"buckets were averaged over those)")
        optimizer.step()

    def state_dict(self) -> dict:
        return {"buckets": [s.state_dict() for s in self.strategies]}

    def load_state_dict(self, state) -> None:
        for strategy, entry in zip(self.strategies, state["buckets"], strict=True):
            strategy.load_state_dict(entry)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
