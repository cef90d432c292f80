"""Communication baselines that gossip transports are measured against.

Two reference points, both on one machine over loopback TCP:

* :func:`gloo_allreduce_times` -- ``torch.distributed`` all-reduce with the gloo
  backend, i.e. what a conventional data-parallel job pays per step.
* :func:`zmq_exchange_times` -- the floor for any ZeroMQ gossip design: every rank
  pushes one raw float32 buffer to each neighbour and pulls one from each, zero-copy,
  with no framing, serialization or averaging.

Both return one wall-clock time per repetition, taken as the maximum over ranks
because a collective/exchange round is finished only when its slowest rank is.

Run ``python -m gossip.bench.baselines --help`` for a small command-line table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing import get_context
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq

from gossip.bench.harness import format_table, run_ranks, summarize
from gossip.errors import BenchmarkFailed, ConfigError
from gossip.ports import free_ports

_HOST = "127.0.0.1"
# Elements compared one by one in the gloo correctness check; the rest of the tensor
# is covered by a checksum so the check stays cheap for 25M-element tensors.
_CHECK_PREFIX = 1024


def max_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-repetition maximum over ranks."""
    return [max(rep) for rep in zip(*per_rank)]


# --------------------------------------------------------------------------- gloo


def gloo_allreduce_times(
    world: int,
    numel: int,
    *,
    reps: int = 10,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    timeout: float = 300,
) -> list[float]:
    """Time mean all-reduces of a ``numel``-element tensor with the gloo backend.

    Each repetition is ``barrier; t0; all_reduce(SUM); div_(world); t1`` on every
    rank. The result is verified once against the true mean before timing.

    Args:
        world: Number of ranks (processes).
        numel: Elements in each rank's tensor.
        reps: Timed repetitions.
        warmup: Untimed repetitions before the timed ones (after the check).
        dtype: A floating-point dtype for the tensor.
        timeout: Seconds for the whole run (also the process-group timeout).

    Returns:
        ``reps`` durations in seconds, each the maximum over ranks.

    Raises:
        ConfigError: On a non-floating ``dtype`` or non-positive sizes.
        BenchmarkFailed: If a rank fails (including a wrong all-reduce result) or the
            run times out.
    """
    _check_sizes(world, numel, reps, warmup)
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype must be floating point, got {dtype}")
    (port,) = free_ports(1, _HOST)
    per_rank = run_ranks(
        _gloo_rank, world, port, numel, reps, warmup, dtype, timeout, timeout=timeout
    )
    return max_over_ranks(per_rank)


def _gloo_rank(
    rank: int,
    world: int,
    port: int,
    numel: int,
    reps: int,
    warmup: int,
    dtype: torch.dtype,
    timeout: float,
) -> list[float]:
    """One gloo rank: set up the group, check once, warm up, time ``reps`` rounds."""
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://{_HOST}:{port}",
        timeout=timedelta(seconds=timeout),
    )
    try:
        gen = torch.Generator().manual_seed(1000 + rank)
        tensor = torch.randn(numel, generator=gen, dtype=dtype)
        _check_gloo_mean(tensor, world)
        for _ in range(warmup):
            _gloo_mean_(tensor, world)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            _gloo_mean_(tensor, world)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        dist.destroy_process_group()


def _gloo_mean_(tensor: torch.Tensor, world: int) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor.div_(world)


def _check_gloo_mean(tensor: torch.Tensor, world: int) -> None:
    """All-reduce ``tensor`` in place once and raise if it is not the mean.

    A prefix is compared element-wise against the all-gathered inputs; the whole
    tensor is covered by comparing its sum with the mean of the inputs' sums.
    """
    prefix = tensor[:_CHECK_PREFIX].clone()
    gathered = [torch.empty_like(prefix) for _ in range(world)]
    dist.all_gather(gathered, prefix)
    # Sum and absolute sum over all ranks' inputs, in float64.
    totals = torch.stack(
        [tensor.sum(dtype=torch.float64), tensor.abs().sum(dtype=torch.float64)]
    )
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)

    _gloo_mean_(tensor, world)

    # Summing ``world`` values in ``dtype`` and dividing errs by at most about
    # ``world * eps`` times the largest input magnitude; allow twice that.
    eps = torch.finfo(tensor.dtype).eps
    inputs = torch.stack(gathered).to(torch.float64)
    expected_prefix = inputs.mean(dim=0)
    bound = 2 * world * eps * inputs.abs().amax(dim=0) + 1e-12
    error = (tensor[:_CHECK_PREFIX].to(torch.float64) - expected_prefix).abs()
    if bool((error > bound).any()):
        raise BenchmarkFailed(
            f"gloo all-reduce result differs from the mean: max error "
            f"{error.max().item():.3g} in the first {error.numel()} elements"
        )
    got_sum = tensor.sum(dtype=torch.float64).item()
    expected_sum = totals[0].item() / world
    # The per-element bound summed over all elements (sum_j max_i |x_ij| is at most
    # the total absolute sum): loose, but a missing or doubled rank exceeds it.
    tol = 2 * world * eps * totals[1].item() + 1e-9
    if abs(got_sum - expected_sum) > tol:
        raise BenchmarkFailed(
            f"gloo all-reduce result differs from the mean: sum {got_sum} != {expected_sum}"
        )


# ---------------------------------------------------------------------------- zmq


def ring_neighbors(rank: int, world: int) -> tuple[int, ...]:
    """Ring neighbours of ``rank``: sorted distinct ``{rank-1, rank+1} mod world``.

    ``rank`` itself is excluded, so world 1 has no neighbours and world 2 has one.
    """
    return tuple(sorted({(rank - 1) % world, (rank + 1) % world} - {rank}))


def zmq_exchange_times(
    world: int,
    numel: int,
    *,
    neighbors: Callable[[int, int], Sequence[int]] = ring_neighbors,
    reps: int = 10,
    warmup: int = 2,
    timeout: float = 300,
) -> list[float]:
    """Time one raw ZeroMQ neighbour exchange of a float32 buffer per repetition.

    Each rank binds one PULL socket and connects one PUSH socket per neighbour. A
    round sends the rank's ``numel``-element float32 array to every neighbour as a
    zero-copy frame and receives one frame from every neighbour. Rounds are separated
    by barriers so no message of one round can be mistaken for another's.

    Args:
        world: Number of ranks (processes).
        numel: float32 elements sent to each neighbour per round.
        neighbors: ``neighbors(rank, world)`` -> ranks to exchange with. It is
            evaluated in the parent (so it need not be picklable) and must describe
            a symmetric graph without self-loops, since a rank expects exactly one
            message from each of its neighbours.
        reps: Timed rounds.
        warmup: Untimed rounds after the connection-establishing round.
        timeout: Seconds for the whole run.

    Returns:
        ``reps`` durations in seconds, each the maximum over ranks.

    Raises:
        ConfigError: On non-positive sizes or an invalid neighbour graph.
        BenchmarkFailed: If a rank fails or the run times out.
    """
    _check_sizes(world, numel, reps, warmup)
    graph = [tuple(int(n) for n in neighbors(rank, world)) for rank in range(world)]
    _check_graph(graph)
    ports = free_ports(world, _HOST)
    # The barrier must come from the same (spawn) context the ranks are started with
    # so that it can be pickled into them.
    barrier = get_context("spawn").Barrier(world)
    per_rank = run_ranks(
        _zmq_rank, world, ports, graph, numel, reps, warmup, barrier, timeout,
        timeout=timeout,
    )
    return max_over_ranks(per_rank)


def _check_graph(graph: Sequence[tuple[int, ...]]) -> None:
    world = len(graph)
    for rank, nbrs in enumerate(graph):
        if len(set(nbrs)) != len(nbrs):
            raise ConfigError(f"rank {rank} lists a neighbour twice: {nbrs}")
        for nbr in nbrs:
            if not 0 <= nbr < world or nbr == rank:
                raise ConfigError(f"rank {rank} has invalid neighbour {nbr}")
            if rank not in graph[nbr]:
                raise ConfigError(f"neighbour graph is not symmetric: {rank}->{nbr} only")


def _zmq_rank(
    rank: int,
    world: int,
    ports: Sequence[int],
    graph: Sequence[tuple[int, ...]],
    numel: int,
    reps: int,
    warmup: int,
    barrier: Any,
    timeout: float,
) -> list[float]:
    """One zmq rank: bind, connect, exchange once to connect, warm up, time rounds."""
    nbrs = graph[rank]
    payload = np.random.default_rng(rank).standard_normal(numel, dtype=np.float32)
    frame = memoryview(payload)
    nbytes = payload.nbytes
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []
    try:
        pull = ctx.socket(zmq.PULL)
        sockets.append(pull)
        pull.bind(f"tcp://{_HOST}:{ports[rank]}")
        pushes = []
        for nbr in nbrs:
            push = ctx.socket(zmq.PUSH)
            sockets.append(push)
            push.connect(f"tcp://{_HOST}:{ports[nbr]}")
            pushes.append(push)

        def exchange() -> None:
            for push in pushes:
                # copy=False: libzmq sends straight from the numpy buffer, which is
                # never modified, so reusing it across rounds is safe.
                push.send(frame, copy=False)
            for _ in nbrs:
                msg = pull.recv(copy=False)
                if len(msg.buffer) != nbytes:
                    raise BenchmarkFailed(f"got {len(msg.buffer)} bytes, expected {nbytes}")

        # Everyone bound before anyone exchanges, then one untimed round so every
        # TCP connection exists before the clock starts.
        barrier.wait(timeout)
        for _ in range(1 + warmup):
            exchange()
            barrier.wait(timeout)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - t0)
            # Also separates rounds, and keeps peers' sockets open until all of this
            # rank's messages were received.
            barrier.wait(timeout)
        return times
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------------- common


def _check_sizes(world: int, numel: int, reps: int, warmup: int) -> None:
    if world < 1 or numel < 1 or reps < 1 or warmup < 0:
        raise ConfigError(
            f"need world, numel, reps >= 1 and warmup >= 0; got "
            f"world={world} numel={numel} reps={reps} warmup={warmup}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """Print a table of median times for both baselines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    opts = parser.parse_args(argv)
    rows = []
    for numel in opts.numel:
        for name, fn in (("gloo_allreduce", gloo_allreduce_times),
                         ("zmq_ring_exchange", zmq_exchange_times)):
            stats = summarize(fn(opts.world, numel, reps=opts.reps, warmup=opts.warmup))
            rows.append({"baseline": name, "world": opts.world, "numel": numel,
                         **{k: v * 1e3 for k, v in stats.items() if k != "n"},
                         "n": stats["n"]})
    print("times in ms")
    print(format_table(rows, ["baseline", "world", "numel", "median", "min", "max", "n"]))


if __name__ == "__main__":
    main()
