"""The multi-process parts of `gossip bench gpu`: (b) the pipelined device -> socket ->
device exchange between 2 processes and (d) all-reduces of device tensors by 4 peers
sharing the device, ours vs gloo's on the same tensors, interleaved in one run.

Every rank is a spawned process (harness.run_ranks); device tensors live on ``device``
(``cpu`` runs the same code, which is how the tests check it without a GPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import get_context

import torch

from gossip.bench.baselines import max_over_ranks
from gossip.bench.harness import format_table, run_ranks
from gossip.ports import free_ports

_HOST = "127.0.0.1"
_PIECE_BYTES = 4 << 20
_TIMEOUT = 600.0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` to completion on ``device`` (one untimed warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exchange(device: torch.device, numel: int, *, reps: int, echo=print) -> dict[str, float]:
    """(b) Rank 0's device tensor into rank 1's, pipelined, vs its three legs alone."""
    ports = free_ports(2, _HOST)
    barrier = get_context("spawn").Barrier(2)
    legs = run_ranks(_exchange_rank, 2, str(device), ports, numel, reps, barrier,
                     timeout=_TIMEOUT)
    result = {**legs[0], **legs[1]}
    legs_s = [result["D2H"], result["socket"], result["H2D"]]
    result["max of legs"], result["sum of legs"] = max(legs_s), sum(legs_s)
    result["pipelined / max"] = result["pipelined"] / result["max of legs"]
    echo(f"(b) device -> socket -> device, 2 processes, {numel * 4 / 2**20:.0f} MB in "
         f"{_PIECE_BYTES >> 20} MB pieces (target: pipelined / max <= 1.3; ms)")
    echo(format_table([{k: (v if k.endswith("max") else v * 1e3) for k, v in result.items()}],
                      list(result)))
    return result


def _exchange_rank(rank, world, device, ports, numel, reps, barrier) -> dict[str, float]:
    from gossip.device import HostPool, copier_for
    from gossip.device.exchange import recv_device, send_device
    from gossip.peer import Peer
    from gossip.topology import Topology

    device = torch.device(device)
    pin = device.type == "cuda"
    topology = Topology.generate("ring", 2, host=_HOST).relocated(ports=ports)
    x = torch.randn(numel, device=device) if rank == 0 else torch.empty(numel, device=device)
    host = torch.empty(numel, pin_memory=pin)
    pool, copier = HostPool(_PIECE_BYTES, depth=3, pin=pin), copier_for(device)
    with Peer(rank, topology, "dpsgd", timeout=_TIMEOUT) as peer:
        transport = peer.transport
        transport.accept_kinds(["bench.piece", "bench.whole", "bench.ack"])
        from gossip.transport import Message

        def once(kind: str, r: int) -> float:
            barrier.wait(_TIMEOUT)
            start = time.perf_counter()
            if rank == 0:
                if kind == "bench.piece":
                    send_device(transport, 1, x, pool=pool, copier=copier, kind=kind, round=r)
                else:
                    transport.send(1, Message(kind=kind, round=r, buffers=(host,)),
                                   track=True).wait()
                transport.recv(src=1, kind="bench.ack", round=r)
            else:
                if kind == "bench.piece":
                    recv_device(transport, 0, x, pool=pool, copier=copier, kind=kind, round=r)
                    sync(device)
                else:
                    transport.recv(src=0, kind=kind, round=r)
                transport.send(0, Message(kind="bench.ack", round=r))
            return time.perf_counter() - start

        legs = {}
        for kind, name in (("bench.whole", "socket"), ("bench.piece", "pipelined")):
            legs[name] = statistics.median(once(kind, r) for r in range(reps + 1))
        if rank == 0:
            legs["D2H"] = timed(lambda: host.copy_(x), device, reps)
            return {k: legs[k] for k in ("pipelined", "D2H", "socket")}
        return {"H2D": timed(lambda: x.copy_(host, non_blocking=pin), device, reps)}


def allreduce(device: torch.device, peers: int, numel: int, *, reps: int, echo=print,
              bound: float | None = None) -> dict[str, float]:
    """(d) gloo all_reduce vs our ring-allreduce and dpsgd of the same device tensors, and
    our ring on host tensors (the CPU path's own time, part of the bound)."""
    ports = free_ports(peers + 1, _HOST)
    barrier = get_context("spawn").Barrier(peers)
    per_rank = run_ranks(_allreduce_rank, peers, str(device), ports, numel, reps, barrier,
                         timeout=_TIMEOUT)
    names = list(per_rank[0])
    medians = {name: statistics.median(max_over_ranks([r[name] for r in per_rank]))
               for name in names}
    rows = [{"contender": name, "median ms": medians[name] * 1e3,
             "ratio to gloo": medians[name] / medians["gloo all_reduce (device tensors)"]}
            for name in names]
    floor = (2 * numel * 4 / (bound * 1e9) if bound else 0.0) + medians["ring-allreduce (host tensors)"]
    echo(f"(d) {peers} peers sharing the device, {numel} float32 (target: ring-allreduce of "
         f"device tensors <= 1.0x gloo); bound 2*size/PCIe + the host ring = "
         f"{floor * 1e3:.1f} ms")
    echo(format_table(rows, ["contender", "median ms", "ratio to gloo"]))
    return medians


def _allreduce_rank(rank, world, device, ports, numel, reps, barrier) -> dict[str, list]:
    import torch.distributed as dist

    from gossip.device import HostStaging
    from gossip.peer import Peer
    from gossip.topology import Topology

    device = torch.device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://{_HOST}:{ports[-1]}",
                            timeout=timedelta(seconds=_TIMEOUT))
    topology = Topology.generate("ring", world, host=_HOST).relocated(ports=ports[:-1])
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    on_host = x.cpu()
    staging = HostStaging()
    times: dict[str, list] = {}
    try:
        with Peer(rank, topology, "ring-allreduce", timeout=_TIMEOUT) as peer:
            ring = peer.strategy
            gossip = peer.add_strategy("dpsgd", tag="bench.dpsgd")
            contenders = {
                "gloo all_reduce (device tensors)": lambda r: dist.all_reduce(x),
                "ring-allreduce (device tensors)": lambda r: staging.run(
                    x, lambda h, o: ring.synchronize(h, r, out=o), out=x),
                "dpsgd (device tensors)": lambda r: staging.run(
                    x, lambda h, o: gossip.synchronize(h, r, out=o), out=x),
                "ring-allreduce (host tensors)": lambda r: ring.synchronize(on_host, r,
                                                                            out=on_host),
            }
            meeting = 0
            for rep in range(reps + 1):  # the first one warms up
                for name, run in contenders.items():
                    barrier.wait(_TIMEOUT)
                    start = time.perf_counter()
                    run(2 * meeting)  # ring-allreduce's rounds stay apart from dpsgd's
                    sync(device)
                    meeting += 1
                    if rep:
                        times.setdefault(name, []).append(time.perf_counter() - start)
                x.div_(world)  # gloo sums: keep the values bounded
            barrier.wait(_TIMEOUT)
    finally:
        dist.destroy_process_group()
    return times
