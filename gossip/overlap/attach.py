"""``Peer.attach``: overlap a model's synchronization with its computation, the kind chosen
by the strategy's capabilities (gradients: buckets during backward; parameters:
combine-then-adapt), on one communication thread per peer."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gossip.errors import ConfigError
from gossip.matrix import feature
from gossip.overlap.buckets import DEFAULT_FIRST_BUCKET_MB, check_caps, describe, plan_buckets
from gossip.overlap.combine import CombineThenAdapt
from gossip.overlap.flat import FlatGrads, FlatLayout, FlatParams
from gossip.overlap.gradients import GradientOverlap
from gossip.overlap.worker import CommThread
from gossip.same_start import check_same_start, needs_check
from gossip.strategies.base import bucket_tag

log = logging.getLogger("gossip.overlap")


def refusal(capabilities: dict[str, Any]) -> str | None:
    """Why a strategy with these capabilities cannot be overlapped (None: it can): the
    compatibility matrix's overlap cell (gossip/matrix.py)."""
    return feature("overlap").needs(capabilities)


class Overlap:
    """The overlap of one attached model: its mode, hooks and the peer's thread; the peer's
    stepper while the model is attached (gossip/stepping.py's ``Stepper``)."""

    def __init__(self, peer, model: torch.nn.Module, *, bucket_mb: float,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB):
        check_caps(bucket_mb, first_bucket_mb)
        strategy = peer.strategy
        self.rank = peer.rank
        why = refusal({key: getattr(strategy, key, None) for key in
                       ("stops_rounds_early", "plans_rounds", "synchronous")})
        if why:
            raise ConfigError(f"overlap: strategy {type(strategy).__name__}: {why}")
        params = [p for p in model.parameters() if p.requires_grad]
        if strategy.operates_on == "params" and any(b.is_floating_point()
                                                    for b in model.buffers()):
            raise ConfigError("overlap: the model has floating-point buffers (e.g. BatchNorm "
                              "running statistics), which combine-then-adapt would not mix "
                              "with the parameters: train it without overlap")
        if needs_check(peer):  # before anything else is sent
            with peer.communicating():
                check_same_start(peer, params)
        try:
            layout = FlatLayout(params)
        except ValueError as exc:
            raise ConfigError(f"overlap: the model's trainable parameters: {exc}") from None
        self.thread = CommThread(peer.clock, timeout=peer.timeout)
        current = lambda: peer.round  # noqa: E731
        try:
            if strategy.operates_on == "grads":
                buckets = plan_buckets([p.numel() for p in params], params[0].element_size(),
                                       bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
                strategies = [strategy] + [peer.add_strategy(_retagged(peer.builder, b.index))
                                           for b in buckets[1:]]
                for one, bucket in zip(strategies, buckets):
                    one.use_layout([params[i].shape for i in sorted(bucket.indices)])
                if peer.send_delay:  # an emulated slow sender is slow in every bucket
                    peer.transport.delay_sends(peer.send_delay,
                                               [k for s in strategies for k in s.kinds])
                self.mode = GradientOverlap(params, FlatGrads(layout), buckets, strategies,
                                            self.thread, functools.partial(_average, peer),
                                            current)
                self.buckets = len(buckets)
                log.info("rank %d: overlap: %s", peer.rank,
                         describe(buckets, params[0].element_size()))
            else:
                self.mode = CombineThenAdapt(FlatParams(layout), strategy, self.thread,
                                             functools.partial(_mix, peer), current)
                self.buckets = 1
        except BaseException:
            self.thread.close(timeout=1.0)
            raise
        self.model = model
        self._pre_hook = model.register_forward_pre_hook(self.mode.count_forward)

    @property
    def busy(self) -> bool:
        return self.thread.busy

    def attach(self, model: torch.nn.Module, *, bucket_mb: float,
               first_bucket_mb: float) -> Overlap:
        raise ConfigError(f"rank {self.rank}: a model is already attached to this peer")

    def stop_requested(self, round: int) -> bool:
        return False  # overlapped strategies never stop rounds early

    def computed_all(self, round: int) -> None:
        pass  # nothing to tell: the rounds are the thread's

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside launches nothing (mini-batches accumulating into one step)."""
        before, self.mode.enabled = self.mode.enabled, False
        try:
            yield
        finally:
            self.mode.enabled = before

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             minibatches: int | None) -> None:
        if model is not self.model:
            raise ConfigError("peer.step got another model than the one attached")
        self.mode.finish(optimizer, minibatches)

    def state_dict(self) -> dict[str, Any]:
        """The strategies' state, one entry per bucket."""
        return self.mode.state_dict()

    def load_state_dict(self, state) -> None:
        try:
            self.mode.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"overlap: strategy state of another bucket plan: {exc}") from None

    def metrics(self) -> dict[str, Any]:
        """This round's overlap metrics (reset by the call)."""
        return {"exposed_comm_s": self.thread.take_waited(),
                "comm_busy_s": self.thread.take_busy(), "buckets": self.buckets}

    def close(self, timeout: float | None = None) -> None:
        self._pre_hook.remove()
        self.mode.detach()
        self.thread.close(timeout)


def _retagged(spec, index: int):
    """The peer's strategy spec for bucket ``index``: the same options under its own tag
    (its own message kinds and state)."""
    if spec.tag is None:
        raise ConfigError("overlap with several buckets builds one strategy per bucket: give "
                          "the peer a registered strategy name or class (one with a 'tag' "
                          "option), or bucket_mb=inf for one bucket")
    return spec.retagged(bucket_tag(spec.tag, index))


def _average(peer, strategy, x: torch.Tensor, minibatches: int, round: int) -> None:
    peer.on_host(x, lambda h, out: strategy.average_gradients(h, minibatches, round, out=out),
                  out=x)


def _mix(peer, strategy, snapshot: torch.Tensor, mixed: torch.Tensor, round: int) -> None:
    peer.on_host(snapshot, lambda h, out: strategy.synchronize(h, round, out=out), out=mixed)
