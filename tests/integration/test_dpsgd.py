"""D-PSGD gossip between real peers over ZeroMQ on loopback, each peer a thread.

Oracle: peer i returns (W @ X)[i], W the topology's Metropolis-Hastings mixing matrix.
"""

from __future__ import annotations

import pytest
import torch

from gossip.transport import Message, codec

TOPOLOGIES = {
    "ring-1": ("ring", 1, {}),
    "ring-2": ("ring", 2, {}),
    "ring-5": ("ring", 5, {}),
    "torus-2x4": ("torus", None, {"rows": 2, "cols": 4}),
    "exponential-8": ("exponential", 8, {}),
    "star-5": ("star", 5, {}),
    "complete-4": ("complete", 4, {}),
    "erdos_renyi-7": ("erdos_renyi", 7, {"p": 0.4, "seed": 1}),
}


@pytest.fixture(params=list(TOPOLOGIES))
def topology(request, local_topology):
    kind, n, params = TOPOLOGIES[request.param]
    return local_topology(kind, n, **params)


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_mixes_with_neighbours_over_rounds(topology, dtype, inplace, run_rounds, make_data,
                                           oracle):
    data = make_data(3, topology.size, (13,), dtype, seed=topology.size)
    run = run_rounds(topology, "dpsgd", data, inplace=inplace)
    oracle.assert_mixed(topology, run.results, data)


def test_erdos_renyi_graph_is_neither_complete_nor_a_ring(local_topology):
    kind, n, params = TOPOLOGIES["erdos_renyi-7"]
    degrees = {local_topology(kind, n, **params).degree(rank) for rank in range(n)}
    assert len(degrees) > 1 and max(degrees) < n - 1


@pytest.mark.parametrize("n", [0, 1, 2, 7])
@pytest.mark.parametrize("kind, size, params", [TOPOLOGIES["ring-5"],
                                                TOPOLOGIES["exponential-8"]])
def test_short_and_empty_tensors(kind, size, params, n, local_topology, run_rounds, make_data,
                                 oracle):
    topology = local_topology(kind, size, **params)
    data = make_data(2, size, (n,), torch.float64, seed=n)
    oracle.assert_mixed(topology, run_rounds(topology, "dpsgd", data).results, data)


@pytest.mark.parametrize("local_ipc", [True, False], ids=["ipc", "tcp"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
def test_large_tensors_sent_zero_copy(inplace, local_ipc, local_topology, run_rounds,
                                      make_data, oracle):
    topology = local_topology("star", 4)
    data = make_data(2, 4, (codec.ZERO_COPY_MIN_BYTES // 4 + 5,), torch.float32, seed=9)
    run = run_rounds(topology, "dpsgd", data, inplace=inplace, local_ipc=local_ipc)
    oracle.assert_mixed(topology, run.results, data)


def test_matrix_shaped_tensor(local_topology, run_rounds, make_data, oracle):
    topology = local_topology("ring", 3)
    data = make_data(2, 3, (4, 3), torch.float32, seed=4)
    results = run_rounds(topology, "dpsgd", data).results
    assert results.shape == data.shape
    oracle.assert_mixed(topology, results, data)


@pytest.mark.parametrize("n", [0, 5, codec.ZERO_COPY_MIN_BYTES // 4])
def test_byte_counters_are_exact(n, local_topology, run_rounds):
    """One round on a ring of 4: each peer sends its tensor to its 2 neighbours, then a
    goodbye to each; every byte is the encoded header plus 4n payload bytes. A large tensor
    first offers each neighbour shared memory, which it accepts: two more messages each
    way, counted under their kinds, every byte sent received."""
    topology = local_topology("ring", 4)
    data = torch.ones(1, 4, n)
    stats = run_rounds(topology, "dpsgd", data).stats
    handshake = ("shm.offer", "shm.accept") if 4 * n >= codec.ZERO_COPY_MIN_BYTES else ()

    def sent_to_each_neighbour(rank: int) -> int:
        gossip = Message("gossip", 0, meta={"n": n}, buffers=(torch.ones(n),))
        goodbye = Message("bye", -1)
        return len(codec.encode(gossip, rank)[0]) + 4 * n + len(codec.encode(goodbye, rank)[0])

    def handshake_bytes(s, direction: str) -> int:
        return sum(s["by_kind"][kind][f"bytes_{direction}"] for kind in handshake)

    for kind in handshake:
        for direction in ("bytes", "messages"):
            sent, recv = (sum(s["by_kind"][kind][f"{direction}_{way}"] for s in stats)
                          for way in ("sent", "recv"))
            assert sent == recv > 0, (kind, direction)
    for rank, s in enumerate(stats):
        left, right = topology.neighbors(rank)
        assert s["bytes_sent"] == 2 * sent_to_each_neighbour(rank) + handshake_bytes(s, "sent")
        assert s["bytes_recv"] == (sent_to_each_neighbour(left) + sent_to_each_neighbour(right)
                                   + handshake_bytes(s, "recv"))
        assert (s["messages_sent"], s["messages_recv"], s["messages_rejected"]) == \
            (4 + 2 * len(handshake), 4 + 2 * len(handshake), 0)
        assert s["wait_s"] >= 0.0
