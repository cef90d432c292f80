"""``DeviceTrainer``: the training loop on a shared device. The compute phase of each round
(every mini-batch's forward and backward, and the emulated device time slept after each)
holds the device; the synchronized step runs after it is released, while another job may
compute."""

from __future__ import annotations

import dataclasses

from gossip.clock import Clock
from gossip.crossover.base import DeviceLock, Hold
from gossip.records import Record
from gossip.training import Trainer, Work


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
        self._hold: Hold | None = None

    def train_round(self, rnd: int) -> Record:
        start_wall = self.clock.time()
        record = super().train_round(rnd)
        hold = self._hold
        return dataclasses.replace(record, device_wait_s=hold.wait_s,
                                   device_hold_s=hold.hold_s, round_start_wall=start_wall)

    def compute(self, rnd: int) -> Work:
        with self.device.compute(rnd) as hold:
            work = super().compute(rnd)
        self._hold = hold
        return work
