"""Sizes-only simulation: every peer's round replayed as its strategy's message pattern with
sizes (``Strategy.traffic``), no payloads and no math, on the same network model and
scheduler as a full simulation; for 10^4 peers, where the math of every peer is too slow.

Compute is modelled: each round every peer first sleeps its mini-batches' injected delays
(``--compute-delay``, slowdowns, stragglers, a lognormal draw); then it runs its plan: a
step's sends leave, and it goes on once each message the step waits for has arrived.
Bytes per kind equal a full simulation's (tests/unit/test_sim_sizes.py) while the plan's
sizes are exact (see the strategy's ``traffic``); times are those of the network model.
"""

from __future__ import annotations

import itertools
import json
import resource
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.sim.clock import MeasuredCompute
from gossip.sim.runner import write_run_dir
from gossip.same_start import start_step
from gossip.sim.scheduler import Scheduler
from gossip.strategies.traffic import Step, round_bytes
from gossip.tasks.base import create_task


@dataclass(frozen=True)
class SizesResult:
    """A finished sizes-only run."""

    round_end: np.ndarray  # [rounds, peers]: virtual time each peer finished each round
    compute_s: np.ndarray  # every peer-round's modelled compute seconds
    bytes_sent: dict[str, int]  # per kind, every peer and round
    messages: int
    wall_s: float
    events: int
    max_rss_mb: float

    def summary(self) -> dict:
        ends = self.round_end
        starts = np.vstack([np.zeros((1, ends.shape[1])), ends[:-1]])
        return {"peers": int(ends.shape[1]), "rounds": int(ends.shape[0]),
                "virtual_s": float(ends.max()) if ends.size else 0.0,
                "median_round_s": float(np.median(ends - starts)) if ends.size else 0.0,
                "median_compute_s": float(np.median(self.compute_s)) if ends.size else 0.0,
                "bytes_sent": dict(self.bytes_sent), "messages": self.messages,
                "wall_s": self.wall_s, "events": self.events, "max_rss_mb": self.max_rss_mb}


def model_size(config: TrainConfig, simulation=None) -> tuple[int, torch.dtype]:
    """Elements and dtype of the tensor the strategy synchronizes: the task's model, flat,
    or what ``simulation`` says (``params``, ``dtype``: no model is built for params)."""
    params, dtype = (simulation.params, simulation.dtype) if simulation else (None, None)
    if params is not None:
        return params, getattr(torch, dtype or "float32")
    if dtype is not None:
        return model_size(config)[0], getattr(torch, dtype)
    torch.manual_seed(config.seed)
    model = create_task(config.task, seed=config.seed, **config.task_options).build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), params[0].dtype


def plans(config: TrainConfig, size: int, simulation=None) -> list[Iterable[Step]]:
    """Every rank's plan (iterated once per round, see gossip/strategies/traffic.py) for
    the tensor ``model_size`` says; ConfigError if the strategy has none."""
    cls, options = config.spec.cls, config.spec.options
    numel, dtype = model_size(config, simulation)
    found = [cls.traffic(rank, size, numel, dtype, options) for rank in range(size)]
    if found[0] is None:
        raise ConfigError(f"--sizes-only: strategy {config.strategy!r} has no traffic plan "
                          f"(its messages depend on the values); simulate it in full")
    return found


class _Replay:
    """The peers' state machines on one scheduler and one set of links."""

    def __init__(self, config, simulation, plans, bar):
        size = len(plans)
        self.plans, self.rounds, self.bar = plans, config.rounds, bar
        self.minibatches = config.minibatches
        self.scheduler = Scheduler()
        self.links = simulation.network.build(self.scheduler, size)
        self.delays = [simulation.compute.delays(config.delays.for_rank(r, seed=config.seed))
                       for r in range(size)]
        self.round = [0] * size
        # Each rank's step now and the rest of its round's plan (made as it goes: a Plan).
        self.step: list[Step | None] = [None] * size
        self.steps: list[Iterator[Step] | None] = [None] * size
        self.sent = [False] * size
        self.computing = [True] * size
        self.arrived: list[dict] = [{} for _ in range(size)]  # (round, src, kind): count
        self.round_end = np.zeros((config.rounds, size))
        self.bytes_sent: Counter = Counter()
        self.messages = 0
        self.compute_s: list[float] = []
        self._extra = [round_bytes(r) for r in range(config.rounds)]

    def start(self) -> None:
        for rank in range(len(self.plans)):
            self._compute(rank)

    def _compute(self, rank: int) -> None:
        delays, first = self.delays[rank], self.round[rank] * self.minibatches
        seconds = sum(delays.minibatch_delay(first + i, 0.0) for i in range(self.minibatches))
        self.compute_s.append(seconds)
        self.computing[rank] = True
        self.scheduler.at(self.scheduler.now + seconds, self._computed, rank)

    def _computed(self, rank: int) -> None:
        self.computing[rank] = False
        steps = iter(self.plans[rank])
        if self.round[rank] == 0 and len(self.plans) > 1:  # gossip/same_start.py's check
            steps = itertools.chain([start_step(rank, len(self.plans))], steps)
        self.steps[rank] = steps
        self.step[rank] = next(steps, None)
        self._advance(rank)

    def arrive(self, dst: int, key: tuple) -> None:
        arrived = self.arrived[dst]
        arrived[key] = arrived.get(key, 0) + 1
        if not self.computing[dst]:
            self._advance(dst)

    def _advance(self, rank: int) -> None:
        round, arrived = self.round[rank], self.arrived[rank]
        while True:
            step = self.step[rank]
            if step is None:  # the plan is done
                self.round_end[round, rank] = self.scheduler.now
                self.bar.update()
                self.round[rank] = round = round + 1
                self.steps[rank] = None
                if round < self.rounds:
                    self._compute(rank)
                return
            sends, recvs = step
            if not self.sent[rank]:
                extra, send, counted = self._extra[round], self.links.send, self.bytes_sent
                for dst, kind, nbytes in sends:
                    nbytes += extra
                    counted[kind] += nbytes
                    send(rank, dst, nbytes, _Arrival(self, dst, (round, rank, kind)))
                self.messages += len(sends)
                self.sent[rank] = True
            for src, kind in recvs:
                if (round, src, kind) not in arrived:
                    return  # woken again by the arrival it waits for
            for src, kind in recvs:
                key = (round, src, kind)
                left = arrived[key] - 1
                if left:
                    arrived[key] = left
                else:
                    del arrived[key]
            self.sent[rank] = False
            self.step[rank] = next(self.steps[rank], None)


class _Arrival:
    __slots__ = ("replay", "dst", "key")

    def __init__(self, replay, dst, key):
        self.replay, self.dst, self.key = replay, dst, key

    def __call__(self):
        self.replay.arrive(self.dst, self.key)


def simulate_sizes(config: TrainConfig, topology, simulation,
                   run_dir: str | Path | None = None, *,
                   extra_config: Mapping[str, Any] | None = None,
                   progress: str | None = None) -> SizesResult:
    """Replay ``config``'s strategy on ``topology``'s peers for ``config.rounds`` rounds;
    with ``run_dir``, writes its topology.yaml and config.yaml as `gossip simulate` does,
    and ``sizes.json`` (``SizesResult.summary``) instead of peer records."""
    if isinstance(simulation.compute, MeasuredCompute):
        raise ConfigError("--sizes-only: --compute measured needs the math; use model or "
                          "lognormal:MEDIAN:SIGMA")
    if simulation.kills:
        raise ConfigError("--sizes-only: --kill is not simulated without the peers' code")
    if config.elastic:  # so neither is --churn, which needs --elastic
        raise ConfigError("--sizes-only: --elastic is not simulated without the peers' code "
                          "(agreements, a joiner's state and its hash need values)")
    size = topology.size
    simulation.check(size)
    config.delays.check_ranks(size)
    started = time.perf_counter()
    found = plans(config, size, simulation)
    if run_dir is not None:
        write_run_dir(config, topology, Path(run_dir), simulation, extra_config)
    with tqdm(total=config.rounds * size, unit="round", desc=progress,
              disable=progress is None) as bar:
        replay = _Replay(config, simulation, found, bar)
        replay.start()
        replay.scheduler.run()
    result = SizesResult(replay.round_end, np.array(replay.compute_s),
                         dict(replay.bytes_sent), replay.messages,
                         time.perf_counter() - started, replay.scheduler.events,
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if run_dir is not None:
        (Path(run_dir) / "sizes.json").write_text(json.dumps(result.summary(), indent=1))
    return result
