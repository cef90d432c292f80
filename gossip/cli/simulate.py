"""`gossip simulate`: `gossip launch`'s run, every peer in one process in virtual time."""

from __future__ import annotations

import time
from pathlib import Path

import click

from gossip.cli.common import (CHURN_HELP, DEFAULT_PEERS, GRAPH_OPTION, declared_option,
                               fail_cleanly, main, run_topology)
from gossip.cli.summary import run_summary
from gossip.cli.flags import TOLERATE_HELP, rank_values, TrainingCommand, train_config
from gossip.errors import ConfigError

NETWORK = "gossip.sim.network:NetworkModel"  # declares the network flags' defaults


def _rates(items) -> tuple[str | None, dict[int, str]]:
    """``("1gbit", "3:100mbit")`` -> ``("1gbit", {3: "100mbit"})``."""
    rate, per_rank = None, {}
    for item in items:
        rank, sep, value = item.partition(":")
        if sep and rank.strip().isdigit():
            per_rank[int(rank)] = value.strip()
        elif rate is None:
            rate = item
        else:
            raise ConfigError(f"--rate {item!r}: a second rate for every peer (one RATE, then "
                              f"RANK:RATE for single peers)")
    return rate, per_rank


@main.command(cls=TrainingCommand)
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="Topology YAML (only its graph matters here).")
@click.option("--peers", type=int,
              help=f"Peers when no --topology is given (default {DEFAULT_PEERS}, or the "
                   f"size --graph-option implies: a torus's rows x cols).")
@click.option("--graph", default="ring", show_default=True,
              help="Graph when no --topology is given (ring, torus, complete, ...).")
@GRAPH_OPTION
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default: runs/DATE-TIME-STRATEGY-sim).")
@click.option("--rate", "rates", multiple=True, metavar="[RANK:]RATE",
              help="Link rate each way, e.g. 1gbit, 100mbit (default: unlimited); RANK:RATE "
                   "for one peer, repeatable.")
@declared_option("--latency", source=NETWORK, field="latency", type=float, metavar="SECONDS",
                 help="One-way latency of every message.")
@declared_option("--sharing", source=NETWORK, field="sharing",
                 type=click.Choice(["fifo", "fair"]),
                 help="How flows share a link: queued, or max-min fair.")
@declared_option("--message-cost", source=NETWORK, field="message_s", type=float,
                 metavar="SECONDS", help="Sender CPU seconds per message (fitted: "
                                         "experiments/sim-validation.yaml).")
@declared_option("--byte-cost", source=NETWORK, field="byte_s", type=float, metavar="SECONDS",
                 help="Sender CPU seconds per byte.")
@click.option("--compute", "compute_model", default="model", show_default=True,
              help="model: compute takes only the injected delays (--compute-delay, "
                   "--slowdown, --straggler-*); measured[:FACTOR]: the real math's CPU "
                   "time, times FACTOR; lognormal:MEDIAN:SIGMA: a seeded draw per "
                   "mini-batch on top of the injected delays.")
@click.option("--kill", "kills", multiple=True, metavar="RANK:SECONDS",
              help="Kill peer RANK at this virtual time, repeatable.")
@click.option("--tolerate-deaths", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help=TOLERATE_HELP)
@declared_option("--probe", source="gossip.sim.runner:Simulation", field="probe",
                 type=click.Choice(["exchange", "oracle"]), help="Consensus probe: the real "
                 "all-reduce, or computed by the simulator (for many peers).")
@click.option("--sizes-only", is_flag=True,
              help="Replay the strategy's messages as sizes, without payloads or math (for "
                   "10^4 peers; writes sizes.json, no peer records).")
@click.option("--churn", metavar="SCHEDULE",
              help=CHURN_HELP + " A leave is the peer's own leave after that round, a kill "
                                "as --kill's.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@fail_cleanly
def simulate(topology_path, peers, graph, graph_options, run_dir, rates, latency, sharing,
             message_cost, byte_cost, compute_model, kills, tolerate_deaths, probe, sizes_only,
             churn, quiet, config_path, strategy_options, **flags):
    """Simulate a run: the peers' real code in virtual time on a modelled network.

    Writes the run directory `gossip launch` writes (so `gossip plot` reads it); times in
    it are virtual seconds.
    """
    from gossip.matrix import check_run
    from gossip.sim import NetworkModel, Simulation, parse_compute, simulate_run

    config = train_config(config_path, strategy_options, **flags)
    topology, config, events = run_topology(churn, config, topology_path, peers, graph,
                                            graph_options)
    config.delays.check_ranks(topology.size)
    check_run(config, topology, simulate=True, arbiter=bool(flags.get("arbiter")))
    rate, per_rank = _rates(rates)
    simulation = Simulation(
        network=NetworkModel(rate=rate, rates=per_rank, latency=latency, sharing=sharing,
                             message_s=message_cost, byte_s=byte_cost),
        compute=parse_compute(compute_model),
        kills=rank_values("--kill", kills), probe=probe, sizes_only=sizes_only)
    run_dir = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}-sim")
    click.echo(f"{topology.size} simulated peers, {topology.name or 'topology'}, strategy "
               f"{config.strategy}, {config.rounds} rounds -> {run_dir}")
    if simulation.sizes_only:
        from gossip.sim.sizes import simulate_sizes

        summary = simulate_sizes(config, topology, simulation, run_dir,
                                 progress=None if quiet else config.strategy).summary()
        click.echo(", ".join(f"{key} {value}" for key, value in summary.items()))
        click.echo(f"run directory: {run_dir}")
        return
    result = simulate_run(config, topology, run_dir, simulation,
                          progress=None if quiet else config.strategy, churn=events)
    from gossip.launching.processes import check_deaths

    deaths = result.deaths(asynchronous=config.asynchronous)
    died = {death.rank for death in deaths}
    trainers = [rank for rank in range(topology.size) if topology.trains(rank)]
    if all(rank in died for rank in trainers):  # no table to print
        # a rank that only serves (topology roles) may have finished: it trains nothing
        check_deaths(deaths, tolerate=min(tolerate_deaths, len(trainers) - 1))
        raise ConfigError(f"every simulated peer that trains died; the first: "
                          f"{deaths[0].describe()}")
    click.echo(run_summary(run_dir, list(range(topology.size)), deaths))
    click.echo(f"virtual time {result.virtual_s:.3f} s, wall {result.wall_s:.1f} s, "
               f"{result.events} events, peak memory {result.max_rss_mb:.0f} MB")
    click.echo(f"run directory: {run_dir}")
    check_deaths(deaths, tolerate=tolerate_deaths)


@main.command("sim-compare")
@click.argument("real_dir", type=click.Path(file_okay=False, exists=True))
@click.argument("sim_dir", type=click.Path(file_okay=False, exists=True))
@fail_cleanly
def sim_compare(real_dir, sim_dir):
    """Compare a simulated run with a real one of the same settings: bitwise numerics,
    equal bytes, per-round time error (median, p90). Exits 1 unless numerics and bytes are
    equal in every round; runs of different settings (seed, options, graph) are refused."""
    from gossip.sim.compare import compare_runs

    comparison = compare_runs(real_dir, sim_dir)
    click.echo(comparison.describe())
    if not comparison.identical:
        raise SystemExit(1)


@main.command("sim-scaling")
@click.argument("experiment_dir", type=click.Path(file_okay=False, exists=True))
@fail_cleanly
def sim_scaling(experiment_dir):
    """Time per iteration and scaling efficiency of an experiment's runs by strategy and P
    (experiments/scaling.yaml), each point marked validated or extrapolated; writes
    scaling.png there."""
    from gossip.sim.scaling import format_scaling, plot_scaling, scaling_rows

    rows = scaling_rows(experiment_dir)
    click.echo(format_scaling(rows))
    click.echo(f"figure: {plot_scaling(rows, Path(experiment_dir))}")


@main.command("sim-fit")
@click.argument("experiment_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--fit", "fit_on", multiple=True, required=True, metavar="RUN",
              help="A real run the costs are fitted on (repeatable; two with different "
                   "message sizes separate the per-message from the per-byte cost).")
@declared_option("--latency", source=NETWORK, field="latency", type=float, metavar="SECONDS",
                 help="One-way latency of the model (the netns cluster adds none).")
@click.option("--compute", "compute_model", default="measured", show_default=True,
              help="Compute model of the simulations (as for gossip simulate).")
@fail_cleanly
def sim_fit(experiment_dir, fit_on, latency, compute_model):
    """Fit the network model's per-message and per-byte costs on the --fit runs of an
    experiment's real netns runs, predict every run's round times with them and print the
    errors (median and p90 per round); simulations and fit.json in EXPERIMENT_DIR/sim-fit."""
    import numpy as np

    from gossip.bench.harness import format_table
    from gossip.metrics import run_dirs
    from gossip.sim.fit import RealRun, fit_costs, predict, write_report
    from gossip.sim.network import NetworkModel

    runs = [RealRun.read(path) for path in run_dirs(Path(experiment_dir))]
    by_name = {run.name: run for run in runs}
    unknown = [name for name in fit_on if name not in by_name]
    if unknown:
        raise ConfigError(f"--fit {unknown[0]}: no such run in {experiment_dir} (runs: "
                          f"{', '.join(by_name)})")
    out, base = Path(experiment_dir) / "sim-fit", NetworkModel(latency=latency)
    fit = fit_costs([by_name[name] for name in fit_on], out / "probes", base=base,
                    compute=compute_model)
    click.echo(f"fitted on {', '.join(fit_on)}: message cost {fit.message_s * 1e3:.3f} ms, "
               f"byte cost {fit.byte_s * 1e9:.3f} ns/B")
    rows = predict(runs, fit, out / "predicted", base=base, compute=compute_model)
    click.echo(format_table(rows, list(rows[0])))
    predicted = [row for row in rows if row["role"] == "predicted"] or rows
    click.echo(f"predicted runs: median of the per-run median errors "
               f"{np.median([r['median error'] for r in predicted]):.1%}, worst p90 "
               f"{max(r['p90 error'] for r in predicted):.1%}")
    click.echo(f"report: {write_report(out, fit, rows)}")
