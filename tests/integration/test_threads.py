"""The communication path stays off torch's intra-op pool when peers oversubscribe the cores.

With torch's default threads, four library peers on two cores took 32 ms per dpsgd round of
20,011 floats instead of 2.5 ms: the shared-memory copy (and, at larger sizes, every
accumulation and NaN check) ran as OpenMP regions whose threads wait for each other across
processes. Wall times are too noisy to assert, so these tests count what the pool's threads
did: their CPU time (``/proc/self/task/TID/schedstat``, nanoseconds) during the work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gossip.threads import communication_threads, intra_op_threads, peers_on_this_machine
from gossip.topology import Topology

# Runs in a fresh interpreter (a fresh OpenMP pool) pinned to one core with torch at two
# threads: oversubscribed for sure. Prints the CPU seconds of threads that are neither
# Python's nor ZeroMQ's (torch's OpenMP workers) while the work ran.
PROBE = textwrap.dedent("""
    import json, os, sys, threading, time
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import torch
    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # a parallel region: the pool's workers exist from here on

    ours = set()  # our threads, also once they ended (they stay in /proc a moment)

    def pool_cpu():
        python = {t.native_id for t in threading.enumerate()} | ours
        total = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                comm = open(f"/proc/self/task/{tid}/comm").read()
                ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
            except OSError:  # the thread ended meanwhile
                continue
            if int(tid) not in python and not comm.startswith("ZMQ"):
                total += ns
        return total / 1e9

    def work_copy():
        from gossip.transport import shm_segments
        box = shm_segments.Outbox(64 << 20)
        frame = torch.ones(4 << 20, dtype=torch.uint8)
        for _ in range(50):
            offset, nbytes = box.put(frame)
            box.free([offset])
        box.close()

    from gossip.ports import free_ports
    from gossip.peer import Peer
    from gossip.topology import Topology
    data = [torch.full((300_007,), float(rank)) for rank in range(3)]

    def work_rounds():
        topology = Topology.ring(3).relocated(ports=free_ports(3))
        strategy = sys.argv[2]
        barrier = threading.Barrier(3)
        def peer(rank):
            ours.add(threading.get_native_id())
            x = data[rank]
            with Peer(rank, topology, strategy, timeout=20) as node:
                barrier.wait()
                for round in range(10):
                    node.synchronize(x, round, out=x)
        threads = [threading.Thread(target=peer, args=(r,)) for r in range(3)]
        for t in threads: t.start()
        for t in threads: t.join(60)

    # The workers spin a while after the warm-up region: wait until their CPU time stands still.
    before, deadline = pool_cpu(), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.02)
        before, last = pool_cpu(), before
        if before == last:
            break
    {"copy": work_copy, "rounds": work_rounds}[sys.argv[1]]()
    print(json.dumps(pool_cpu() - before))
""")


def pool_seconds(*args: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter importing torch
def test_shared_memory_copy_is_a_plain_copy_off_the_pool():
    # 50 copies of 4 MiB: ~20 ms of copying, half of it on a worker if torch copied.
    assert pool_seconds("copy") < 0.002


@pytest.mark.slow  # a fresh interpreter importing torch
@pytest.mark.parametrize("strategy", ["dpsgd", "ring-allreduce"])
def test_rounds_of_oversubscribed_peers_leave_the_pool_idle(strategy):
    # 300,007 floats: every accumulation, NaN check and copy is large enough for the pool.
    assert pool_seconds("rounds", strategy) < 0.005


def test_thread_share_per_peer_on_this_machine():
    topology = Topology.ring(4)  # every peer on 127.0.0.1
    assert peers_on_this_machine(topology, 2) == 4
    assert communication_threads(4, cores=2) == 1
    assert communication_threads(1, cores=1024) == min(1024, __import__("torch").get_num_threads())
    spread = Topology.from_dict({"peers": [{"rank": r, "host": f"10.0.0.{r // 2}", "port": 7000 + r}
                                           for r in range(6)], "graph": {"kind": "ring"}})
    assert [peers_on_this_machine(spread, r) for r in range(6)] == [2] * 6


def test_intra_op_threads_restores_the_setting():
    import torch

    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
