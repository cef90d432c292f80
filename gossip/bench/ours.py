"""Time gossip's own strategies the same way the baselines are timed: one process per rank,
barrier, one synchronize, max over ranks."""

from __future__ import annotations

import time
from collections.abc import Mapping
from multiprocessing import get_context
from typing import Any

import torch

from gossip.bench.baselines import max_over_ranks
from gossip.bench.harness import run_ranks
from gossip.ports import free_ports

_HOST = "127.0.0.1"


def strategy_times(strategy: str, world: int, numel: int, *, graph: str = "ring",
                   reps: int = 10, warmup: int = 2, options: Mapping[str, Any] | None = None,
                   local_ipc: bool = True, dtype: torch.dtype = torch.float32,
                   timeout: float = 300, threads: int | None = 1) -> list[float]:
    """Per repetition, the slowest rank's time for one ``peer.synchronize`` of ``numel`` values.

    Args:
        strategy: Registered strategy name.
        world: Number of peers, one process each.
        numel: Tensor length.
        graph: Topology generator kind for the peers' graph.
        options: Strategy options.
        local_ipc: Let same-host peers use Unix sockets (False: plain TCP on loopback).
        threads: OMP_NUM_THREADS of every rank; None leaves torch its default (one thread
            per core), as a library user who sets nothing has it.
    """
    ports = free_ports(world, _HOST)
    barrier = get_context("spawn").Barrier(world)
    per_rank = run_ranks(_rank, world, strategy, graph, ports, numel, reps, warmup,
                         dict(options or {}), local_ipc, dtype, barrier, timeout, timeout=timeout,
                         env=_thread_env(threads))
    return max_over_ranks(per_rank)


def _thread_env(threads: int | None) -> dict[str, str | None]:
    value = None if threads is None else str(threads)
    return {"OMP_NUM_THREADS": value, "MKL_NUM_THREADS": value}


def _rank(rank: int, world: int, strategy: str, graph: str, ports, numel: int, reps: int,
          warmup: int, options: dict, local_ipc: bool, dtype: torch.dtype, barrier,
          timeout: float) -> list[float]:
    from gossip.peer import Peer
    from gossip.topology import Topology

    topology = Topology.generate(graph, world, host=_HOST).relocated(ports=ports)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=dtype)
    with Peer(rank, topology, strategy, timeout=timeout, local_ipc=local_ipc, **options) as peer:
        barrier.wait(timeout)
        for r in range(warmup):
            peer.synchronize(x, r, out=x)
        times = []
        for r in range(warmup, warmup + reps):
            barrier.wait(timeout)
            t0 = time.perf_counter()
            # In place, like torch.distributed.all_reduce, so both do the same work.
            peer.synchronize(x, r, out=x)
            times.append(time.perf_counter() - t0)
        barrier.wait(timeout)
    return times
