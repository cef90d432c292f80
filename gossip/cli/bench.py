"""`gossip bench ...`: measurements side by side in one run (ratios, not absolute times)."""

from __future__ import annotations

import click

from gossip.cli.common import declared_option, fail_cleanly, main, parse_size
from gossip.cluster.rate import DEFAULT_RATE

SPARSE = "gossip.bench.sparse:run"  # declares `bench sparse`'s defaults


@main.group()
def bench():
    """Benchmarks measured side by side in one run (ratios, not absolute times)."""


def _bench_options(fn):
    for option in reversed([
        click.option("--peers", type=int, default=4, show_default=True),
        click.option("--size", default="1M", show_default=True,
                     help="float32 elements, e.g. 1M, 25M."),
        click.option("--reps", type=int, default=10, show_default=True,
                     help="Timed repetitions per trial (median taken)."),
        click.option("--trials", type=int, default=5, show_default=True,
                     help="Interleaved trials (median of per-trial ratios); shared machines "
                          "swing by 10-20% between trials, so fewer are not worth reading."),
    ]):
        fn = option(fn)
    return fn


@bench.command("allreduce")
@_bench_options
@fail_cleanly
def bench_allreduce(peers, size, reps, trials):
    """Our ring all-reduce vs torch.distributed gloo all-reduce (mean, in place)."""
    from gossip.bench import compare

    numel = parse_size(size)
    click.echo(f"all-reduce of {numel} float32 over {peers} local peers")
    compare.allreduce(peers, numel, reps=reps, trials=trials, echo=click.echo)


@bench.command("gossip")
@_bench_options
@click.option("--compressor", help="Also time dpsgd with this compressor (CHOCO-Gossip), "
                                   "e.g. topk; ratios are then to the dense dpsgd round.")
@click.option("--density", type=float, help="The compressor's density (sparsifiers).")
@fail_cleanly
def bench_gossip(peers, size, reps, trials, compressor, density):
    """One dpsgd round on a ring vs a bare zero-copy pyzmq exchange of the same bytes."""
    from gossip.bench import compare

    numel = parse_size(size)
    if density is not None and compressor is None:
        raise click.BadParameter("--density needs --compressor", param_hint="--density")
    click.echo(f"gossip round of {numel} float32 over {peers} local peers on a ring")
    if compressor is None:
        compare.gossip_round(peers, numel, reps=reps, trials=trials, echo=click.echo)
        return
    options = {"compressor": compressor}
    if density is not None:
        options["density"] = density
    compare.compressed_gossip_round(peers, numel, options, reps=reps, trials=trials,
                                    echo=click.echo)


@bench.command("compress")
@click.option("--size", default="25M", show_default=True, help="float32 elements, e.g. 1M, 25M.")
@click.option("--density", type=float, default=0.01, show_default=True,
              help="Fraction kept by the sparsifiers.")
@declared_option("--reps", source="gossip.bench.compress:run", field="reps", type=int,
                 help="Timed repetitions (median taken).")
@click.option("--threads", type=int, help="torch intra-op threads (default: torch's).")
@fail_cleanly
def bench_compress(size, density, reps, threads):
    """Every compressor's time and wire bytes on one tensor, top-k vs torch.topk."""
    import torch

    from gossip.bench import compress

    if threads:
        torch.set_num_threads(threads)
    compress.run(parse_size(size), density, reps=reps, echo=click.echo)


@bench.command("sparse")
@click.option("--peers", default="4", show_default=True,
              help="Peers, or a comma list (e.g. 2,4,8) to show the growth with P.")
@click.option("--size", default="1M", show_default=True, help="float32 elements, e.g. 1M, 5M.")
@click.option("--density", type=float, default=0.01, show_default=True,
              help="Fraction kept by the sparse strategies.")
@declared_option("--reps", source=SPARSE, field="reps", type=int,
                 help="Timed repetitions per contender, interleaved (median taken).")
@declared_option("--warmup", source=SPARSE, field="warmup", type=int,
                 help="Untimed repetitions.")
@declared_option("--indices", source=SPARSE, field="indices",
                 type=click.Choice(["compact", "int32"]),
                 help="Index wire encoding of the sparse strategies.")
@click.option("--only", help="Comma list of contenders (default: the exact ring all-reduce "
                             "and every sparse all-reduce strategy); a sparse one may name its "
                             "index coding, e.g. spardl:int32.")
@click.option("--netns", is_flag=True,
              help="Every peer in its own network namespace, links capped at --rate "
                   "(needs root and iproute2).")
@click.option("--rate",
              help=f"With --netns: cap of every link, each way.  [default: {DEFAULT_RATE}]")
@fail_cleanly
def bench_sparse(peers, size, density, reps, warmup, indices, only, netns, rate):
    """Dense ring all-reduce, topk-allgather, gtopk and spardl: time and bytes per peer."""
    from gossip.bench import sparse

    try:
        counts = [int(p) for p in peers.split(",")]
    except ValueError:
        raise click.BadParameter(f"{peers!r} is not a number of peers or a comma list") \
            from None
    numel = parse_size(size)
    contenders = only.split(",") if only else sparse.default_contenders()
    click.echo(sparse.describe(counts, numel, density, netns=netns, rate=rate))
    results = {}
    for count in counts:
        results[count] = sparse.run(count, numel, density, reps=reps, warmup=warmup,
                                    contenders=contenders, indices=indices, netns=netns,
                                    rate=rate)
    click.echo(sparse.time_table(results))
    click.echo("\nwhere the sparse strategies' time goes (ms, mean over peers of medians):")
    click.echo(sparse.phase_table(results))


@bench.command("gpu")
@click.option("--sizes", default="1,4,16,64,256,512", show_default=True,
              help="Copy sizes in MB for the bandwidth part (a).")
@click.option("--size", default="25M", show_default=True,
              help="float32 elements of the top-k (c) and all-reduce (d) parts.")
@click.option("--density", type=float, default=0.01, show_default=True)
@click.option("--peers", type=int, default=4, show_default=True,
              help="Peers sharing the GPU in part (d).")
@click.option("--exchange-mb", type=int, default=256, show_default=True,
              help="MB sent device to device in part (b).")
@click.option("--reps", type=int, default=5, show_default=True,
              help="Timed repetitions (median taken).")
@fail_cleanly
def bench_gpu(sizes, size, density, peers, exchange_mb, reps):
    """Device tensors through host memory: copies, a pipelined exchange, device top-k and
    all-reduces of CUDA tensors vs gloo, each next to its physical bound. Needs CUDA."""
    from gossip.bench import gpu

    try:
        sizes_mb = [int(s) for s in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"{sizes!r} is not a comma list of MB", param_hint="--sizes") \
            from None
    gpu.run(sizes_mb=sizes_mb, numel=parse_size(size), density=density, peers=peers,
            reps=reps, exchange_mb=exchange_mb, echo=click.echo)


@bench.command("soak")
@click.option("--peers", type=int, default=8, show_default=True)
@click.option("--size", default="1M", show_default=True, help="float32 elements per peer.")
@click.option("--rounds", type=int, default=2000, show_default=True)
@declared_option("--warmup", source="gossip.bench.soak:soak", field="warmup", type=int,
                 help="Rounds before the start sample (the allocator reaches its peak).")
@fail_cleanly
def bench_soak(peers, size, rounds, warmup):
    """Many dpsgd rounds on a ring; RSS, sockets, threads and descriptors per peer."""
    from gossip.bench import soak

    click.echo(f"soak: {rounds} dpsgd rounds of {parse_size(size)} float32 over {peers} local peers")
    results = soak.soak(peers, parse_size(size), rounds, warmup=warmup)
    if not soak.report(results, rounds, warmup, echo=click.echo):
        raise SystemExit(1)
