"""Time as the transport, membership, fault injection and training loop see it.

Every time read and sleep on those paths goes through the transport's ``Clock``, so a
transport that runs peers in virtual time (a simulator, a test) can run the same code: its
clock advances when a peer sleeps or waits instead of the peer waiting.
"""

from __future__ import annotations

import time


class Clock:
    """Real time: ``time.perf_counter`` for durations and deadlines, ``time.time`` for wall
    timestamps, ``time.sleep`` to wait.

    Attributes:
        virtual: Sleeping advances this clock without waiting (a transport then gives up a
            receive that finds nothing by advancing the clock to its deadline).
    """

    virtual = False

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, durations)."""
        return time.perf_counter()

    def time(self) -> float:
        """Seconds since the Unix epoch (record timestamps)."""
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class ManualClock(Clock):
    """Virtual time that moves only when someone sleeps on it or calls ``advance``.

    Args:
        start: The initial ``monotonic()`` reading.
        epoch: ``time()`` at ``monotonic() == start``.
    """

    virtual = True

    def __init__(self, start: float = 0.0, *, epoch: float = 1.7e9):
        self._now = float(start)
        self._epoch = epoch - start

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._epoch + self._now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


#: The clock of every transport that is given none.
REAL_TIME = Clock()
