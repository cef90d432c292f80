"""`gossip bench sparse`: dense ring all-reduce, topk-allgather, gtopk and spardl side by side.

P processes (one per rank, each with one torch thread) run ``gossip.bench.sparse_rank``:
every contender in turn, interleaved, each call after a barrier. On loopback the peers use
127.0.0.1; with ``netns`` each runs in its own network namespace of a VirtualCluster whose
links are capped at ``rate`` both ways, so the bytes cost what they would on a real network.

Reported per contender: the median over repetitions of the slowest rank's time, the bytes a
peer sent and received per call (mean and max over peers), and for the sparse strategies the
mean over peers of the median seconds per phase: select (top-k selection, residual update),
encode / decode (index coding, message checks), reduce (merging, accumulating, writing the
result), send (handing messages to the transport), recv (the transport's receive work:
header checks, matching), wait (blocked on the socket: the network and slower peers) and
the rest (Python glue).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gossip.bench.harness import format_table
from gossip.bench.sparse_rank import contenders as default_contenders
from gossip.bench.sparse_rank import parse_contender, sparse_strategies
from gossip.cluster.rate import DEFAULT_RATE
from gossip.compress.sparse import k_for
from gossip.errors import ConfigError, GossipError
from gossip.strategies import EXACT_MEAN

_HOST = "127.0.0.1"
PHASES = ("load", "select", "encode", "decode", "reduce", "send", "recv", "wait")


def run(peers: int, numel: int, density: float, *, reps: int = 5, warmup: int = 1,
        contenders: Sequence[str] | None = None, indices: str = "compact",
        netns: bool = False, rate: str | None = None, timeout: float = 600.0) -> dict:
    """Run every rank and return ``{contender: summary}`` (see ``summarize``).

    Raises:
        ConfigError: Bad arguments. NetnsUnavailable: ``netns`` without root or iproute2.
        GossipError: A rank failed or did not finish within ``timeout`` seconds.
    """
    contenders = list(contenders or default_contenders())
    if peers < 1 or numel < 1 or reps < 1 or warmup < 0:
        raise ConfigError("peers, size and reps must be >= 1, warmup >= 0")
    for name in contenders:
        parse_contender(name)
    if rate is not None and not netns:
        raise ConfigError("--rate: only with --netns (loopback has no cap)")
    from gossip.topology import Topology

    args = ["--size", str(numel), "--density", str(density), "--reps", str(reps),
            "--warmup", str(warmup), "--indices", indices, "--contenders", ",".join(contenders),
            "--timeout", str(min(timeout, 300.0))]
    with tempfile.TemporaryDirectory(prefix="gossip-bench-sparse-") as tmp:
        path = Path(tmp) / "topology.yaml"
        if netns:
            from gossip.cluster import VirtualCluster

            with VirtualCluster(peers, rate=rate or DEFAULT_RATE) as cluster:
                cluster.topology("ring").to_yaml(path)
                reports = _run_ranks(peers, path, args, timeout, wrap=cluster.command)
        else:
            from gossip.ports import free_ports

            Topology.generate("ring", peers, host=_HOST).relocated(
                ports=free_ports(peers, _HOST)).to_yaml(path)
            reports = _run_ranks(peers, path, args, timeout)
    return summarize(reports)


def _run_ranks(peers: int, topology: Path, args: list[str], timeout: float, *,
               wrap: Callable[[int, list[str]], list[str]] | None = None) -> list[dict]:
    """Start every rank, wait for all, return their JSON reports by rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    try:
        for rank in range(peers):
            argv = [sys.executable, "-m", "gossip.bench.sparse_rank", "--rank", str(rank),
                    "--topology", str(topology), *args]
            procs.append(subprocess.Popen(wrap(rank, argv) if wrap else argv, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise GossipError(f"bench rank {rank} did not finish within {timeout:g} s") \
                    from None
            if proc.returncode:
                lines = err.strip().splitlines()
                raise GossipError(f"bench rank {rank} failed (exit {proc.returncode}): "
                                  f"{lines[-1] if lines else 'no output'}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def summarize(reports: list[dict]) -> dict[str, dict]:
    """Per contender: ``seconds`` (median over reps of the slowest rank), ``sent``/``recv``
    (mean bytes per peer per call), ``sent_max``/``recv_max`` (the busiest peer's), ``cpu``
    (mean over peers of the median CPU seconds per call, all threads) and
    ``phases`` (mean over peers of the median seconds per phase) and ``phases_cpu`` (the
    same in CPU seconds of the peer's main thread)."""
    summary = {}
    for name in reports[0]["results"]:
        per_rank = [report["results"][name] for report in reports]
        reps = len(per_rank[0])
        slowest = [max(rank[i]["seconds"] for rank in per_rank) for i in range(reps)]
        sent = [statistics.mean(rec["sent"] for rec in rank) for rank in per_rank]
        recv = [statistics.mean(rec["recv"] for rec in rank) for rank in per_rank]
        cpu = [statistics.median(rec["cpu"] for rec in rank) for rank in per_rank]
        phases, phases_cpu = {}, {}
        for phase in (*PHASES, "total"):
            values = [statistics.median(_phase(rec["phases"], phase) for rec in rank)
                      for rank in per_rank]
            phases[phase] = statistics.mean(values)
            values = [statistics.median(rec["phases_cpu"].get(phase, 0.0) for rec in rank)
                      for rank in per_rank]
            phases_cpu[phase] = statistics.mean(values)
        summary[name] = {"seconds": statistics.median(slowest), "sent": statistics.mean(sent),
                         "recv": statistics.mean(recv), "sent_max": max(sent),
                         "recv_max": max(recv), "cpu": statistics.mean(cpu), "phases": phases,
                         "phases_cpu": phases_cpu}
    return summary


def _phase(phases: dict[str, float], name: str) -> float:
    if name == "recv":  # the transport's work in recv, without the time blocked
        return phases.get("recv", 0.0) - phases.get("wait", 0.0)
    return phases.get(name, 0.0)


def time_table(results: dict[int, dict[str, dict]]) -> str:
    """One row per (P, contender): time, speed-up over dense ring, bytes per peer."""
    rows = []
    for peers, summary in results.items():
        dense = summary.get(EXACT_MEAN, {}).get("seconds")
        for name, s in summary.items():
            rows.append({"P": peers, "strategy": name, "ms": 1e3 * s["seconds"],
                         "vs ring": dense / s["seconds"] if dense else "",
                         "cpu ms/peer": 1e3 * s["cpu"],
                         "sent kB/peer": s["sent"] / 1e3, "max sent kB": s["sent_max"] / 1e3,
                         "recv kB/peer": s["recv"] / 1e3, "max recv kB": s["recv_max"] / 1e3})
    return format_table(rows, ["P", "strategy", "ms", "vs ring", "cpu ms/peer", "sent kB/peer",
                               "max sent kB",
                               "recv kB/peer", "max recv kB"])


def phase_table(results: dict[int, dict[str, dict]]) -> str:
    """Where a sparse strategy's time goes: per phase, the mean over peers of the median
    wall milliseconds, and below it the main thread's CPU milliseconds."""
    rows = []
    for peers, summary in results.items():
        for name, s in summary.items():
            if parse_contender(name)[0] not in sparse_strategies():
                continue
            for clock, key in (("wall", "phases"), ("cpu", "phases_cpu")):
                ph = {phase: 1e3 * value for phase, value in s[key].items()}
                rest = ph["total"] - sum(ph[phase] for phase in PHASES)
                rows.append({"P": peers, "strategy": name, "clock": clock, **ph, "other": rest})
    return format_table(rows, ["P", "strategy", "clock", "total", *PHASES, "other"])


def describe(peers: Sequence[int], numel: int, density: float, *, netns: bool,
             rate: str | None) -> str:
    where = (f"netns cluster, links capped at {rate or DEFAULT_RATE} each way" if netns
             else "loopback")
    ks = ", ".join(f"P={p}: k={k_for(density, numel)}, SparDL k_b={k_for(density, -(-numel // p))}"
                   for p in peers)
    return f"sparse all-reduce of {numel} float32, density {density:g} ({ks}), {where}"
