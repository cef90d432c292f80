"""The communication thread: one per peer, runs queued synchronizations first in, first out,
while the training thread computes.

The transport is single-threaded, so while this thread has work it is the transport's only
user: ``busy`` tells the peer to refuse everything else that would touch it. An error ends
the thread's work (later jobs are dropped, not run) and is raised again, as itself, by the
next ``wait``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from gossip.errors import PeerTimeout

log = logging.getLogger("gossip.overlap")
_STOP = object()


class CommThread:
    """Run ``job()`` callables in order on one background thread.

    Args:
        clock: Times the busy seconds (the transport's clock).
        timeout: Bound of one ``wait`` per job still queued (the transport's own timeouts
            end a job first; this bounds a job that never returns).
        name: The thread's name.
    """

    def __init__(self, clock, *, timeout: float, name: str = "gossip-comm"):
        self.clock, self.timeout = clock, timeout
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.busy_s = 0.0  # seconds spent running jobs since the last take_busy()
        self.waited_s = 0.0  # seconds callers spent in wait() since the last take_waited()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether jobs are queued or running (the transport is the thread's)."""
        with self._idle:
            return self._pending > 0

    def submit(self, job: Callable[[], object]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every submitted job ran; raises a job's error (the first) as itself."""
        start = self.clock.monotonic()
        try:
            self._wait()
        finally:
            self.waited_s += self.clock.monotonic() - start

    def _wait(self) -> None:
        with self._idle:
            bound = self.timeout * (self._pending + 1)
            if not self._idle.wait_for(lambda: self._pending == 0, timeout=bound):
                raise PeerTimeout(f"the communication thread did not finish its "
                                  f"{self._pending} queued synchronizations in {bound:.0f} s")
            error, self._error = self._error, None
        if error is not None:
            raise error

    def take_busy(self) -> float:
        """Busy seconds since the last call."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def take_waited(self) -> float:
        """Seconds waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def close(self, timeout: float | None = None) -> bool:
        """Stop after the queued jobs and join (bounded); whether the thread ended."""
        self._jobs.put(_STOP)
        self._thread.join(self.timeout if timeout is None else timeout)
        if self._thread.is_alive():
            log.warning("the communication thread is still running a synchronization")
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            start = self.clock.monotonic()
            try:
                if self._error is None:  # after an error the rest of the round is void
                    job()
            except BaseException as exc:  # handed to the training thread by wait()
                self._error = exc
            finally:
                self.busy_s += self.clock.monotonic() - start
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
