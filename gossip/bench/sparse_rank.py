"""One rank of ``gossip bench sparse``: time every contender's synchronize, interleaved.

Run as ``python -m gossip.bench.sparse_rank --rank R --topology FILE ...`` (the driver in
``gossip.bench.sparse`` starts one per rank, in its own network namespace with ``--netns``).
Before every timed call the peers meet at a barrier (a ring all-reduce of one float with its
own tag), so all start together. Prints one JSON line: per contender and repetition, the
seconds, the bytes this peer sent and received, and the sparse strategies' phase timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import torch

from gossip.errors import ConfigError
from gossip.strategies import EXACT_MEAN, STRATEGIES
from gossip.strategies.sparse.options import INDEX_CODINGS as CODINGS
from gossip.strategies.sparse.timings import Timings
from gossip.transport import codec


def sparse_strategies() -> list[str]:
    """The registered sparse all-reduce strategies: those with a density and an index
    coding among their options."""
    return [name for name in STRATEGIES.names()
            if {"density", "indices"} <= set(STRATEGIES.entry(name).options.names())]


def contenders() -> list[str]:
    """Contenders by default: the dense exact ring, then every sparse all-reduce; a sparse
    one may name its index coding, e.g. ``spardl:int32``."""
    return [EXACT_MEAN, *sparse_strategies()]


def parse_contender(name: str) -> tuple[str, str | None]:
    """``"spardl:int32"`` -> ("spardl", "int32"); ConfigError naming what exists."""
    strategy, _, coding = name.partition(":")
    known, sparse = contenders(), sparse_strategies()
    if strategy not in known or coding and (strategy not in sparse or coding not in CODINGS):
        raise ConfigError(f"unknown contender {name!r}: expected one of {', '.join(known)}, "
                         f"a sparse one optionally with :{' or :'.join(CODINGS)}")
    return strategy, coding or None


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)  # P peers share few cores; torch's pool would oversubscribe them
    from gossip.peer import Peer
    from gossip.topology import Topology

    topology = Topology.from_yaml(args.topology)
    names = args.contenders.split(",")
    x = torch.randn(args.size, generator=torch.Generator().manual_seed(args.rank))
    with Peer(args.rank, topology, EXACT_MEAN, timeout=args.timeout, tag="barrier") as peer:
        barrier = peer.strategy
        one = torch.zeros(1)
        strategies = {}
        for name in names:
            strategy, coding = parse_contender(name)
            options = ({"density": args.density, "indices": coding or args.indices}
                       if strategy in sparse_strategies() else {})
            strategies[name] = peer.add_strategy(strategy, tag=name.replace(":", "-"), **options)
        received = _count_received(peer.transport)
        buffers = {name: torch.empty_like(x) for name in names}
        results: dict[str, list[dict]] = {name: [] for name in names}
        meetings = 0
        for rep in range(args.warmup + args.reps):
            for name in names:
                buf = buffers[name]
                buf.copy_(x)
                barrier.synchronize(one, meetings, out=one)
                meetings += 1
                before, got = peer.stats, _total(received, strategies[name].kinds)
                start, cpu = time.perf_counter(), time.process_time()
                # Dense: in place, as torch.distributed does; sparse: into a second buffer.
                sparse = name.partition(":")[0] in sparse_strategies()
                strategies[name].synchronize(x if sparse else buf, rep, out=buf)
                seconds = time.perf_counter() - start
                cpu = time.process_time() - cpu  # all threads of the process, zmq's included
                after = peer.stats
                if rep >= args.warmup:
                    results[name].append({
                        "seconds": seconds,
                        "cpu": cpu,
                        "sent": after["bytes_sent"] - before["bytes_sent"],
                        "recv": _total(received, strategies[name].kinds) - got,
                        "phases": dict(getattr(strategies[name], "timings", {})),
                        "phases_cpu": dict(getattr(strategies[name], "timings", Timings()).cpu),
                    })
        barrier.synchronize(one, meetings, out=one)
    json.dump({"rank": args.rank, "results": results}, sys.stdout)
    sys.stdout.write("\n")


def _count_received(transport) -> Counter:
    """Bytes (header + frames) of the messages ``transport.recv`` hands out, by kind.

    The transport's own counter counts a message when it reads it off the socket, which may
    be during another contender's call; a message is handed out exactly once, to its reader.
    """
    counts: Counter = Counter()
    recv = transport.recv

    def counting_recv(**kwargs):
        msg = recv(**kwargs)
        header, frames = codec.encode(msg, msg.src)  # the same header, re-encoded
        counts[msg.kind] += len(header) + sum(f.numel() for f in frames)
        return msg

    transport.recv = counting_recv
    return counts


def _total(counts: Counter, kinds) -> int:
    return sum(counts[kind] for kind in kinds)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gossip.bench.sparse_rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--density", type=float, required=True)
    parser.add_argument("--indices", default="compact")
    parser.add_argument("--contenders", default=",".join(contenders()))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    return parser


if __name__ == "__main__":
    main()
