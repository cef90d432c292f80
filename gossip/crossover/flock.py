"""The baseline without an arbiter: the device is an ``fcntl.flock`` on a file (the kernel
releases it when its process dies). ``FlockDevice`` holds it for the whole compute phase
(first come, first served, no turns); ``SlicedDevice`` only for each slice of emulated
device time, as a GPU time-slices jobs that run at once with no coordination (naive
co-location)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from gossip.clock import REAL_TIME, Clock
from gossip.crossover.base import DeviceLock, Hold
from gossip.crossover.grants import GrantLog
from gossip.crossover.rotation import Grant
from gossip.errors import ConfigError, PeerTimeout

POLL_S = 0.001  # how often a waiter tries the lock again


class FlockDevice(DeviceLock):
    """The device ``device`` as the lock file ``DIR/device-DEVICE.lock``; the holder writes
    who it is into the file, so a waiter that times out can name it.

    Args:
        directory: Where the lock files are (every job sharing the device must use the
            same one).
        grant_log: Each grant is appended here as it is released.
    """

    def __init__(self, directory: str | Path, device: str, job: str, rank: int, *,
                 timeout: float = 60.0, clock: Clock = REAL_TIME,
                 grant_log: str | Path | None = None):
        super().__init__(device, job, rank, timeout=timeout, clock=clock)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"device-{device}.lock"
        self.log = GrantLog(grant_log)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._grant: Grant | None = None

    def acquire(self, round: int) -> None:
        clock = self.clock
        t_request, deadline = clock.time(), clock.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock.monotonic() >= deadline:
                    raise PeerTimeout(f"device {self.device} ({self.path}): job {self.job} "
                                      f"rank {self.rank} waited {self.timeout:g} s for round "
                                      f"{round}; held by {self._holder()}") from None
                clock.sleep(POLL_S)
        os.pwrite(self._fd, f"job {self.job} rank {self.rank} (round {round})\n".ljust(80)
                  .encode(), 0)
        self._grant = Grant(self.device, self.job, self.rank, round, t_request, clock.time())

    def release(self, round: int) -> None:
        # The release time read before the unlock: logged grants never overlap (they did
        # by 0.1 ms when it was read after).
        grant, self._grant, t_release = self._grant, None, self.clock.time()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        if grant is not None:
            self.log.write(Grant(**{**grant.__dict__, "t_release": t_release}))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the lock too, if held
            self._fd = -1

    def _holder(self) -> str:
        return os.pread(self._fd, 80, 0).decode(errors="replace").strip() or "another process"


class SlicedDevice(FlockDevice):
    """Naive co-location: the compute phase takes no lock; its emulated device time is
    slept in ``slice_s`` slices, each under the lock, so jobs computing at once share the
    device slice by slice. The phase's hold is the sum of its slices."""

    def __init__(self, directory: str | Path, device: str, job: str, rank: int, *,
                 slice_s: float = 0.01, **kwargs):
        super().__init__(directory, device, job, rank, **kwargs)
        if not slice_s > 0:
            raise ConfigError(f"slice_s must be > 0, got {slice_s}")
        self.slice_s = slice_s
        self._hold: Hold | None = None
        self._round = 0

    @contextlib.contextmanager
    def compute(self, round: int) -> Iterator[Hold]:
        self._hold, self._round = Hold(round, self.clock.time()), round
        try:
            yield self._hold
        finally:
            self._hold = None

    def sleep(self, seconds: float) -> None:
        clock, hold = self.clock, self._hold
        while seconds > 0:
            piece = min(self.slice_s, seconds)
            start = clock.monotonic()
            self.acquire(self._round)
            granted = clock.monotonic()
            clock.sleep(piece)
            self.release(self._round)
            if hold is not None:
                hold.wait_s += granted - start
                hold.hold_s += clock.monotonic() - granted
            seconds -= piece
            clock.sleep(POLL_S)  # let a waiting job in before taking the next slice
