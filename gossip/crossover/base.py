"""``DeviceLock``: one rank's handle on the device it shares with other jobs. The compute
phase of a round runs inside ``with lock.compute(round) as hold:``; emulated device time is
slept with ``lock.sleep`` inside it (the lock is the device)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from gossip.clock import REAL_TIME, Clock


@dataclass
class Hold:
    """What one compute phase cost on the device: seconds waiting for it, seconds holding it
    (filled in as the phase ends)."""

    round: int
    start_wall: float  # Unix time the phase asked for the device
    wait_s: float = 0.0
    hold_s: float = 0.0


class DeviceLock(ABC):
    """Exclusive use of ``device`` by rank ``rank`` of job ``job``; ``close`` (or leaving the
    ``with`` block) takes the job out of the device's rotation.

    Args:
        device: The device's name, the same for every job that shares it.
        job: This job's name; turns go by name order.
        rank: This peer's rank in its job (for the grant log and errors).
        timeout: Seconds to wait for the device before raising PeerTimeout.
        clock: Times waits and holds, sleeps the emulated device time.
    """

    def __init__(self, device: str, job: str, rank: int, *, timeout: float = 60.0,
                 clock: Clock = REAL_TIME):
        self.device, self.job, self.rank = str(device), str(job), int(rank)
        self.timeout, self.clock = timeout, clock

    @contextlib.contextmanager
    def compute(self, round: int) -> Iterator[Hold]:
        """Hold the device for the compute phase of ``round``.

        Raises:
            PeerTimeout: the device stayed busy past ``timeout``; it names the holder.
        """
        hold = Hold(round, self.clock.time())
        start = self.clock.monotonic()
        self.acquire(round)
        granted = self.clock.monotonic()
        hold.wait_s = granted - start
        try:
            yield hold
        finally:
            self.release(round)
            hold.hold_s = self.clock.monotonic() - granted

    def sleep(self, seconds: float) -> None:
        """Emulated device time, slept while holding the device."""
        self.clock.sleep(seconds)

    @abstractmethod
    def acquire(self, round: int) -> None:
        """Wait for the device (PeerTimeout naming the device and holder past ``timeout``)."""

    @abstractmethod
    def release(self, round: int) -> None:
        """Give the device back."""

    def close(self) -> None:
        """Leave the device's rotation (this job is done here)."""

    def __enter__(self) -> DeviceLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
