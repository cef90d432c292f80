"""A peer's clock in a simulation, and how its own CPU work is charged in virtual time.

The peer's code reads and sleeps on this clock exactly as on a real one (gossip/clock.py);
here a sleep parks the peer's greenlet and lets the others run. What the real math costs is
the compute model's choice: ``ModelledCompute`` charges nothing (compute time is what the
run's delays inject: a constant per mini-batch, per-rank slowdowns, the seeded stragglers of
gossip/faults.py), ``MeasuredCompute`` charges the CPU time the peer's code really used,
scaled, at its next clock read, sleep or send.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gossip.clock import Clock
from gossip.errors import ConfigError
from gossip.sim.scheduler import Scheduler

EPOCH = 1.7e9  # time() at virtual time 0: record timestamps look like ordinary ones


@dataclass(frozen=True)
class ModelledCompute:
    """The real math takes no virtual time; only injected delays do (deterministic)."""

    def charge(self, scheduler: Scheduler) -> None:
        """Nothing to charge."""

    def describe(self) -> str:
        return "modelled (injected delays only)"


@dataclass(frozen=True)
class MeasuredCompute:
    """The CPU time the peer's own code used since it last ran charged as ``factor`` times
    that many virtual seconds (a machine ``1/factor`` times as fast as this one)."""

    factor: float = 1.0

    def charge(self, scheduler: Scheduler) -> None:
        task = scheduler.current
        if task is None:
            return
        now = time.thread_time()
        used, task.cpu_mark = now - task.cpu_mark, now
        if used > 0:
            scheduler.sleep(used * self.factor)

    def describe(self) -> str:
        return f"measured CPU time x {self.factor:g}"


def parse_compute(text: str) -> ModelledCompute | MeasuredCompute:
    """``model`` or ``measured[:FACTOR]``; ConfigError naming the flag otherwise."""
    name, _, arg = str(text).partition(":")
    if name == "model" and not arg:
        return ModelledCompute()
    if name == "measured":
        try:
            factor = float(arg) if arg else 1.0
        except ValueError:
            factor = -1.0
        if not factor > 0 or factor == float("inf"):
            raise ConfigError(f"--compute {text!r}: the factor must be a positive number")
        return MeasuredCompute(factor)
    raise ConfigError(f"--compute {text!r}: expected model or measured[:FACTOR]")


class SimClock(Clock):
    """Virtual time of one simulated peer: the scheduler's, after charging its compute."""

    virtual = True

    def __init__(self, scheduler: Scheduler, compute=ModelledCompute(), *, epoch: float = EPOCH):
        self.scheduler, self.compute, self.epoch = scheduler, compute, epoch

    def monotonic(self) -> float:
        self.compute.charge(self.scheduler)
        return self.scheduler.now

    def time(self) -> float:
        return self.epoch + self.monotonic()

    def sleep(self, seconds: float) -> None:
        self.compute.charge(self.scheduler)
        if seconds > 0:
            self.scheduler.sleep(seconds)
