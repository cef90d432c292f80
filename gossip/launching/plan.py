"""One run of local peers, as `gossip launch` and each run of `gossip experiment` start it:
an optional virtual cluster, the ranks, the run directory, the peers, their progress."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from tqdm import tqdm

from gossip.cluster import VirtualCluster
from gossip.config import TrainConfig
from gossip.launching import processes as launch
from gossip.launching.churn import Churn, Event, joiners
from gossip.matrix import check_run

if TYPE_CHECKING:
    from gossip.launching.forkserver import Zygote
    from gossip.topology import Topology


@dataclass(frozen=True)
class Placement:
    """Where a run's peers are, once its directory is written and before any peer starts."""

    run_dir: Path
    topology: Topology  # as in topology.yaml: relocated into the virtual cluster, if any
    ranks: list[int]  # the ranks started here
    cluster: VirtualCluster | None


@dataclass(frozen=True)
class RunResult:
    """A finished run: where it is, who ran, who died mid-run, how long it took."""

    run_dir: Path
    ranks: list[int]
    deaths: list[launch.Death]
    seconds: float  # from setting up the virtual cluster until the last peer ended


def launch_run(config: TrainConfig, topology: Topology, run_dir: str | Path, *,
               rate: str | None = None, extra_config: Mapping[str, Any] | None = None,
               peer_args: Sequence[str] = (), progress: str | None = None,
               on_ready: Callable[[Placement], None] | None = None,
               on_death: Callable[[launch.Death], None] | None = None,
               zygote: Zygote | None = None, churn: Sequence[Event] = ()) -> RunResult:
    """Run ``config`` on the local ranks of ``topology`` and wait until every peer ended.

    Writes ``run_dir/topology.yaml`` and ``run_dir/config.yaml`` (the training config,
    topology and ranks, then ``extra_config``, then the virtual cluster's link rate), then
    starts one `gossip peer` per rank, reading both, with ``peer_args`` after them.

    Args:
        rate: Run every rank instead in a network namespace of its own, links capped at this
            rate (a ``VirtualCluster``, torn down once every peer has stopped).
        extra_config: More config.yaml entries (e.g. an experiment's run name).
        peer_args: More `gossip peer` flags (e.g. ``--resume``).
        progress: Label of a progress bar over every peer's rounds; None: no bar.
        on_ready: Called with the ``Placement`` once the run directory is written, before
            any peer starts.
        on_death: Called with each peer that dies mid-run while the others go on (over the
            bar, if any); without it, any failure stops every peer (``launch.watch``).
        churn: A churn schedule (gossip.launching.churn): its joiners' ranks start only at
            their rounds, with ``--join``; its kills are not failures.

    Raises:
        LaunchFailed: a peer failed at start (or at all, without ``on_death``), or none
            finished; the others were stopped.
        ConfigError: no rank of the topology runs here, or a bad ``rate``.
        NetnsError: the virtual cluster cannot be set up.
    """
    check_run(config, topology)  # refused before any peer starts
    run_dir = Path(run_dir)
    cluster = VirtualCluster(topology.size, rate=rate) if rate is not None else None
    start = time.monotonic()
    with cluster or contextlib.nullcontext():  # the namespaces outlive every peer
        placement = place_run(config, topology, run_dir, cluster, extra_config)
        if on_ready is not None:
            on_ready(placement)
        args = ["--topology", str(run_dir / "topology.yaml"),
                "--config", str(run_dir / "config.yaml"), *peer_args]
        how = {"wrap": cluster.command if cluster else None,
               "spawn": zygote.spawn(cluster.namespace if cluster else None) if zygote else None}
        later = joiners(churn)
        procs = launch.start_peers([r for r in placement.ranks if r not in later], run_dir,
                                   args, **how)
        schedule = Churn(churn, lambda rank: launch.start_peers(
            [rank], run_dir, [*args, "--join"], **how)[0], run_dir / "membership.jsonl")
        training = [rank for rank in placement.ranks if placement.topology.trains(rank)]
        with tqdm(total=config.rounds * len(training), unit="round", desc=progress,
                  disable=progress is None) as bar:
            report = None if on_death is None else lambda death: _over(bar, on_death, death)
            deaths = launch.watch(procs, on_progress=lambda done: bar.update(done - bar.n),
                                  on_death=report, asynchronous=config.asynchronous,
                                  **schedule.watching())
    return RunResult(run_dir, placement.ranks, deaths, time.monotonic() - start)


def place_run(config: TrainConfig, topology: Topology, run_dir: Path,
              cluster: VirtualCluster | None, extra: Mapping[str, Any] | None) -> Placement:
    """The ranks to start here and the run directory's topology.yaml and config.yaml (whose
    ``train`` section `gossip peer --config` reads back); also for the jobs of a shared
    launch (``gossip.crossover.jobs``)."""
    if cluster:
        topology = cluster.relocate(topology)
    ranks = list(range(topology.size)) if cluster else launch.local_ranks(topology)
    run_dir.mkdir(parents=True, exist_ok=True)
    topology.to_yaml(run_dir / "topology.yaml")
    netns = {"netns": {"rate": str(cluster.rate)}} if cluster else {}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(
        {"train": config.to_dict(), "topology": topology.to_dict(), "ranks": ranks,
         **(extra or {}), **netns}, sort_keys=False))
    return Placement(run_dir, topology, ranks, cluster)


def _over(bar: tqdm, report: Callable[[launch.Death], None], death: launch.Death) -> None:
    """``report(death)`` with the progress bar cleared first and redrawn after."""
    with bar.external_write_mode():
        report(death)
