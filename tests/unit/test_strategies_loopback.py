"""Strategies and Peer.step over the in-process LoopbackHub: the same oracles as the ZeroMQ
integration tests (ring-allreduce == X.mean(0) on every peer, dpsgd == (W @ X)[rank]),
without sockets.
"""

from __future__ import annotations

import pytest
import torch

from gossip.errors import PeerTimeout, ProtocolError
from gossip.topology import Topology
from gossip.transport import LoopbackHub


def topology(kind: str, n: int | None = None, **params) -> Topology:
    return Topology.generate(kind, n, **params)  # addresses are unused on loopback


SIZES = [1, 2, 3, 4, 5, 7, 8]
FLOATS = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("size, n", [(size, n) for size in SIZES
                                     for n in sorted({0, 1, size - 1 or 1, 2 * size + 1})])
def test_ring_allreduce_is_the_mean(size, n, dtype, run_rounds, make_data, oracle):
    data = make_data(3, size, (n,), dtype, seed=size + n)
    run = run_rounds(topology("ring", size), "ring-allreduce", data, loopback=True)
    oracle.assert_mean_everywhere(run.results, data)


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("size, piece_bytes", [(1, 64), (3, 64), (4, 256), (7, 64)])
def test_ring_allreduce_in_pieces(size, piece_bytes, inplace, run_rounds, make_data, oracle):
    data = make_data(2, size, (45 * size + 1,), torch.float64, seed=size)
    run = run_rounds(topology("ring", size), "ring-allreduce", data, loopback=True,
                     inplace=inplace, piece_bytes=piece_bytes)
    oracle.assert_mean_everywhere(run.results, data)


TOPOLOGIES = {
    "ring-1": ((1, "ring", 1), {}),
    "ring-4": ((4, "ring", 4), {}),
    "torus-2x4": ((8, "torus", None), {"rows": 2, "cols": 4}),
    "exponential-8": ((8, "exponential", 8), {}),
    "star-5": ((5, "star", 5), {}),
    "complete-3": ((3, "complete", 3), {}),
    "erdos_renyi-7": ((7, "erdos_renyi", 7), {"p": 0.4, "seed": 1}),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("size, kind, n, params",
                         [(*args, params) for args, params in TOPOLOGIES.values()],
                         ids=list(TOPOLOGIES))
def test_dpsgd_is_the_mixing_matrix_product(size, kind, n, params, dtype, inplace, run_rounds,
                                            make_data, oracle):
    graph = topology(kind, n, **params)
    data = make_data(3, size, (11,), dtype, seed=size)
    run = run_rounds(graph, "dpsgd", data, loopback=True, inplace=inplace)
    oracle.assert_mixed(graph, run.results, data)


@pytest.mark.parametrize("size", [1, 3])
def test_step_with_ring_allreduce_applies_the_averaged_gradient(size, train_steps):
    steps = train_steps(topology("ring", size), "ring-allreduce", lr=0.05, loopback=True)
    expected = steps.before - 0.05 * steps.grads.mean(dim=1, keepdim=True)
    torch.testing.assert_close(steps.after, expected, rtol=1e-5, atol=1e-6)
    for rank in range(1, size):
        assert torch.equal(steps.after[:, rank], steps.after[:, 0])


@pytest.mark.parametrize("kind, size", [("ring", 1), ("exponential", 8)])
def test_step_with_dpsgd_mixes_the_locally_updated_parameters(kind, size, train_steps):
    graph = topology(kind, size)
    steps = train_steps(graph, "dpsgd", lr=0.05, same_init=False, loopback=True)
    mixing = torch.from_numpy(graph.mixing_matrix()).float()
    expected = torch.einsum("ij,sjd->sid", mixing, steps.before - 0.05 * steps.grads)
    torch.testing.assert_close(steps.after, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ring-allreduce", "dpsgd"])
def test_different_lengths_are_a_protocol_error(strategy, run_peers, open_peer):
    graph, hub = topology("ring", 2), LoopbackHub(2)

    def peer_main(rank: int) -> BaseException:
        with pytest.raises((ProtocolError, PeerTimeout)) as info:
            with open_peer(rank, graph, strategy, hub=hub, timeout=1.0) as peer:
                peer.synchronize(torch.zeros(4 + rank), 0)
        return info.value

    errors = run_peers(2, peer_main)
    assert any(isinstance(e, ProtocolError) and "same length" in str(e) for e in errors), errors


def test_ring_allreduce_of_different_dtypes_is_a_protocol_error(run_peers, open_peer):
    graph, hub = topology("ring", 3), LoopbackHub(3)
    dtypes = [torch.float32, torch.float32, torch.float64]

    def peer_main(rank: int) -> BaseException:
        with pytest.raises((ProtocolError, PeerTimeout)) as info:
            with open_peer(rank, graph, "ring-allreduce", hub=hub, timeout=1.0) as peer:
                peer.synchronize(torch.zeros(7, dtype=dtypes[rank]), 0)
        return info.value

    errors = run_peers(3, peer_main)
    assert any(isinstance(e, ProtocolError) and "same dtype" in str(e) for e in errors), errors
