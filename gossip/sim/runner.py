"""One simulated run, as `gossip simulate` and an experiment's ``simulate: true`` runs start it:
every peer's unchanged ``Peer`` + ``train`` in a greenlet, in virtual time, writing the run
directory `gossip launch` writes (topology.yaml, config.yaml, peer-RANK.jsonl)."""

from __future__ import annotations

import functools
import logging
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.launching.churn import Event, joiners
from gossip.launching.processes import Death, progress
from gossip.matrix import check_run
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.sim.churn import SimChurn
from gossip.sim.clock import ModelledCompute, parse_compute
from gossip.sim.network import NetworkModel
from gossip.sim.probe import Meetings, OracleProbe
from gossip.sim.rushing import Board, rushing
from gossip.sim.transport import SimWorld
from gossip.training.synchronous import Trainer, runner

log = logging.getLogger("gossip.sim")
PROBES = ("exchange", "oracle")
SIZE_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Simulation:
    """How a run is simulated: network, compute model, faults (the ``simulate`` section of
    its config.yaml).

    Attributes:
        network: The network model.
        compute: ``ModelledCompute()`` or ``MeasuredCompute(factor)``.
        kills: ``{rank: virtual seconds}``: kill that peer then (a SIGKILL).
        probe: ``exchange``: the consensus probe is the real all-reduce (bitwise a real
            run's); ``oracle``: the simulator computes it (gossip/sim/probe.py), for many
            peers.
        sizes_only: Replay the strategy's message sizes without payloads or math
            (gossip/sim/sizes.py).
        params: With ``sizes_only``: the synchronized tensor's elements, instead of the
            task model's (a model whose code is not needed: only its parameter count).
        dtype: With ``sizes_only``: that tensor's element type (``float16`` models a model
            sent as half precision), instead of the task model's.
    """

    network: NetworkModel = field(default_factory=NetworkModel)
    compute: Any = ModelledCompute()
    kills: Mapping[int, float] = field(default_factory=dict)
    probe: str = "exchange"
    sizes_only: bool = False  # replay message sizes without the math (gossip/sim/sizes.py)
    params: int | None = None
    dtype: str | None = None

    def check(self, size: int) -> None:
        self.network.check_ranks(size)
        if (self.params is not None or self.dtype is not None) and not self.sizes_only:
            raise ConfigError("simulate: params and dtype are for sizes_only runs (a full "
                              "simulation runs the task's model)")
        if self.params is not None and (not isinstance(self.params, int)
                                        or isinstance(self.params, bool) or self.params < 1):
            raise ConfigError(f"simulate: params: expected a positive integer, got "
                              f"{self.params!r}")
        if self.dtype is not None and self.dtype not in SIZE_DTYPES:
            raise ConfigError(f"simulate: dtype: {self.dtype!r} is not one of "
                              f"{', '.join(SIZE_DTYPES)}")
        if self.probe not in PROBES:
            raise ConfigError(f"--probe {self.probe!r}: expected one of {', '.join(PROBES)}")
        for rank, when in self.kills.items():
            if not 0 <= rank < size:
                raise ConfigError(f"--kill: rank {rank} is not in the run (ranks 0..{size - 1})")
            if not when >= 0:
                raise ConfigError(f"--kill {rank}: the time must be >= 0 seconds, got {when}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | bool | None, *,
                  rate: str | None = None) -> Simulation:
        """From an experiment's ``simulate:`` value: ``true`` or a mapping of the network
        model's fields plus ``compute`` (model, measured[:FACTOR]), ``probe``,
        ``sizes_only`` (with ``params``, ``dtype``) and ``kills`` (``{rank: seconds}``);
        ``rate`` (the run's netns rate)
        is the default link rate."""
        data = {} if data is True or data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"simulate: expected true or a mapping, got {data!r}")
        network = {k: v for k, v in data.items()
                   if k not in ("compute", "probe", "kills", "sizes_only", "params", "dtype")}
        if rate is not None:
            network.setdefault("rate", rate)
        kills = data.get("kills") or {}
        try:
            kills = {int(k): float(v) for k, v in dict(kills).items()}
        except (ValueError, TypeError):
            raise ConfigError(f"simulate: kills: expected {{rank: seconds}}, got {kills!r}") \
                from None
        return cls(network=NetworkModel.from_dict(network),
                   compute=parse_compute(data.get("compute", "model")), kills=kills,
                   probe=data.get("probe", "exchange"),
                   sizes_only=_flag(data.get("sizes_only", False)),
                   params=data.get("params"), dtype=data.get("dtype"))

    def to_dict(self) -> dict[str, Any]:
        return {"network": self.network.to_dict(), "compute": self.compute.describe(),
                "kills": dict(self.kills), "probe": self.probe, "sizes_only": self.sizes_only,
                **({"params": self.params} if self.params is not None else {}),
                **({"dtype": self.dtype} if self.dtype is not None else {})}


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"simulate: sizes_only: expected true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class SimResult:
    """A finished simulated run."""

    run_dir: Path
    records: dict[int, list[dict]]  # per rank, its lines
    stats: dict[int, dict]  # per rank that finished, ``Peer.stats`` after its last round
    failed: dict[int, str]  # ranks whose process ended with an error: the error
    killed: list[int]
    virtual_s: float  # virtual time when the last peer ended
    wall_s: float
    events: int
    max_rss_mb: float  # this process's peak resident memory

    def deaths(self, *, asynchronous: bool) -> list[Death]:
        """The peers that did not finish, as `gossip launch` reports them: the killed ones
        (injected by the run), then those that failed."""
        def died(rank: int, code: int, why: str, injected: bool) -> Death:
            return Death(rank, code, last_line=why, injected=injected,
                         **progress(self.records.get(rank, []), asynchronous=asynchronous))

        return ([died(rank, -9, "", True) for rank in self.killed]
                + [died(rank, 1, why, False) for rank, why in sorted(self.failed.items())])


def simulate_run(config: TrainConfig, topology, run_dir: str | Path,
                 simulation: Simulation = Simulation(), *,
                 extra_config: Mapping[str, Any] | None = None, progress: str | None = None,
                 write: bool = True,
                 on_round: Callable[[int, dict], None] | None = None,
                 churn: Sequence[Event] = ()) -> SimResult:
    """Simulate ``config`` on every rank of ``topology``; returns when every peer ended.

    Args:
        extra_config: More config.yaml entries (e.g. an experiment's run name).
        progress: Label of a progress bar (rounds, virtual and wall time); None: none.
        write: Write the run directory (off: only return the records).
        on_round: Called as ``(rank, record)`` after each peer's round.
        churn: A churn schedule of an elastic run (gossip/sim/churn.py): its joiners' ranks
            start only at their rounds; membership.jsonl records its events.
    """
    size = topology.size
    config.delays.check_ranks(size)
    simulation.check(size)
    check_run(config, topology, simulate=True)
    run_dir = Path(run_dir)
    if write:
        write_run_dir(config, topology, run_dir, simulation, extra_config)
    world = SimWorld(size, network=simulation.network, compute=simulation.compute,
                     threads=peer_threads())
    records: dict[int, list[dict]] = {rank: [] for rank in range(size)}
    training = [rank for rank in range(size) if topology.trains(rank)]
    bar = tqdm(total=config.rounds * len(training), unit="round", desc=progress,
               disable=progress is None)
    started = time.perf_counter()

    def recorded(rank: int, line: dict) -> None:
        records[rank].append(line)
        if on_round is not None:
            on_round(rank, line)
        schedule.recorded(rank, line["round"])
        bar.update()
        bar.set_postfix_str(f"virtual {world.scheduler.now:.2f} s, wall "
                            f"{time.perf_counter() - started:.0f} s", refresh=False)

    meetings = (Meetings(world, left_out=frozenset(config.attack.by_rank))
                if simulation.probe == "oracle" else None)
    board = Board(world, topology, config.attack.by_rank) if config.attack.rushing else None
    stats: dict[int, dict] = {}
    peers: dict[int, Peer] = {}  # each running peer, for a leave of the schedule

    def start(rank: int, *, join: bool = False) -> None:
        world.spawn(rank, _peer_main(world, rank, topology, config, recorded, meetings, stats,
                                     board, peers, join=join))

    schedule = SimChurn(churn, world, functools.partial(start, join=True), peers,
                        run_dir / "membership.jsonl" if write and churn else None)
    later = joiners(churn)
    for rank in range(size):
        if rank not in later:
            start(rank)
    for rank, when in sorted(simulation.kills.items()):
        world.kill_at(rank, when)
    with bar:
        world.scheduler.run()
    tasks = world.tasks
    failed = {rank: f"{type(t.error).__name__}: {t.error}" for rank, t in tasks.items()
              if t.error is not None}
    for rank, reason in failed.items():
        log.warning("simulated peer %d failed: %s", rank, reason)
    if write:
        for rank in training:  # as `gossip launch`: a rank that only serves writes none
            lines = records[rank]
            with MetricsWriter(run_dir / f"peer-{rank}.jsonl") as metrics:
                for line in lines:
                    metrics.write(line)
    killed = sorted(rank for rank, t in tasks.items() if t.killed)  # not those that ended first
    return SimResult(run_dir, records, stats, failed, killed,
                     max((t.ended_at or 0.0 for t in tasks.values()), default=0.0),
                     time.perf_counter() - started,
                     world.scheduler.events,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def peer_threads() -> int:
    """torch's threads in a peer process of `gossip launch`, which starts them with
    ``OMP_NUM_THREADS`` as set, else 1 (gossip/launching/processes.py): the same threads sum the same
    floats in the same order."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _peer_main(world: SimWorld, rank: int, topology, config: TrainConfig,
               recorded: Callable[[int, dict], None],
               meetings: Meetings | None, stats: dict[int, dict],
               board: Board | None, peers: dict[int, Peer], *,
               join: bool = False) -> Callable[[], dict]:
    """What `gossip peer` runs (cli/train.py), on a simulated transport; with ``board``,
    rushing attackers read every honest model of the round from it (sim/rushing.py). The
    ``Peer`` is kept in ``peers`` while it runs; ``join``: it joins the running members on
    a spare rank of an elastic run first (`gossip peer --join`)."""
    def run() -> dict:
        transport = world.transport(rank, timeout=config.timeout, dead_after=config.dead_after)
        spec = config.spec.copy()  # this peer's own compressor state, as in its own process
        transport, attack = rushing(board, transport, config.attack.for_rank(
            rank, seed=config.seed), config.timeout)
        if not topology.trains(rank):  # a server only (topology roles): the serve loop
            with Peer(rank, topology, spec, transport=transport) as node:
                node.serve()
            return {}
        with Peer(rank, topology, spec, transport=transport,
                  send_delay=config.delays.for_rank(rank, seed=config.seed).send_delay,
                  attack=attack, elastic=config.elastic, min_peers=config.min_peers,
                  spares=config.spares) as node:
            peers[rank] = node
            try:  # a killed or failed peer leaves the map too (its model, its messages)
                trainer = Trainer(node, config, on_round=lambda line: recorded(rank, line))
                trainer.delays = world.compute.delays(trainer.delays)
                if meetings is not None:
                    trainer.consensus = OracleProbe(meetings, node, trainer.task)
                if join:
                    trainer.enter()
                last = runner(trainer).run()  # an asynchronous strategy's budgets too
                stats[rank] = node.stats  # before the goodbyes
            finally:
                del peers[rank]
        return {} if last is None else last.as_dict()
    return run


def write_run_dir(config: TrainConfig, topology, run_dir: Path, simulation: Simulation,
                  extra: Mapping[str, Any] | None) -> None:
    """topology.yaml and config.yaml as `gossip launch` writes them, plus ``simulate``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    topology.to_yaml(run_dir / "topology.yaml")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(
        {"train": config.to_dict(), "topology": topology.to_dict(),
         "ranks": list(range(topology.size)), **(extra or {}),
         "simulate": simulation.to_dict()}, sort_keys=False))
