"""Side-by-side benchmarks printed by `gossip bench`: ours vs a baseline, interleaved trials.

The machines are shared and noisy, so each trial runs the baseline and ours back to back
and the verdict is the median of the per-trial ratios, never a single absolute time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from gossip.bench.baselines import (
    gloo_allreduce_times,
    ring_neighbors,
    zmq_exchange_times,
)
from gossip.bench.harness import format_table
from gossip.bench.ours import strategy_times


def compare(contenders: dict[str, Callable[[], list[float]]], *, trials: int,
            baseline: str, echo: Callable[[str], None] = print) -> dict[str, float]:
    """Run each contender once per trial, in turn; returns median ratio to ``baseline``."""
    medians: dict[str, list[float]] = {name: [] for name in contenders}
    for trial in range(trials):
        for name, run in contenders.items():
            medians[name].append(statistics.median(run()))
        echo(f"trial {trial + 1}/{trials}: " + ", ".join(
            f"{name} {values[-1] * 1e3:.2f} ms" for name, values in medians.items()))
    ratios = {name: statistics.median(v / b for v, b in zip(values, medians[baseline]))
              for name, values in medians.items()}
    rows = [{"contender": name, "median ms": statistics.median(values) * 1e3,
             f"ratio to {baseline}": ratios[name]} for name, values in medians.items()]
    echo(format_table(rows, ["contender", "median ms", f"ratio to {baseline}"]))
    return ratios


def allreduce(peers: int, numel: int, *, reps: int, trials: int, echo=print) -> dict[str, float]:
    """Our ring all-reduce (same host: Unix sockets and shared memory; and plain TCP) vs
    gloo's, in place."""
    return compare({
        "gloo": lambda: gloo_allreduce_times(peers, numel, reps=reps),
        "gossip ring-allreduce": lambda: strategy_times("ring-allreduce", peers, numel,
                                                        reps=reps),
        "gossip ring-allreduce (tcp only)": lambda: strategy_times(
            "ring-allreduce", peers, numel, reps=reps, local_ipc=False),
        "gossip ring-allreduce (torch's default threads)": lambda: strategy_times(
            "ring-allreduce", peers, numel, reps=reps, threads=None),
    }, trials=trials, baseline="gloo", echo=echo)


def gossip_round(peers: int, numel: int, *, reps: int, trials: int, echo=print) -> dict[str, float]:
    """One dpsgd round on a ring vs a bare zero-copy pyzmq exchange with the same neighbours."""
    return compare({
        "bare pyzmq exchange": lambda: zmq_exchange_times(peers, numel, neighbors=ring_neighbors,
                                                          reps=reps),
        "gossip dpsgd": lambda: strategy_times("dpsgd", peers, numel, reps=reps),
        "gossip dpsgd (tcp only)": lambda: strategy_times("dpsgd", peers, numel, reps=reps,
                                                          local_ipc=False),
        # A library user who sets no OMP_NUM_THREADS: one torch thread per core in each peer.
        "gossip dpsgd (torch's default threads)": lambda: strategy_times(
            "dpsgd", peers, numel, reps=reps, threads=None),
    }, trials=trials, baseline="bare pyzmq exchange", echo=echo)


def compressed_gossip_round(peers: int, numel: int, options: dict, *, reps: int, trials: int,
                            echo=print) -> dict[str, float]:
    """One CHOCO-Gossip round (dpsgd with a compressor) vs the dense dpsgd round, same ring."""
    label = "gossip dpsgd + " + ", ".join(f"{k}={v}" for k, v in options.items())
    return compare({
        "gossip dpsgd": lambda: strategy_times("dpsgd", peers, numel, reps=reps),
        label: lambda: strategy_times("dpsgd", peers, numel, reps=reps, options=options),
    }, trials=trials, baseline="gossip dpsgd", echo=echo)
