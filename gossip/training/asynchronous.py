"""The training loop of an asynchronous strategy (``synchronous = False``, e.g. adpsgd):
no global round. It wraps a ``Trainer`` (training.py) and reuses its phases, changing what
lockstep assumes:

* each peer runs to its own budget and nobody waits for it: ``config.rounds`` steps, or
  fewer once it has trained on ``budget_samples`` samples or for ``budget_seconds``;
* the model's parameters are views into one flat tensor that the strategy mixes in place,
  so exchanges that arrive between mini-batches (``poll``) move the model itself;
* a step is the optimizer's, then ``synchronize`` on that tensor (start an exchange, apply
  what arrived); it never waits for a round;
* no consensus probe: it is an all-reduce keyed by round, a hidden barrier that peers with
  different budgets would never all reach (records carry ``consensus: null``); peers save
  model snapshots on wall-clock ticks instead, and the consensus is computed from them
  afterwards (gossip.training.snapshots);
* at the end ``finish`` completes this peer's exchange and serves the neighbours until they
  are done too, so peers that stop at different times all exit cleanly.
"""

from __future__ import annotations

import torch

from gossip.errors import ConfigError
from gossip.training.records import Record
from gossip.training.snapshots import SnapshotWriter


class AsyncRunner:
    """Runs a ``Trainer``'s rounds without lockstep; see the module docstring.

    Args:
        trainer: A Trainer on an open peer whose strategy is not synchronous.
    """

    def __init__(self, trainer):
        if trainer.config.checkpoint_every:
            raise ConfigError("checkpoint_every: an asynchronous strategy has no round its "
                              "peers could rejoin at, so it is not checkpointed (use 0)")
        self.trainer = trainer
        self.peer, self.strategy = trainer.peer, trainer.peer.strategy
        self.flat = _share_one_tensor(trainer.model)
        user_hook = trainer.on_minibatch

        def between_minibatches(round: int, done: int) -> None:
            with self.peer.communicating():
                self.strategy.poll()
            if user_hook is not None:
                user_hook(round, done)

        trainer.on_minibatch = between_minibatches
        period = trainer.config.snapshot_seconds
        self.snapshots = (SnapshotWriter(trainer.metrics.path.parent / "snapshots",
                                         self.peer.rank, period)
                          if period and trainer.metrics is not None else None)

    def run(self) -> Record | None:
        """Train this peer's rounds, then finish its exchanges; returns the last record."""
        trainer = self.trainer
        trainer.started = trainer.clock.monotonic()
        record, samples, membership = None, 0, self.peer.transport.membership
        for round in range(trainer.first_round, trainer.config.rounds):
            if self.spent(samples):
                break
            # Its messages carry no round: a neighbour lost from now on is dated by this step.
            membership.round = max(membership.round, round)
            before = self.peer.stats
            work = trainer.compute(round)
            comm_s = self.step(round, work.minibatches)
            if self.snapshots is not None:
                self.snapshots.maybe(self.flat, trainer.clock.time())
            record = trainer.record(round, work, comm_s, before=before, after=self.peer.stats)
            samples += record.samples
            line = record.as_dict()
            if trainer.metrics is not None:
                trainer.metrics.write(line)
            if trainer.on_round is not None:
                trainer.on_round(line)
        with self.peer.communicating():
            self.strategy.finish()
        if self.snapshots is not None:
            self.snapshots.final(self.flat)
        return record

    def spent(self, samples: int) -> bool:
        """Whether this peer's sample or time budget is used up."""
        config, trainer = self.trainer.config, self.trainer
        return bool((config.budget_samples and samples >= config.budget_samples)
                    or (config.budget_seconds and trainer.clock.monotonic() - trainer.started
                        >= config.budget_seconds))

    def step(self, round: int, minibatches: int) -> float:
        """The optimizer's step on the mean gradient of ``minibatches`` mini-batches, then
        the strategy's exchange on the model in place; returns its seconds."""
        clock, optimizer = self.trainer.clock, self.trainer.optimizer
        start = clock.monotonic()
        if minibatches:
            if minibatches != 1:
                with torch.no_grad():
                    for p in self.trainer.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(1.0 / minibatches)
            optimizer.step()
        with torch.no_grad(), self.peer.communicating():
            self.strategy.synchronize(self.flat, round, out=self.flat)
        return clock.monotonic() - start


@torch.no_grad()
def _share_one_tensor(model: torch.nn.Module) -> torch.Tensor:
    """Make every parameter of ``model`` a view into one new flat tensor and return it."""
    params = list(model.parameters())
    if len({p.dtype for p in params}) > 1:
        raise ConfigError("an asynchronous strategy mixes the model as one tensor: its "
                          "parameters must share one dtype")
    flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat
