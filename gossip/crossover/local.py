"""The in-process arbiter: jobs running as threads of one process (tests, notebooks) share
devices through one ``LocalArbiter``."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

from gossip.crossover.base import DeviceLock
from gossip.crossover.grants import GrantLog
from gossip.crossover.rotation import Request, Rotation, check_limits
from gossip.errors import PeerTimeout

log = logging.getLogger("gossip.crossover")


class LocalArbiter:
    """Every device's rotation, behind one condition variable. Real time only: waits are
    condition waits.

    Args:
        patience_s: See ``Rotation`` (inf: strict alternation, 0: first come first served).
        max_hold_s: A grant held longer is revoked (logged) and its job leaves the rotation.
        grant_log: The JSONL file of grants (None: none).
    """

    def __init__(self, *, patience_s: float = math.inf, max_hold_s: float = math.inf,
                 grant_log: str | Path | None = None):
        check_limits(patience_s=patience_s, max_hold_s=max_hold_s)
        self.patience_s, self.max_hold_s = patience_s, max_hold_s
        self.log = GrantLog(grant_log)
        self._cond = threading.Condition()
        self._rotations: dict[str, Rotation] = {}

    def lock(self, device: str, job: str, rank: int, *, timeout: float = 60.0) -> LocalDevice:
        """A rank's handle on ``device``; the job joins its rotation now."""
        with self._cond:
            self._rotation(device).join(str(job), int(rank))
        return LocalDevice(self, device, job, rank, timeout=timeout)

    def _rotation(self, device: str) -> Rotation:
        if device not in self._rotations:
            self._rotations[device] = Rotation(device, patience_s=self.patience_s)
        return self._rotations[device]

    def acquire(self, lock: LocalDevice, round: int) -> None:
        """Wait until ``lock``'s rank holds its device for ``round`` (PeerTimeout after
        ``lock.timeout``)."""
        deadline = time.monotonic() + lock.timeout
        with self._cond:
            rotation = self._rotation(lock.device)
            rotation.request(Request(lock.job, lock.rank, round, time.time()))
            while True:
                now = time.time()
                if self.log.expire(rotation, now, self.max_hold_s) is not None:
                    self._cond.notify_all()  # the revoked holder learns it in its sleep
                if rotation.next_grant(now) is not None:
                    self._cond.notify_all()
                # Whoever's call made the grant: a waiter woken by a release may grant the
                # device to another thread, which must see it here.
                if rotation.holds(lock.job, lock.rank):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    rotation.withdraw(lock.job, lock.rank, now)
                    raise PeerTimeout(f"device {lock.device}: job {lock.job} rank {lock.rank} "
                                      f"waited {lock.timeout:g} s for round {round}; "
                                      f"{rotation.blocking()}")
                wake = min(rotation.wake_at() - now, left)
                if rotation.holder is not None:
                    wake = min(wake, rotation.holder.t_grant + self.max_hold_s - now)
                self._cond.wait(max(wake, 0.001))

    def hold(self, lock: LocalDevice, round: int, seconds: float) -> None:
        """Emulated device time, paused while the grant is revoked: a holder past
        ``max_hold_s`` waits for the device again before the rest."""
        left = seconds
        with self._cond:
            rotation = self._rotation(lock.device)
            while left > 0:
                if not rotation.holds(lock.job, lock.rank):
                    log.warning("device %s: job %s rank %d: grant of round %d revoked (held "
                                "past max_hold_s); waiting for the device again",
                                lock.device, lock.job, lock.rank, round)
                    self.acquire(lock, round)
                    continue
                # Only a waiter revokes (a lone holder keeps the device), and it notifies.
                start = time.monotonic()
                self._cond.wait(left)
                left -= time.monotonic() - start

    def release(self, lock: LocalDevice) -> None:
        """``lock``'s rank is done with its device for this round."""
        with self._cond:
            self.log.write(self._rotation(lock.device).release(lock.job, lock.rank, time.time()))
            self._cond.notify_all()

    def leave(self, lock: LocalDevice) -> None:
        """``lock``'s rank leaves its device's rotation."""
        with self._cond:
            self.log.write(self._rotation(lock.device).leave(lock.job, lock.rank, time.time()))
            self._cond.notify_all()


class LocalDevice(DeviceLock):
    """A handle from ``LocalArbiter.lock``."""

    def __init__(self, arbiter: LocalArbiter, device: str, job: str, rank: int, *,
                 timeout: float = 60.0):
        super().__init__(device, job, rank, timeout=timeout)
        self.arbiter = arbiter
        self._round: int | None = None  # of the grant held

    def acquire(self, round: int) -> None:
        self.arbiter.acquire(self, round)
        self._round = round

    def sleep(self, seconds: float) -> None:
        if self._round is None:  # not in a compute phase: nothing to hold
            time.sleep(seconds)
        else:
            self.arbiter.hold(self, self._round, seconds)

    def release(self, round: int) -> None:
        self._round = None
        self.arbiter.release(self)

    def close(self) -> None:
        self.arbiter.leave(self)
