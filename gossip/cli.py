"""Command line: `gossip peer | launch | topology show | bench`."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import click
import yaml

from gossip.errors import ConfigError, GossipError

RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def _fail_cleanly(fn):
    """GossipError -> one line on stderr and exit 1; Ctrl-C -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GossipError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def _train_options(fn):
    """Training flags shared by `peer` and `launch`; unset flags keep the config's value."""
    options = [
        click.option("--strategy", help="Synchronization strategy, e.g. dpsgd, ring-allreduce."),
        click.option("--rounds", type=int, help="Synchronized steps per peer."),
        click.option("--lr", type=float, help="Learning rate."),
        click.option("--batch-size", type=int, help="Samples per local step."),
        click.option("--partition", help="Data split over peers: iid or dirichlet."),
        click.option("--alpha", type=float, help="Dirichlet concentration (non-iid skew)."),
        click.option("--seed", type=int, help="Seed of data split, init and batches."),
        click.option("--timeout", type=float, help="Seconds to wait for a peer's message."),
        click.option("--option", "strategy_options", multiple=True, metavar="KEY=VALUE",
                     help="Strategy option, repeatable (e.g. piece_bytes=1048576)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     help="YAML with training settings (a run directory's config.yaml)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _train_config(config_path, strategy_options, **flags):
    from gossip.config import TrainConfig

    base = TrainConfig.from_yaml(config_path).to_dict() if config_path else {}
    base.update({k: v for k, v in flags.items() if v is not None})
    options = dict(base.get("options") or {})
    for item in strategy_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    base["options"] = options
    return TrainConfig.from_dict(base, source=config_path or "command line")


@click.group()
@click.version_option(package_name="gossip")
def main():
    """gossip: decentralized deep learning over ZeroMQ."""


@main.command()
@click.option("--rank", type=int, help=f"This peer's rank (default: ${' / $'.join(RANK_ENV)}).")
@click.option("--topology", "topology_path", required=True, type=click.Path(dir_okay=False),
              help="Topology YAML naming every peer's host and port.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=".",
              help="Where this peer writes peer-RANK.jsonl.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_train_options
@_fail_cleanly
def peer(rank, topology_path, run_dir, quiet, config_path, strategy_options, **flags):
    """Run one peer of a cluster (the same topology file on every machine)."""
    from tqdm import tqdm

    from gossip.metrics import MetricsWriter
    from gossip.peer import Peer
    from gossip.topology import Topology
    from gossip.training import train

    rank = _resolve_rank(rank)
    topology = Topology.from_yaml(topology_path)
    config = _train_config(config_path, strategy_options, **flags)
    metrics_path = Path(run_dir) / f"peer-{rank}.jsonl"
    with Peer(rank, topology, config.strategy, timeout=config.timeout,
              **config.options) as node, MetricsWriter(metrics_path) as metrics:
        with tqdm(total=config.rounds, desc=f"peer {rank}", disable=quiet, unit="round") as bar:
            last = train(node, config, metrics=metrics, on_round=lambda _: bar.update(1))
    click.echo(f"peer {rank}: loss {last['loss']:.4f} accuracy {last['accuracy']:.4f} "
               f"bytes_sent {last['bytes_sent']} bytes_recv {last['bytes_recv']} "
               f"time {last['time']:.1f}s metrics {metrics_path}")


def _resolve_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    for name in RANK_ENV:
        if os.environ.get(name, "").strip():
            try:
                return int(os.environ[name])
            except ValueError:
                raise ConfigError(f"${name}={os.environ[name]!r} is not a rank") from None
    raise ConfigError(f"no rank: pass --rank or set one of ${', $'.join(RANK_ENV)}")


@main.command()
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="Topology YAML (default: a ring of --peers on 127.0.0.1, free ports).")
@click.option("--peers", type=int, default=4, show_default=True,
              help="Peers when no --topology is given.")
@click.option("--graph", default="ring", show_default=True,
              help="Graph when no --topology is given (ring, torus, complete, ...).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default: runs/DATE-TIME-STRATEGY).")
@click.option("--netns", is_flag=True,
              help="Run every peer in its own network namespace with its own IP, links capped "
                   "at --rate (needs root and iproute2).")
@click.option("--rate", help="With --netns: cap of every link, each way, e.g. 100mbit, 1gbit, "
                             "500kbit.  [default: 1gbit]")
@_train_options
@_fail_cleanly
def launch(topology_path, peers, graph, run_dir, netns, rate, config_path, strategy_options,
           **flags):
    """Start every local peer, show progress, print a per-peer summary.

    With no arguments: the demo, 4 peers on a ring training the digits MLP with dpsgd.
    """
    import contextlib

    from tqdm import tqdm

    from gossip import launch as launcher
    from gossip.netutil import free_ports
    from gossip.topology import Topology

    config = _train_config(config_path, strategy_options, **flags)
    if topology_path:
        topology = Topology.from_yaml(topology_path)
    else:
        topology = Topology.generate(graph, peers).relocated(ports=free_ports(peers))
    cluster = None
    if netns:
        from gossip.cluster import VirtualCluster

        cluster = VirtualCluster(topology.size, rate=rate or "1gbit")
    elif rate is not None:
        raise ConfigError("--rate: only with --netns (local peers share an uncapped loopback)")
    # The namespaces live until every peer has stopped, however the run ends.
    with cluster or contextlib.nullcontext():
        if cluster:
            click.echo(cluster.describe())
            topology = cluster.relocate(topology)
        ranks = list(range(topology.size)) if cluster else launcher.local_ranks(topology)
        run_dir = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}")
        run_dir.mkdir(parents=True, exist_ok=True)
        topology.to_yaml(run_dir / "topology.yaml")
        netns_info = {"netns": {"rate": str(cluster.rate)}} if cluster else {}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(
            {"train": config.to_dict(), "topology": topology.to_dict(), "ranks": ranks,
             **netns_info}, sort_keys=False))
        click.echo(f"{len(ranks)} peers, {topology.name or 'topology'}, strategy "
                   f"{config.strategy}, {config.rounds} rounds -> {run_dir}")
        procs = launcher.start_peers(ranks, run_dir,
                                     ["--topology", str(run_dir / "topology.yaml"),
                                      "--config", str(run_dir / "config.yaml")],
                                     wrap=cluster.command if cluster else None)
        with tqdm(total=config.rounds * len(ranks), unit="round", desc=config.strategy) as bar:
            try:
                launcher.watch(procs, on_progress=lambda done: bar.update(done - bar.n))
            except launcher.LaunchFailed as exc:
                bar.close()
                raise GossipError(f"{exc}; logs in {run_dir}") from None
    click.echo(_summary(run_dir, ranks))
    click.echo(f"run directory: {run_dir}")


def _summary(run_dir: Path, ranks: list[int]) -> str:
    from gossip.bench.harness import format_table
    from gossip.metrics import read_jsonl

    rows, last = [], {}
    for rank in ranks:
        records = read_jsonl(run_dir / f"peer-{rank}.jsonl")
        last[rank] = records[-1]
        tail = records[-10:]
        rows.append({"peer": rank, "loss": sum(r["loss"] for r in tail) / len(tail),
                     "accuracy": records[-1]["accuracy"], "bytes sent": records[-1]["bytes_sent"],
                     "bytes recv": records[-1]["bytes_recv"], "seconds": records[-1]["time"]})
    table = format_table(rows, ["peer", "loss", "accuracy", "bytes sent", "bytes recv", "seconds"])
    final = last[ranks[0]]
    mean_acc = sum(r["accuracy"] for r in rows) / len(rows)
    return (f"{table}\nmean test accuracy {mean_acc:.4f}; averaged model "
            f"{final['avg_accuracy']:.4f}; consensus distance {final['consensus']:.3g}")


@main.group()
def topology():
    """Inspect topology files."""


@topology.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
@_fail_cleanly
def topology_show(path):
    """Peers, degrees, edges, Metropolis-Hastings mixing matrix and spectral gap."""
    from gossip.topology import Topology

    click.echo(Topology.from_yaml(path).describe())


@main.group()
def bench():
    """Benchmarks measured side by side in one run (ratios, not absolute times)."""


def _size(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 1000, 1M or 25M") from None


def _bench_options(fn):
    for option in reversed([
        click.option("--peers", type=int, default=4, show_default=True),
        click.option("--size", default="1M", show_default=True,
                     help="float32 elements, e.g. 1M, 25M."),
        click.option("--reps", type=int, default=10, show_default=True,
                     help="Timed repetitions per trial (median taken)."),
        click.option("--trials", type=int, default=3, show_default=True,
                     help="Interleaved trials (median of per-trial ratios)."),
    ]):
        fn = option(fn)
    return fn


@bench.command("allreduce")
@_bench_options
@_fail_cleanly
def bench_allreduce(peers, size, reps, trials):
    """Our ring all-reduce vs torch.distributed gloo all-reduce (mean, in place)."""
    from gossip.bench import compare

    numel = _size(size)
    click.echo(f"all-reduce of {numel} float32 over {peers} local peers")
    compare.allreduce(peers, numel, reps=reps, trials=trials, echo=click.echo)


@bench.command("gossip")
@_bench_options
@_fail_cleanly
def bench_gossip(peers, size, reps, trials):
    """One dpsgd round on a ring vs a bare zero-copy pyzmq exchange of the same bytes."""
    from gossip.bench import compare

    numel = _size(size)
    click.echo(f"gossip round of {numel} float32 over {peers} local peers on a ring")
    compare.gossip_round(peers, numel, reps=reps, trials=trials, echo=click.echo)


@bench.command("compress")
@click.option("--size", default="25M", show_default=True, help="float32 elements, e.g. 1M, 25M.")
@click.option("--density", type=float, default=0.01, show_default=True,
              help="Fraction kept by the sparsifiers.")
@click.option("--reps", type=int, default=5, show_default=True,
              help="Timed repetitions (median taken).")
@click.option("--threads", type=int, help="torch intra-op threads (default: torch's).")
@_fail_cleanly
def bench_compress(size, density, reps, threads):
    """Every compressor's time and wire bytes on one tensor, top-k vs torch.topk."""
    import torch

    from gossip.bench import compress

    if threads:
        torch.set_num_threads(threads)
    compress.run(_size(size), density, reps=reps, echo=click.echo)
