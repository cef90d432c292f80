"""Command line: `gossip peer | launch | experiment run | plot | topology show | keys | bench`."""

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
        click.option("--config", "config_path", type=click.Path(dir_okay=False),
                     help="YAML with training settings (a run directory's config.yaml)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _train_config(config_path, strategy_options, *, compute_delay=None, slowdown=(),
                  straggler_prob=None, straggler_mean=None, send_delay=(), delay_seed=None,
                  **flags):
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
    options = dict(base.get("options") or {})
    for item in strategy_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    base["options"] = options
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
@click.option("--key", "key_file", type=click.Path(dir_okay=False),
              help="This peer's CURVE secret key, when the topology lists public keys "
                   "(default: peer-RANK.key in the topology's key directory).")
@_train_options
@_fail_cleanly
def peer(rank, topology_path, run_dir, quiet, key_file, config_path, strategy_options, **flags):
    """Run one peer of a cluster (the same topology file on every machine)."""
    from tqdm import tqdm

    from gossip.metrics import MetricsWriter
    from gossip.peer import Peer
    from gossip.topology import Topology
    from gossip.training import train

    rank = _resolve_rank(rank)
    topology = Topology.from_yaml(topology_path)
    config = _train_config(config_path, strategy_options, **flags)
    config.delays.check_ranks(topology.size)
    metrics_path = Path(run_dir) / f"peer-{rank}.jsonl"
    with Peer(rank, topology, config.strategy, timeout=config.timeout, key_file=key_file,
              transport=_send_delayed(rank, topology, config, key_file),
              **config.options) as node, MetricsWriter(metrics_path) as metrics:
        with tqdm(total=config.rounds, desc=f"peer {rank}", disable=quiet, unit="round") as bar:
            last = train(node, config, metrics=metrics, on_round=lambda _: bar.update(1))
    click.echo(f"peer {rank}: loss {last['loss']:.4f} accuracy {last['accuracy']:.4f} "
               f"bytes_sent {last['bytes_sent']} bytes_recv {last['bytes_recv']} "
               f"time {last['time']:.1f}s metrics {metrics_path}")


def _send_delayed(rank: int, topology, config, key_file=None):
    """An open transport that sleeps before each send if the config delays this rank's
    sends, else None (the Peer opens a plain one)."""
    delay = config.delays.for_rank(rank, seed=config.seed).send_delay
    if not delay:
        return None
    from gossip.faults import DelayedTransport
    from gossip.training import PROBE_TAG
    from gossip.transport import ZmqTransport

    inner = ZmqTransport.for_topology(rank, topology, key_file=key_file,
                                      timeout=config.timeout).open()
    # The consensus probe measures the run; it is not part of the algorithm being delayed.
    return DelayedTransport(inner, delay, exempt=(f"{PROBE_TAG}.",))


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
@click.option("--keys", "key_dir", type=click.Path(file_okay=False),
              help="Authenticate and encrypt with the CURVE keys in this directory "
                   "(from `gossip keys generate`).")
@_train_options
@_fail_cleanly
def launch(topology_path, peers, graph, run_dir, netns, rate, key_dir, config_path,
           strategy_options, **flags):
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
    if key_dir:
        topology = topology.with_keys(key_dir)
    config.delays.check_ranks(topology.size)
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
        tail = [r["loss"] for r in records[-10:] if r["loss"] is not None] or [float("nan")]
        rows.append({"peer": rank, "loss": sum(tail) / len(tail),
                     "accuracy": records[-1]["accuracy"], "bytes sent": records[-1]["bytes_sent"],
                     "bytes recv": records[-1]["bytes_recv"], "seconds": records[-1]["time"]})
    table = format_table(rows, ["peer", "loss", "accuracy", "bytes sent", "bytes recv", "seconds"])
    final = last[ranks[0]]
    mean_acc = sum(r["accuracy"] for r in rows) / len(rows)
    return (f"{table}\nmean test accuracy {mean_acc:.4f}; averaged model "
            f"{final['avg_accuracy']:.4f}; consensus distance {final['consensus']:.3g}")


@main.group()
def experiment():
    """Experiments: several runs from one YAML file, then plots and a comparison table."""


@experiment.command("run")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory (default: runs/DATE-TIME-NAME).")
@click.option("--only", multiple=True, metavar="RUN",
              help="Run only this run of the file (repeatable); others already in --out stay.")
@_fail_cleanly
def experiment_run(path, out, only):
    """Run every run of the experiment file, then plot them (like `gossip plot OUT`)."""
    from gossip.experiment import load_experiment, report, run_experiment
    from gossip.experiment.runner import default_out

    spec = load_experiment(path)
    out = Path(out) if out else default_out(spec)
    click.echo(f"experiment {spec.name}: {len(spec.runs)} runs -> {out}")
    failed = run_experiment(spec, out, only=tuple(only), echo=click.echo)
    report(out, echo=click.echo)
    click.echo(f"experiment directory: {out}")
    if failed:
        raise GossipError(f"runs failed: {', '.join(failed)} (logs in their directories)")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--target-loss", type=float,
              help="Loss for the time-to-target column (default: the experiment's).")
@click.option("--baseline", multiple=True, metavar="RUN",
              help="Run the speed-ups are relative to (repeatable; default: the experiment's).")
@click.option("--smooth", type=int, help="Rounds in the loss moving average (default 10).")
@_fail_cleanly
def plot(run_dir, target_loss, baseline, smooth):
    """Loss vs time and vs bytes, accuracy vs round and vs bytes (PNG) of an experiment or
    launch directory, and the table: final loss and accuracy, bytes, time, time to target."""
    from gossip.experiment import report

    if smooth is not None and smooth < 1:
        raise ConfigError(f"--smooth: {smooth} must be >= 1")
    report(run_dir, target=target_loss, baselines=baseline or None, smooth=smooth,
           echo=click.echo)


@main.group()
def topology():
    """Inspect topology files."""


@topology.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--budget", metavar="C_B",
              help="Also plan MATCHA at this communication budget in (0, 1]: matchings, "
                   "activation probabilities, alpha and rho.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@_fail_cleanly
def topology_show(path, budget, as_json):
    """Peers, degrees, edges, Metropolis-Hastings mixing matrix and spectral gap; with
    --budget, MATCHA's matchings, probabilities, alpha and rho too."""
    import json

    from gossip.topology import Topology

    topo = Topology.from_yaml(path)
    plan = None
    if budget is not None:
        from gossip.topology import matcha

        try:  # parsed here, not by click, so a bad value is one line and exit 1
            value = float(budget)
        except ValueError:
            raise ConfigError(f"--budget: {budget!r} is not a number in (0, 1]") from None
        plan = matcha.plan(topo, value)
    if as_json:
        data = {"name": topo.name, "size": topo.size,
                "edges": [[a, b] for a, b in topo.edges()],
                "spectral_gap": topo.spectral_gap()}
        click.echo(json.dumps({**data, **(plan.to_dict() if plan else {})}))
    else:
        click.echo(topo.describe() + ("\n" + plan.describe() if plan else ""))


@main.group()
def keys():
    """CURVE keys that authenticate and encrypt peers."""


@keys.command("generate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write peer-R.key (secret, mode 0600) and peer-R.key.pub.")
@click.option("--peers", type=int, help="One keypair per rank 0..PEERS-1.")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="One keypair per rank of this topology file (instead of --peers).")
@click.option("--force", is_flag=True, help="Replace existing key files.")
@_fail_cleanly
def keys_generate(out_dir, peers, topology_path, force):
    """Write a fresh keypair per peer; name the directory in the topology (keys: DIR)."""
    from gossip import keys as curve_keys

    if (peers is None) == (topology_path is None):
        raise ConfigError("keys generate: give exactly one of --peers N or --topology FILE")
    if topology_path:
        from gossip.topology import Topology

        peers = Topology.from_yaml(topology_path).size
    if peers < 1:
        raise ConfigError(f"--peers: expected a positive number, got {peers}")
    written = curve_keys.generate(out_dir, range(peers), force=force)
    click.echo(f"{len(written) // 2} keypairs in {out_dir}: copy peer-R.key to rank R's machine "
               f"only; the *.pub files may go everywhere. Name them in the topology with "
               f"`keys: {out_dir}` (or each peer's public_key).")


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


@bench.command("sparse")
@click.option("--peers", default="4", show_default=True,
              help="Peers, or a comma list (e.g. 2,4,8) to show the growth with P.")
@click.option("--size", default="1M", show_default=True, help="float32 elements, e.g. 1M, 5M.")
@click.option("--density", type=float, default=0.01, show_default=True,
              help="Fraction kept by the sparse strategies.")
@click.option("--reps", type=int, default=5, show_default=True,
              help="Timed repetitions per contender, interleaved (median taken).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed repetitions.")
@click.option("--indices", type=click.Choice(["compact", "int32"]), default="compact",
              show_default=True, help="Index wire encoding of the sparse strategies.")
@click.option("--only", help="Comma list of contenders (default: ring-allreduce, "
                             "topk-allgather, gtopk, spardl); a sparse one may name its index "
                             "coding, e.g. spardl:int32.")
@click.option("--netns", is_flag=True,
              help="Every peer in its own network namespace, links capped at --rate "
                   "(needs root and iproute2).")
@click.option("--rate", help="With --netns: cap of every link, each way.  [default: 1gbit]")
@_fail_cleanly
def bench_sparse(peers, size, density, reps, warmup, indices, only, netns, rate):
    """Dense ring all-reduce, topk-allgather, gtopk and spardl: time and bytes per peer."""
    from gossip.bench import sparse

    try:
        counts = [int(p) for p in peers.split(",")]
    except ValueError:
        raise click.BadParameter(f"{peers!r} is not a number of peers or a comma list") \
            from None
    numel = _size(size)
    contenders = only.split(",") if only else list(sparse.CONTENDERS)
    click.echo(sparse.describe(counts, numel, density, netns=netns, rate=rate))
    results = {}
    for count in counts:
        results[count] = sparse.run(count, numel, density, reps=reps, warmup=warmup,
                                    contenders=contenders, indices=indices, netns=netns,
                                    rate=rate)
    click.echo(sparse.time_table(results))
    click.echo("\nwhere the sparse strategies' time goes (ms, mean over peers of medians):")
    click.echo(sparse.phase_table(results))


@bench.command("soak")
@click.option("--peers", type=int, default=8, show_default=True)
@click.option("--size", default="1M", show_default=True, help="float32 elements per peer.")
@click.option("--rounds", type=int, default=2000, show_default=True)
@click.option("--warmup", type=int, default=50, show_default=True,
              help="Rounds before the start sample (the allocator reaches its peak).")
@_fail_cleanly
def bench_soak(peers, size, rounds, warmup):
    """Many dpsgd rounds on a ring; RSS, sockets, threads and descriptors per peer."""
    from gossip.bench import soak

    click.echo(f"soak: {rounds} dpsgd rounds of {_size(size)} float32 over {peers} local peers")
    results = soak.soak(peers, _size(size), rounds, warmup=warmup)
    if not soak.report(results, rounds, warmup, echo=click.echo):
        raise SystemExit(1)
