"""`gossip peer` (one rank) and `gossip launch` (every local rank); their training flags are
gossip/cli/flags.py's."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path

import click

from gossip.cli.common import (CHURN_HELP, DEFAULT_PEERS, GRAPH_OPTION, fail_cleanly, main,
                               run_topology)
from gossip.cli.flags import TOLERATE_HELP, TrainingCommand, train_config
from gossip.cluster.rate import DEFAULT_RATE
from gossip.errors import ConfigError, GossipError
from gossip.rendezvous.launchers import RANK_ENV


@main.command(cls=TrainingCommand)
@click.option("--rank", type=int, help=f"This peer's rank (default: ${' / $'.join(RANK_ENV)}).")
@click.option("--topology", "topology_path", required=True, type=click.Path(dir_okay=False),
              help="Topology YAML naming every peer's host and port (with --rendezvous: "
                   "the graph alone is enough).")
@click.option("--rendezvous", "rendezvous_uri", default="static", show_default=True,
              metavar="URI",
              help="Meet the other peers through a launcher instead of the topology's "
                   "addresses: env:// (torchrun, Kubernetes), slurm://[HOST:PORT], "
                   "tcp://HOST:PORT or file:///PATH; rank and size from the launcher.")
@click.option("--advertise", metavar="IP",
              help="With --rendezvous: the address other peers reach this one at (default: "
                   "the source address towards the store's host).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=".",
              help="Where this peer writes peer-RANK.jsonl.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--key", "key_file", type=click.Path(dir_okay=False),
              help="This peer's CURVE secret key, when the topology lists public keys "
                   "(default: peer-RANK.key in the topology's key directory).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="Where peer-RANK.pt is written (default: RUN_DIR/checkpoints).")
@click.option("--resume", is_flag=True,
              help="Restart this peer from its last checkpoint and rejoin the running peers "
                   "(dpsgd, matcha).")
@fail_cleanly
def peer(rank, topology_path, rendezvous_uri, advertise, run_dir, quiet, key_file,
         checkpoint_dir, resume, config_path, strategy_options, **flags):
    """Run one peer of a cluster (the same topology file on every machine)."""
    if rendezvous_uri != "static":  # before torch loads: c10d's retry logs (stack traces
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # included) bury our one line
    from tqdm import tqdm

    from gossip import checkpoint
    from gossip.crossover.connect import device_config
    from gossip.matrix import check_run
    from gossip.metrics import MetricsWriter, read_jsonl
    from gossip.peer import Peer
    from gossip.rendezvous.cli import Meeting
    from gossip.training.synchronous import train

    config = train_config(config_path, strategy_options, **flags)
    shared = device_config(config_path, arbiter=flags["arbiter"], device=flags["device"],
                           job=flags["job"])
    meeting = Meeting.parse(rendezvous_uri, rank, advertise=advertise, timeout=config.timeout,
                            join=config.join, spares=config.spares)
    rank, topology = meeting.rank, meeting.topology(topology_path)
    config.delays.check_ranks(topology.size)
    check_run(config, topology, arbiter=shared is not None,
              rendezvous=meeting.rendezvous is not None)
    metrics_path = Path(run_dir) / f"peer-{rank}.jsonl"
    checkpoint_path = checkpoint.path_for(checkpoint_dir or Path(run_dir) / "checkpoints", rank)
    history, resumed = [], ""
    if resume:  # fail before binding anything
        resumed = (f" resumed from the checkpoint of round "
                   f"{checkpoint.load(checkpoint_path, rank=rank)['round']}")
    if (resume or meeting.restarted) and metrics_path.exists():  # rewritten up to the round
        history = read_jsonl(metrics_path)                        # this peer rejoins at
    if not topology.trains(rank):
        # A server only (topology roles): no training, no metrics; the serve loop.
        with Peer(rank, topology, config.spec, timeout=config.timeout, key_file=key_file,
                  dead_after=config.dead_after, rendezvous=meeting.rendezvous) as node:
            node.serve()
        click.echo(f"peer {rank}: served until every worker said goodbye")
        return
    with Peer(rank, topology, config.spec, timeout=config.timeout, key_file=key_file,
              send_delay=config.delays.for_rank(rank, seed=config.seed).send_delay,
              attack=config.attack.for_rank(rank, seed=config.seed),
              dead_after=config.dead_after, keep_for_rejoin=config.checkpoint_every > 0,
              rendezvous=meeting.rendezvous, elastic=config.elastic,
              min_peers=config.min_peers, spares=config.spares) as node:
        if config.elastic:
            _leave_on_sigterm(node)
        agreed = meeting.settle(node, run_dir, config, checkpoint_path)
        if agreed is not None:
            resume, resumed = True, f" resumed from the checkpoint of round {agreed}"
        with MetricsWriter(metrics_path) as metrics, tqdm(
                total=config.rounds, desc=f"peer {rank}", disable=quiet, unit="round") as bar, \
                _device(shared, rank, node, config.timeout) as make_trainer:
            # To the record's round, not +1: a resumed peer starts where its checkpoint left.
            last = train(node, config, metrics=metrics, make_trainer=make_trainer,
                         on_round=lambda record: bar.update(record["round"] + 1 - bar.n),
                         checkpoint_path=checkpoint_path if config.checkpoint_every or resume
                         else None, resume=resume, history=history, resume_round=agreed)
    if not last:  # a restart that resumed at the last round: the job was already done
        click.echo(f"peer {rank}: no round left to train (rounds {config.rounds}) metrics "
                   f"{metrics_path}{resumed}")
        return
    lost = "".join(f" lost peer {r} (round {at})" for r, at in last["lost_peers"].items())
    test = "".join(f" {key} {last[key]:.4f}" for key in ("test_loss", "perplexity")
                   if last.get(key) is not None)  # a language model's (Task.metrics)
    click.echo(f"peer {rank}: loss {last['loss']:.4f}{test} accuracy {last['accuracy']:.4f} "
               f"bytes_sent {last['bytes_sent']} bytes_recv {last['bytes_recv']} "
               f"time {last['time']:.1f}s metrics {metrics_path}{lost}{resumed}")


def _leave_on_sigterm(node) -> None:
    """An elastic peer's first SIGTERM: finish the round under way, leave (the others go on
    without counting it dead), exit 0; a second one ends it at once."""
    def leave(signum, frame):
        node.request_leave()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, leave)


@contextlib.contextmanager
def _device(shared, rank: int, node, timeout: float):
    """The trainer factory of a peer on a shared device (None: the plain ``Trainer``)."""
    if shared is None:
        yield None
        return
    from gossip.crossover.trainer import DeviceTrainer

    with shared.open(rank, timeout=timeout, clock=node.clock) as lock:
        yield functools.partial(DeviceTrainer, device=lock)


@main.command(cls=TrainingCommand)
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="Topology YAML (default: a ring of --peers on 127.0.0.1, free ports).")
@click.option("--peers", type=int,
              help=f"Peers when no --topology is given (default {DEFAULT_PEERS}, or the "
                   f"size --graph-option implies: a torus's rows x cols).")
@click.option("--graph", default="ring", show_default=True,
              help="Graph when no --topology is given (ring, torus, complete, ...).")
@GRAPH_OPTION
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Run directory (default: runs/DATE-TIME-STRATEGY).")
@click.option("--netns", is_flag=True,
              help="Run every peer in its own network namespace with its own IP, links capped "
                   "at --rate (needs root and iproute2).")
@click.option("--rate", help="With --netns: cap of every link, each way, e.g. 100mbit, 1gbit, "
                             f"500kbit.  [default: {DEFAULT_RATE}]")
@click.option("--keys", "key_dir", type=click.Path(file_okay=False),
              help="Authenticate and encrypt with the CURVE keys in this directory "
                   "(from `gossip keys generate`).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="With --checkpoint-every: where the peers write peer-RANK.pt "
                   "(default: RUN_DIR/checkpoints).")
@click.option("--resume", is_flag=True,
              help="Restart the whole job from every peer's last checkpoint (use the run's "
                   "--run-dir, --topology and --config).")
@click.option("--tolerate-deaths", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help=TOLERATE_HELP)
@click.option("--churn", metavar="SCHEDULE",
              help=CHURN_HELP + " A leave is a SIGTERM, a kill a SIGKILL.")
@fail_cleanly
def launch(topology_path, peers, graph, graph_options, run_dir, netns, rate, key_dir,
           checkpoint_dir, resume, tolerate_deaths, churn, config_path, strategy_options,
           **flags):
    """Start every local peer, show progress, print a per-peer summary.

    With no arguments: the demo, 4 peers on a ring training the digits MLP with dpsgd.
    """
    from gossip.cli.summary import run_summary
    from gossip.crossover.connect import device_config
    from gossip.launching.plan import launch_run
    from gossip.launching.processes import LaunchFailed, check_deaths
    from gossip.matrix import check_run
    from gossip.ports import free_ports

    config = train_config(config_path, strategy_options, **flags)
    shared = device_config(config_path, arbiter=flags["arbiter"], device=flags["device"],
                           job=flags["job"])
    topology, config, events = run_topology(churn, config, topology_path, peers, graph,
                                            graph_options)
    if not topology_path:
        topology = topology.relocated(ports=free_ports(topology.size))
    if key_dir:
        topology = topology.with_keys(key_dir)
    config.delays.check_ranks(topology.size)
    check_run(config, topology, arbiter=shared is not None)  # before any peer starts
    if rate is not None and not netns:
        raise ConfigError("--rate: only with --netns (local peers share an uncapped loopback)")
    run_dir = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.strategy}")
    peer_args = []
    if checkpoint_dir:
        peer_args += ["--checkpoint-dir", str(Path(checkpoint_dir).absolute())]
    if resume:
        peer_args.append("--resume")

    def announce(placement):
        if placement.cluster:
            click.echo(placement.cluster.describe())
        click.echo(f"{len(placement.ranks)} peers, {placement.topology.name or 'topology'}, "
                   f"strategy {config.strategy}, {config.rounds} rounds -> {placement.run_dir}")

    try:
        result = launch_run(config, topology, run_dir,
                            rate=(rate or DEFAULT_RATE) if netns else None,
                            extra_config={"device": shared.to_dict()} if shared else None,
                            peer_args=peer_args, progress=config.strategy, on_ready=announce,
                            churn=events,
                            on_death=lambda death: click.echo(
                                f"{death.describe()}; the others go on"))
        click.echo(run_summary(run_dir, result.ranks, result.deaths))
        click.echo(f"run directory: {run_dir}")
        check_deaths(result.deaths, tolerate=tolerate_deaths)
    except LaunchFailed as exc:
        raise GossipError(f"{exc}; logs in {run_dir}") from None
