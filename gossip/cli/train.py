"""`gossip peer` (one rank) and `gossip launch` (every local rank), with the training flags they share."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import click

from gossip.cli.common import (DEFAULT_PEERS, GRAPH_OPTION, fail_cleanly, generated_topology,
                               key_values, main)
from gossip.errors import ConfigError, GossipError
from gossip.rendezvous.launchers import RANK_ENV


TOLERATE_HELP = ("Exit 0 even if up to N peers died (the run exits non-zero when a peer it "
                 "did not kill itself died).")


def _train_options(fn):
    """Training flags shared by `peer` and `launch`; unset flags keep the config's value."""
    options = [
        click.option("--strategy", help="Synchronization strategy, e.g. dpsgd, ring-allreduce."),
        click.option("--rounds", type=int, help="Synchronized steps per peer."),
        click.option("--budget-samples", type=int, metavar="N",
                     help="Asynchronous strategies: a peer also stops after N samples."),
        click.option("--budget-seconds", type=float, metavar="SECONDS",
                     help="Asynchronous strategies: a peer also stops after SECONDS."),
        click.option("--snapshot-seconds", type=float, metavar="SECONDS",
                     help="Asynchronous strategies: each peer saves its model every SECONDS "
                          "for the consensus (0: no snapshots). Default 2."),
        click.option("--lr", type=float, help="Learning rate (0: pure gossip, no training "
                                              "step)."),
        click.option("--batch-size", type=int, help="Samples per local step."),
        click.option("--partition", help="Data split over peers: iid or dirichlet."),
        click.option("--alpha", type=float, help="Dirichlet concentration (non-iid skew)."),
        click.option("--seed", type=int, help="Seed of data split, init and batches."),
        click.option("--timeout", type=float,
                     help="Seconds to wait for a peer's message (ps and adpsgd wait as long "
                          "as the peer is alive)."),
        click.option("--dead-after", type=float, metavar="SECONDS",
                     help="Declare a peer dead once its connection stayed broken this long "
                          "(gossip drops it, all-reduce stops naming it). Default 5."),
        click.option("--checkpoint-every", type=int, metavar="N",
                     help="Write each peer's checkpoint every N rounds (0: never); a peer "
                          "restarted with `gossip peer --resume` rejoins from it."),
        click.option("--option", "strategy_options", multiple=True, metavar="KEY=VALUE",
                     help="Strategy option, repeatable (e.g. piece_bytes=1048576)."),
        click.option("--minibatches", type=int,
                     help="Split each batch into this many mini-batches (gradients accumulated; "
                          "nonblocking may stop early)."),
        click.option("--compute-delay", type=float, metavar="SECONDS",
                     help="Emulated compute time slept per mini-batch (a slower device)."),
        click.option("--slowdown", multiple=True, metavar="RANK:FACTOR",
                     help="Rank's mini-batches take FACTOR times as long, repeatable."),
        click.option("--straggler-prob", type=float,
                     help="Probability that a mini-batch is hit by a straggler delay."),
        click.option("--straggler-mean", type=float, metavar="SECONDS",
                     help="Mean of the (exponential) straggler delay."),
        click.option("--send-delay", multiple=True, metavar="[RANK:]SECONDS",
                     help="Sleep before every send: SECONDS for all ranks, or RANK:SECONDS, "
                          "repeatable."),
        click.option("--delay-seed", type=int, help="Seed of the straggler draws (default --seed)."),
        click.option("--attack", multiple=True, metavar="RANK:KIND[,KEY=VALUE...]",
                     help="Rank attacks: signflip, gaussian (sigma), alie (z), ipm (epsilon), "
                          "dissensus (epsilon), labelflip, stale (k); repeatable."),
        click.option("--arbiter", metavar="ADDRESS",
                     help="Share each peer's device with other jobs through this arbiter: "
                          "ipc://PATH or tcp://HOST:PORT (`gossip arbiter`), flock:DIR, "
                          "slices:DIR."),
        click.option("--device", metavar="NAME",
                     help="With --arbiter: the device, {rank} replaced by the rank "
                          "(default dev{rank})."),
        click.option("--job", metavar="NAME",
                     help="With --arbiter: this job's name among those sharing the devices "
                          "(turns go by name)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     help="YAML with training settings (a run directory's config.yaml)."),
        click.option("--task", help="Task: digits, deep-mlp, or package.module:factory."),
        click.option("--task-option", "task_options", multiple=True, metavar="KEY=VALUE",
                     help="Task factory option, repeatable (e.g. width=1024, depth=8)."),
        click.option("--layer-delay", type=float, metavar="SECONDS",
                     help="Emulated device: each layer sleeps this in forward, twice in "
                          "backward."),
        click.option("--overlap/--no-overlap", default=None,
                     help="Overlap synchronization with forward/backward (Peer.attach)."),
        click.option("--bucket-mb", type=float, metavar="MIB",
                     help="With --overlap: gradient bucket size (default 4)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _train_config(config_path, strategy_options, *, compute_delay=None, slowdown=(),
                  straggler_prob=None, straggler_mean=None, send_delay=(), delay_seed=None,
                  arbiter=None, device=None, job=None, task_options=(), attack=(), **flags):
    from gossip.config import TrainConfig

    base = TrainConfig.from_yaml(config_path).to_dict() if config_path else {}
    base.update({k: v for k, v in flags.items() if v is not None})
    delays = dict(base.get("delays") or {})
    for key, value in (("compute", compute_delay), ("straggler_prob", straggler_prob),
                       ("straggler_mean", straggler_mean), ("seed", delay_seed)):
        if value is not None:
            delays[key] = value
    if slowdown:
        delays["slowdown"] = _rank_values("--slowdown", slowdown)
    if send_delay:
        if len(send_delay) == 1 and ":" not in send_delay[0]:
            delays["send_delay"] = _float("--send-delay", send_delay[0])
        else:
            delays["send_delay"] = _rank_values("--send-delay", send_delay)
    base["delays"] = delays
    if attack:
        base["attack"] = list(attack)
    base["options"] = key_values("--option", base.get("options"), strategy_options)
    base["task_options"] = key_values("--task-option", base.get("task_options"), task_options)
    return TrainConfig.from_dict(base, source=config_path or "command line")


def _float(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a number") from None


def _rank_values(flag: str, items) -> dict[int, float]:
    """``("3:2.0", ...)`` -> ``{3: 2.0, ...}``; ConfigError naming the flag otherwise."""
    out = {}
    for item in items:
        rank, sep, value = item.partition(":")
        if not sep or not rank.strip().isdigit():
            raise ConfigError(f"{flag} {item!r}: expected RANK:VALUE, e.g. 3:2.0")
        out[int(rank)] = _float(flag, value)
    return out


@main.command()
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
@_train_options
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

    config = _train_config(config_path, strategy_options, **flags)
    shared = device_config(config_path, arbiter=flags["arbiter"], device=flags["device"],
                           job=flags["job"])
    meeting = Meeting.parse(rendezvous_uri, rank, advertise=advertise, timeout=config.timeout)
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
        with Peer(rank, topology, config.strategy, timeout=config.timeout, key_file=key_file,
                  dead_after=config.dead_after, rendezvous=meeting.rendezvous,
                  **config.options) as node:
            node.serve()
        click.echo(f"peer {rank}: served until every worker said goodbye")
        return
    with Peer(rank, topology, config.strategy, timeout=config.timeout, key_file=key_file,
              send_delay=config.delays.for_rank(rank, seed=config.seed).send_delay,
              attack=config.attack.for_rank(rank, seed=config.seed),
              dead_after=config.dead_after, keep_for_rejoin=config.checkpoint_every > 0,
              rendezvous=meeting.rendezvous, **config.options) as node:
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
    click.echo(f"peer {rank}: loss {last['loss']:.4f} accuracy {last['accuracy']:.4f} "
               f"bytes_sent {last['bytes_sent']} bytes_recv {last['bytes_recv']} "
               f"time {last['time']:.1f}s metrics {metrics_path}{lost}{resumed}")


@contextlib.contextmanager
def _device(shared, rank: int, node, timeout: float):
    """The trainer factory of a peer on a shared device (None: the plain ``Trainer``)."""
    if shared is None:
        yield None
        return
    from gossip.crossover.trainer import DeviceTrainer

    with shared.open(rank, timeout=timeout, clock=node.clock) as lock:
        yield functools.partial(DeviceTrainer, device=lock)


@main.command()
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
                             "500kbit.  [default: 1gbit]")
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
@_train_options
@fail_cleanly
def launch(topology_path, peers, graph, graph_options, run_dir, netns, rate, key_dir,
           checkpoint_dir, resume, tolerate_deaths, config_path, strategy_options, **flags):
    """Start every local peer, show progress, print a per-peer summary.

    With no arguments: the demo, 4 peers on a ring training the digits MLP with dpsgd.
    """
    from gossip.cli.summary import run_summary
    from gossip.crossover.connect import device_config
    from gossip.launching.plan import launch_run
    from gossip.launching.processes import LaunchFailed, check_deaths
    from gossip.matrix import check_run
    from gossip.ports import free_ports
    from gossip.topology import Topology

    config = _train_config(config_path, strategy_options, **flags)
    shared = device_config(config_path, arbiter=flags["arbiter"], device=flags["device"],
                           job=flags["job"])
    if topology_path:
        topology = Topology.from_yaml(topology_path)
    else:
        topology = generated_topology(graph, peers, graph_options)
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
        result = launch_run(config, topology, run_dir, rate=(rate or "1gbit") if netns else None,
                            extra_config={"device": shared.to_dict()} if shared else None,
                            peer_args=peer_args, progress=config.strategy, on_ready=announce,
                            on_death=lambda death: click.echo(
                                f"{death.describe()}; the others go on"))
        click.echo(run_summary(run_dir, result.ranks, result.deaths))
        click.echo(f"run directory: {run_dir}")
        check_deaths(result.deaths, tolerate=tolerate_deaths)
    except LaunchFailed as exc:
        raise GossipError(f"{exc}; logs in {run_dir}") from None
