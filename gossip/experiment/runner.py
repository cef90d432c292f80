"""Run every run of an experiment, one after the other, each as a `gossip launch` would."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import yaml

from gossip.errors import ConfigError, GossipError
from gossip.experiment.spec import Experiment, Run
from gossip.launching.forkserver import Zygote
from gossip.launching.processes import check_deaths
from gossip.matrix import check_run
from gossip.ports import free_ports


def check_runs(experiment: Experiment) -> None:
    """Everything that can be checked before a peer starts: graphs, topology files, link
    rates, per-rank delays, the compatibility matrix's cells (ConfigError naming the run)."""
    from gossip.cluster import parse_rate

    for run in experiment.runs:
        try:
            topology = _topology(run)
            run.config.delays.check_ranks(topology.size)
            if run.rate is not None:
                parse_rate(run.rate)
            if run.simulation is not None:
                run.simulation.check(topology.size)
            check_run(run.config, topology, simulate=run.simulation is not None)
        except ConfigError as exc:
            raise ConfigError(f"run {run.name}: {exc}") from None


def run_experiment(experiment: Experiment, out: Path, *, only: tuple[str, ...] = (),
                   echo: Callable[[str], None] = print, progress: bool = True,
                   zygote: Zygote | None = None) -> list[str]:
    """Run the experiment's runs (or those named in ``only``) into ``out/<name>/``.

    Writes ``out/experiment.yaml`` (the experiment file as given). A run that fails is
    reported and the next one starts; returns the names of the failed runs. With ``zygote``
    every run's peers are forked from its one server (no imports), else started as processes.
    """
    check_runs(experiment)
    for name in only:
        experiment.run(name)  # ConfigError naming the runs
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(yaml.safe_dump(dict(experiment.source),
                                                        sort_keys=False))
    failed = []
    for run in experiment.runs:
        if only and run.name not in only:
            continue
        try:
            seconds = _launch(run, out / run.name, progress=progress, zygote=zygote)
        except GossipError as exc:  # a peer died (LaunchFailed), no netns without root...
            echo(f"run {run.name} failed: {exc}; logs in {out / run.name}")
            failed.append(run.name)
        else:
            echo(f"run {run.name}: done in {seconds:.1f} s")
    return failed


def _launch(run: Run, run_dir: Path, *, progress: bool, zygote: Zygote | None) -> float:
    """Start the run's peers (in a virtual cluster when it has a rate), show one progress
    bar, wait for all; returns the seconds it took.

    Raises:
        LaunchFailed: a peer exited non-zero (the others were stopped).
    """
    from gossip.cluster import parse_rate
    from gossip.launching.plan import launch_run

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("peer-*.jsonl"):  # a re-run must not mix with old records
        stale.unlink()
    label = run.name + (f" @{parse_rate(run.rate)}" if run.rate is not None else "")
    if run.simulation is not None and run.simulation.sizes_only:
        from gossip.sim.sizes import simulate_sizes

        return simulate_sizes(run.config, _topology(run), run.simulation, run_dir,
                              extra_config={"run": run.name},
                              progress=f"{label} (sizes only)" if progress else None).wall_s
    if run.simulation is not None:
        from gossip.sim import simulate_run

        result = simulate_run(run.config, _topology(run), run_dir, run.simulation,
                              extra_config={"run": run.name},
                              progress=f"{label} (simulated)" if progress else None)
        check_deaths(result.deaths(asynchronous=run.config.asynchronous))
        return result.wall_s
    result = launch_run(run.config, _topology(run), run_dir, rate=run.rate,
                        extra_config={"run": run.name}, progress=label if progress else None,
                        zygote=zygote)
    check_deaths(result.deaths)  # none: without on_death a death stops the run (LaunchFailed)
    return result.seconds


def _topology(run: Run):
    from gossip.topology import Topology

    if run.topology is not None:
        return Topology.from_yaml(run.topology)
    params = {k: v for k, v in run.graph.items() if k != "kind"}
    topology = Topology.generate(run.graph["kind"], run.peers, **params)
    return topology.relocated(ports=free_ports(topology.size))


def default_out(experiment: Experiment) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{experiment.name}"

