"""``DeviceTrainer``: the training loop on a shared device. A round's device turn holds
every mini-batch's forward and backward (and the emulated device time slept after each)
and, for a parameter strategy, the local optimizer step; the turn ends before any
communication, while another job may compute."""

from __future__ import annotations

import contextlib
import dataclasses

from gossip.clock import Clock
from gossip.crossover.base import DeviceLock, Hold
from gossip.training.records import Record
from gossip.training.synchronous import Trainer, Work


class _DeviceClock(Clock):
    """The peer's clock, whose sleeps are the device's (emulated device time)."""

    def __init__(self, clock: Clock, device: DeviceLock):
        self._clock, self._device = clock, device
        self.virtual = clock.virtual

    def monotonic(self) -> float:
        return self._clock.monotonic()

    def time(self) -> float:
        return self._clock.time()

    def sleep(self, seconds: float) -> None:
        self._device.sleep(seconds)


class DeviceTrainer(Trainer):
    """A ``Trainer`` whose compute phases take turns on ``device`` (a ``DeviceLock`` on the
    peer's clock); its records add ``device_wait_s``, ``device_hold_s`` and
    ``round_start_wall``. Training itself is unchanged: same seed, same model, bitwise."""

    def __init__(self, peer, config, *, device: DeviceLock, **kwargs):
        super().__init__(peer, config, **kwargs)
        self.device = device
        self.clock = _DeviceClock(peer.clock, device)
        self._turn = contextlib.ExitStack()
        self._hold: Hold | None = None
        # A parameter strategy's local step is device work: the turn ends right after it,
        # inside Peer.step, before the exchange (closing a closed turn does nothing).
        self.optimizer.register_step_post_hook(lambda *_: self._turn.close())

    def train_round(self, round: int) -> Record:
        start_wall = self.clock.time()
        try:
            record = super().train_round(round)
        finally:
            self._turn.close()
        hold = self._hold
        return dataclasses.replace(record, device_wait_s=hold.wait_s,
                                   device_hold_s=hold.hold_s, round_start_wall=start_wall)

    def compute(self, round: int) -> Work:
        self._hold = self._turn.enter_context(self.device.compute(round))
        return super().compute(round)

    def synchronize(self, round: int, work: Work) -> float:
        # Gradients are averaged before the step, an attached model's step waits for its
        # communication thread, and a peer that computed nothing takes no step: the turn
        # ends before the step.
        if (self.config.overlap or not work.minibatches
                or self.peer.strategy.round_plan(round).operates_on == "grads"):
            self._turn.close()
        return super().synchronize(round, work)
