"""Per-phase timers of one sparse all-reduce (``gossip bench sparse`` reports them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timings(dict):
    """Seconds per phase of one synchronize: load (x + residual), select (top-k, residual
    update), encode and decode (index coding, message checks), reduce (merging,
    accumulating, the result), send and recv (in the transport; recv includes wait, the
    time blocked on the socket), and total. ``cpu`` maps each phase to this thread's CPU
    seconds in it: on shared cores the wall time also counts time spent descheduled."""

    def __init__(self):
        super().__init__()
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - cpu
