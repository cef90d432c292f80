"""`gossip experiment run` and `gossip plot`: several runs from one file, then figures and a table."""

from __future__ import annotations

from pathlib import Path

import click

from gossip.cli.common import fail_cleanly, main, run_forked
from gossip.errors import ConfigError, GossipError


@main.group()
def experiment():
    """Experiments: several runs from one YAML file, then plots and a comparison table."""


@experiment.command("run")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory (default: runs/DATE-TIME-NAME).")
@click.option("--only", multiple=True, metavar="RUN",
              help="Run only this run of the file (repeatable); others already in --out stay.")
@fail_cleanly
def experiment_run(path, out, only):
    """Run every run of the experiment file, then plot them (like `gossip plot OUT`)."""
    from gossip.experiment import load_experiment, report, run_experiment
    from gossip.experiment.runner import default_out
    from gossip.launching.forkserver import Zygote

    spec = load_experiment(path)
    out = Path(out) if out else default_out(spec)
    click.echo(f"experiment {spec.name}: {len(spec.runs)} runs -> {out}")
    failed = run_experiment(spec, out, only=tuple(only), echo=click.echo,
                            zygote=Zygote(run_forked))  # every run's peers forked: no imports
    ran = [run for run in spec.runs if not only or run.name in only]
    sizes_only = [run for run in ran if run.simulation and run.simulation.sizes_only]
    if len(sizes_only) < len(ran):  # sizes-only runs record no training curves
        report(out, echo=click.echo)
    if sizes_only:
        click.echo(f"{len(sizes_only)} sizes-only runs (round times, no training): "
                   f"gossip sim-scaling {out}")
    click.echo(f"experiment directory: {out}")
    if failed:
        raise GossipError(f"runs failed: {', '.join(failed)} (logs in their directories)")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--target-loss", type=float,
              help="Loss for the time-to-target column (default: the experiment's).")
@click.option("--baseline", multiple=True, metavar="RUN",
              help="Run the speed-ups are relative to (repeatable; default: the experiment's).")
@click.option("--smooth", type=int,
              help="Rounds in the loss moving average (default: the experiment's `smooth`).")
@fail_cleanly
def plot(run_dir, target_loss, baseline, smooth):
    """Loss vs time and vs bytes, accuracy vs round and vs bytes (PNG) of an experiment or
    launch directory, and the table: final loss and accuracy, bytes, time, time to target."""
    from gossip.experiment import report

    if smooth is not None and smooth < 1:
        raise ConfigError(f"--smooth: {smooth} must be >= 1")
    report(run_dir, target=target_loss, baselines=baseline or None, smooth=smooth,
           echo=click.echo)
