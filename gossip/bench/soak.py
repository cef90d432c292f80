"""Soak: many rounds of dpsgd between local peers, watching for leaks.

Every peer samples its resident memory, open file descriptors, sockets and threads after a
warm-up (when the allocator holds its peak of in-flight messages: see
gossip/transport/malloc_tuning.py) and again at the end. A leak shows as growth between the two.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import get_context

import torch

from gossip.bench.harness import format_table, run_ranks
from gossip.errors import ConfigError
from gossip.ports import free_ports

_HOST = "127.0.0.1"


def process_usage() -> dict[str, int]:
    """This process's resident memory (bytes), descriptors, sockets and threads (Linux)."""
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listdir's own descriptor)
            pass
    return {"rss": rss_kib * 1024, "fds": len(fds), "sockets": sockets,
            "threads": len(os.listdir("/proc/self/task")), "py_threads": threading.active_count()}


def soak(peers: int, numel: int, rounds: int, *, warmup: int = 50, strategy: str = "dpsgd",
         timeout: float = 3600) -> list[dict]:
    """Per peer: usage after ``warmup`` rounds, half-way between that and the end, and after
    all ``rounds``, and seconds taken."""
    if rounds <= warmup:
        raise ConfigError(f"rounds ({rounds}) must exceed warmup ({warmup})")
    ports = free_ports(peers, _HOST)
    barrier = get_context("spawn").Barrier(peers)
    return run_ranks(_rank, peers, strategy, ports, numel, rounds, warmup, barrier, timeout,
                     timeout=timeout)


def _rank(rank, world, strategy, ports, numel, rounds, warmup, barrier, timeout) -> dict:
    from gossip.peer import Peer
    from gossip.topology import Topology

    topology = Topology.generate("ring", world, host=_HOST).relocated(ports=ports)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    before = process_usage()
    with Peer(rank, topology, strategy, timeout=timeout) as peer:
        barrier.wait(timeout)
        t0 = time.perf_counter()
        for round in range(rounds):
            peer.synchronize(x, round, out=x)
            if round == warmup - 1:
                start = process_usage()
            if round == (warmup + rounds) // 2 - 1:
                mid = process_usage()
        seconds = time.perf_counter() - t0
        end = process_usage()
    closed = process_usage()
    return {"before": before, "start": start, "mid": mid, "end": end, "closed": closed,
            "seconds": seconds, "finite": bool(torch.isfinite(x).all())}


def report(results: list[dict], rounds: int, warmup: int, echo=print) -> bool:
    """Print the per-peer table; True if RSS grew <= 5% and nothing else leaked."""
    rows, ok = [], True
    for rank, r in enumerate(results):
        start, end, before, closed = r["start"], r["end"], r["before"], r["closed"]
        growth = (end["rss"] - start["rss"]) / start["rss"]
        # A leak grows in both halves alike; the allocator reaching its peak late does not.
        late = (end["rss"] - r["mid"]["rss"]) / r["mid"]["rss"]
        leaked = (end["sockets"] != start["sockets"] or end["threads"] != start["threads"]
                  or end["fds"] != start["fds"] or closed["sockets"] > before["sockets"]
                  or closed["py_threads"] > before["py_threads"])
        ok &= growth <= 0.05 and not leaked and r["finite"]
        rows.append({"peer": rank, "rss start MB": start["rss"] / 1e6,
                     "rss end MB": end["rss"] / 1e6, "growth %": 100 * growth,
                     "2nd half %": 100 * late,
                     "sockets": f"{start['sockets']}->{end['sockets']}->{closed['sockets']}",
                     "threads": f"{start['threads']}->{end['threads']}->{closed['threads']}",
                     "fds": f"{start['fds']}->{end['fds']}->{closed['fds']}",
                     "rounds/s": (rounds / r["seconds"])})
    echo(format_table(rows, list(rows[0])))
    echo(f"start = after {warmup} warm-up rounds; 2nd half = growth from half-way to the end; "
         f"sockets/threads/fds: start -> end -> after "
         f"the peer closed. Target: RSS growth <= 5%, nothing leaked: "
         f"{'met' if ok else 'NOT met'}")
    return ok
