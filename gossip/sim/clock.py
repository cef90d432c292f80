"""A peer's clock in a simulation, and how its own CPU work is charged in virtual time.

The peer's code reads and sleeps on this clock exactly as on a real one (gossip/clock.py);
here a sleep parks the peer's greenlet and lets the others run. What the real math costs is
the compute model's choice: ``ModelledCompute`` charges nothing (compute time is what the
run's delays inject: a constant per mini-batch, per-rank slowdowns, the seeded stragglers of
gossip/faults.py), ``MeasuredCompute`` charges the CPU time the peer's code really used,
scaled, at its next clock read, sleep or send; ``LognormalCompute`` adds a seeded lognormal
draw to every mini-batch's injected delay.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from gossip.clock import Clock
from gossip.errors import ConfigError
from gossip.faults import DelayModel
from gossip.sim.scheduler import Scheduler

EPOCH = 1.7e9  # time() at virtual time 0: record timestamps look like ordinary ones


@dataclass(frozen=True)
class ModelledCompute:
    """The real math takes no virtual time; only injected delays do (deterministic)."""

    def charge(self, scheduler: Scheduler) -> None:
        """Nothing to charge."""

    def delays(self, model: DelayModel) -> DelayModel | DrawnDelays:
        """A rank's injected delays under this compute model (as configured here)."""
        return model

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

    def delays(self, model: DelayModel) -> DelayModel:
        return model

    def describe(self) -> str:
        return f"measured CPU time x {self.factor:g}"


@dataclass(frozen=True)
class LognormalCompute(ModelledCompute):
    """Modelled: every mini-batch also takes a lognormal draw of seconds (``median``,
    log-space ``sigma``), a pure function of (seed, rank, mini-batch index)."""

    median: float = 0.01
    sigma: float = 0.5

    def delays(self, model: DelayModel) -> DrawnDelays:
        return DrawnDelays(model, self)

    def describe(self) -> str:
        return f"lognormal per mini-batch, median {self.median:g} s, sigma {self.sigma:g}"


@dataclass(frozen=True)
class DrawnDelays:
    """A rank's ``DelayModel`` wrapped: its delays plus the compute model's draw."""

    inner: DelayModel
    compute: LognormalCompute

    @property
    def send_delay(self) -> float:
        return self.inner.send_delay

    def minibatch_delay(self, index: int, measured: float) -> float:
        rng = np.random.default_rng([self.inner.seed, self.inner.rank, index])
        draw = self.compute.median * math.exp(self.compute.sigma * rng.standard_normal())
        return self.inner.minibatch_delay(index, measured) + self.inner.factor * draw


def parse_compute(text: str) -> ModelledCompute | MeasuredCompute:
    """``model``, ``measured[:FACTOR]`` or ``lognormal:MEDIAN:SIGMA``; ConfigError naming
    the flag otherwise."""
    name, _, arg = str(text).partition(":")
    if name == "model" and not arg:
        return ModelledCompute()
    if name == "lognormal":
        median, _, sigma = arg.partition(":")
        try:
            median, sigma = float(median), float(sigma)
        except ValueError:
            median = sigma = -1.0
        if not (0 < median < math.inf and 0 <= sigma < math.inf):
            raise ConfigError(f"--compute {text!r}: expected lognormal:MEDIAN:SIGMA, "
                              f"MEDIAN > 0 seconds, SIGMA >= 0")
        return LognormalCompute(median, sigma)
    if name == "measured":
        try:
            factor = float(arg) if arg else 1.0
        except ValueError:
            factor = -1.0
        if not factor > 0 or factor == float("inf"):
            raise ConfigError(f"--compute {text!r}: the factor must be a positive number")
        return MeasuredCompute(factor)
    raise ConfigError(f"--compute {text!r}: expected model, measured[:FACTOR] or "
                      f"lognormal:MEDIAN:SIGMA")


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
