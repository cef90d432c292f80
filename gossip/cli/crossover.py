"""`gossip crossover run FILE` and `gossip crossover report DIR`: the crossover experiment
(jobs time-sharing devices, in several arms) and its table, summary.json and timelines."""

from __future__ import annotations

import time
from pathlib import Path

import click

from gossip.cli.common import fail_cleanly, main, run_forked
from gossip.errors import GossipError


@main.group()
def crossover():
    """Jobs that time-share devices: the crossover experiment."""


@crossover.command("run")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory (default: runs/DATE-TIME-NAME).")
@fail_cleanly
def crossover_run(path, out):
    """Run every point of the file in every arm, repeated and interleaved, then report."""
    from gossip.crossover.experiment import load_crossover, run_crossover
    from gossip.launching.forkserver import Zygote

    spec = load_crossover(path)
    out = Path(out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{spec.name}")
    click.echo(f"experiment {spec.name}: {len(spec.points)} points x {spec.repeats} repeats "
               f"-> {out}")
    failed = run_crossover(spec, out, echo=click.echo, zygote=Zygote(run_forked))
    _report(out, path)
    if failed:
        raise GossipError(f"failed: {', '.join(failed)} (logs in their directories)")


@crossover.command("report")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@fail_cleanly
def crossover_report(out):
    """The table, summary.json and timeline plots of a finished experiment directory."""
    _report(Path(out), Path(out) / "experiment.yaml")


def _report(out: Path, spec_path) -> None:
    from gossip.crossover.analysis import summarize, table
    from gossip.crossover.experiment import load_crossover
    from gossip.crossover.timeline import plot_timeline

    spec = load_crossover(spec_path)
    click.echo(table(summarize(out, spec)))
    for point in spec.points:
        figure = plot_timeline(out, point.name, list(point.arms))
        if figure is not None:
            click.echo(f"timeline: {figure}")
    click.echo(f"summary: {out / 'summary.json'}")
