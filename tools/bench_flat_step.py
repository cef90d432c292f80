"""Peer.step with persistent flat buffers against the flattening path it replaced, side by
side: seconds and bytes allocated per step (medians of interleaved blocks).

    python tools/bench_flat_step.py --params 25e6 --steps 20 --peers 1

With --peers 1 the strategy has nobody to talk to, so what is left is the step's own work
(flattening, copying back, the optimizer); --peers 2 adds an exchange over in-process
loopback queues. The gradients are fixed (no forward/backward is timed).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import gossip
from gossip.transport import LoopbackHub


def old_step(peer, model, optimizer):
    """Peer.step before persistent flat buffers (minibatches=1)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if peer.strategy.operates_on == "grads":
        with peer.communicating():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            averaged = peer._on_host(parameters_to_vector(grads), lambda x, out: (
                peer.strategy.average_gradients(x, 1, peer.round, out=out)))
            offset = 0
            for p in params:
                p.grad.copy_(averaged[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()
    else:
        optimizer.step()
        with torch.no_grad(), peer.communicating():
            vector_to_parameters(peer.synchronize(parameters_to_vector(params), peer.round),
                                 params)
    peer.round += 1


def allocated(fn) -> int:
    """Bytes the CPU allocator handed out during ``fn()`` (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()
               if e.self_cpu_memory_usage > 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--steps", type=int, default=20, help="per block")
    ap.add_argument("--blocks", type=int, default=6, help="A B A B ... blocks in all")
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--strategy", default="ring-allreduce")
    args = ap.parse_args()
    width = 1024
    layers = max(1, int(args.params) // (width * width))
    size = args.peers
    hub = LoopbackHub(size)
    topology = gossip.Topology.ring(size)
    times = {"old": [], "flat": []}
    allocs = {}
    barrier = threading.Barrier(size)

    def run(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        with gossip.Peer(rank, topology, args.strategy,
                         transport=hub.transport(rank, timeout=60)) as peer:
            steps = {"old": lambda: old_step(peer, model, optimizer),
                     "flat": lambda: peer.step(model, optimizer)}
            for name in ("flat", "old"):  # warm-up; the flat buffer is built here
                steps[name]()
            for block in range(args.blocks):
                name = ("old", "flat")[block % 2]
                barrier.wait()
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[name]()
                if rank == 0:
                    times[name].append((time.perf_counter() - start) / args.steps)
            if size == 1:  # the profiler sees the whole process: one peer only
                for name in ("old", "flat"):
                    allocs[name] = allocated(steps[name])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n = layers * (width * width + width)
    old, flat = statistics.median(times["old"]), statistics.median(times["flat"])
    print(f"{args.strategy}, {size} peer(s), {n / 1e6:.1f}M float32 parameters, "
          f"{args.blocks} interleaved blocks of {args.steps} steps")
    for name, label, seconds in (("old", "old  (flatten + copy back)", old),
                                 ("flat", "flat (persistent buffers) ", flat)):
        mib = f"  {allocs[name] / 2**20:8.1f} MiB allocated/step" if allocs else ""
        print(f"{label}: {seconds * 1e3:8.2f} ms/step{mib}")
    print(f"flat/old time ratio: {flat / old:.3f}")


if __name__ == "__main__":
    main()
