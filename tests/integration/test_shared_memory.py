"""Ring all-reduce between peer processes on one machine, large frames in shared memory.

Threads of one process (the other integration tests) map each other's segments too, but
only separate processes show that a segment crosses process boundaries through /proc and
that every record is handed back: each peer runs in its own interpreter here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gossip.ports import free_ports

PEER = textwrap.dedent("""
    import sys, torch
    from gossip import Peer, Topology

    rank, size, ports, piece_bytes, data_file, out = sys.argv[1:]
    rank, size, piece_bytes = int(rank), int(size), int(piece_bytes)
    topology = Topology.ring(size).relocated(ports=[int(p) for p in ports.split(",")])
    data = torch.load(data_file)
    with Peer(rank, topology, "ring-allreduce", timeout=30, piece_bytes=piece_bytes) as peer:
        results = [peer.synchronize(data[round, rank].clone(), round)
                   for round in range(len(data))]
        shared = peer.transport.shares_memory_with((rank + 1) % size)
        rejected = peer.stats["messages_rejected"]
    torch.save({"results": torch.stack(results), "shared": shared, "rejected": rejected}, out)
""")


@pytest.mark.slow  # peer processes, each importing torch
@pytest.mark.parametrize("size, dtype, piece_bytes", [
    (5, torch.float64, 64 << 20),  # one piece per segment
    (3, torch.float32, 100_000),  # many pieces stream through each segment
])
def test_ring_allreduce_across_processes(size, dtype, piece_bytes, tmp_path, make_data,
                                         oracle):
    # 4 rounds: the first offers shared memory, the others use it.
    data = make_data(4, size, (size * 70_001 + 3,), dtype, seed=size)
    torch.save(data, tmp_path / "data.pt")
    ports = ",".join(map(str, free_ports(size)))
    peers = [subprocess.Popen([sys.executable, "-c", PEER, str(rank), str(size), ports,
                               str(piece_bytes), str(tmp_path / "data.pt"),
                               str(tmp_path / f"{rank}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(size)]
    try:
        for rank, peer in enumerate(peers):
            output, _ = peer.communicate(timeout=90)
            assert peer.returncode == 0, f"rank {rank}: {output}"
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()
    outcome = [torch.load(tmp_path / f"{rank}.pt") for rank in range(size)]
    assert [o["shared"] for o in outcome] == [True] * size
    assert [o["rejected"] for o in outcome] == [0] * size
    oracle.assert_mean_everywhere(torch.stack([o["results"] for o in outcome], dim=1), data)
