"""Push-sum (sgp) between real peers over ZeroMQ, each a thread, against numpy: the
column-stochastic push matrix P of each step applied to [X | w]."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from gossip.errors import TopologyError
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.topology.directed import OnePeerExponential, StaticDigraph
from gossip.transport import LoopbackHub
from support import peer_once_all_bound, run_in_threads

# Five peers, out-degrees 2, 1, 2, 1, 1: not regular, strongly connected.
IRREGULAR = [[0, 1], [0, 3], [1, 2], [2, 0], [2, 4], [3, 4], [4, 0]]


def push_rounds(topology, x0: torch.Tensor, rounds: int, *, slow: int | None = None,
                **options):
    """Every peer pushes ``rounds`` steps from ``x0[rank]`` (no optimizer step: lr = 0);
    returns per step the de-biased models z [round, rank, n], the weights [round, rank] and
    the pushes each peer has not mixed yet [round][rank] ({round sent: senders}). Rank
    ``slow`` sleeps 5 ms before each step."""
    size = topology.size
    z = torch.empty(rounds, size, x0.shape[1], dtype=x0.dtype)
    w = torch.empty(rounds, size, dtype=torch.float64)
    unmixed = [[None] * size for _ in range(rounds)]
    all_bound = threading.Barrier(size, timeout=10)

    def main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, "sgp", all_bound, **options) as peer:
            x = x0[rank].clone()
            for round in range(rounds):
                if rank == slow:
                    time.sleep(0.005)
                x = peer.synchronize(x, round, out=x)
                z[round, rank], w[round, rank] = x, peer.strategy.weight
                unmixed[round][rank] = {r: set(s) for r, s in peer.strategy.awaited.items()}

    run_in_threads(size, main, timeout=60)
    return z, w, unmixed


def test_one_peer_exponential_on_8_peers_averages_exactly_in_3_steps(local_topology):
    x0 = torch.randint(-50, 50, (8, 5), generator=torch.Generator().manual_seed(0)).double()
    z, w, _ = push_rounds(local_topology("ring", 8), x0, 3)
    mass = x0.sum(0)
    for step in range(3):
        torch.testing.assert_close((z[step] * w[step].unsqueeze(1)).sum(0), mass,
                                   rtol=1e-12, atol=1e-12)  # sum of numerators
        assert w[step].sum().item() == pytest.approx(8.0, abs=1e-12)  # sum of weights
    assert torch.equal(z[2], x0.mean(0).expand(8, 5))  # exactly the mean, bit for bit


def test_one_step_on_an_irregular_digraph_is_p_times_x_and_w(local_topology):
    topology = local_topology("ring", 5)  # the peers; the push graph is the explicit edges
    x0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    z, w, _ = push_rounds(topology, x0, 1, edges=IRREGULAR)
    p = StaticDigraph(5, IRREGULAR).push_matrix(0)
    assert np.allclose(p.sum(0), 1.0) and not np.allclose(p.sum(1), 1.0)  # column stochastic
    expected = p @ np.hstack([x0.numpy(), np.ones((5, 1))])
    np.testing.assert_allclose(w[0].numpy(), expected[:, -1], rtol=1e-12)
    np.testing.assert_allclose((z[0] * w[0].unsqueeze(1)).numpy(), expected[:, :-1],
                               rtol=1e-12, atol=1e-12)


def test_overlap_mixes_each_late_push_once(local_topology):
    """With overlap tau a push may be mixed up to tau steps late, but exactly once: every
    step, the numerators plus the pushes still unmixed (on one-peer exponential, half of
    the sender's numerator before that step) add up to the initial sum."""
    x0 = torch.randint(0, 9, (7, 3), generator=torch.Generator().manual_seed(2)).double()
    rounds = 12
    z, w, unmixed = push_rounds(local_topology("ring", 7), x0, rounds, overlap=2, slow=3)
    numerators = z * w.unsqueeze(2)
    before = torch.cat([x0.unsqueeze(0), numerators])  # a sender's numerator before step r
    weights = torch.cat([torch.ones(1, 7, dtype=torch.float64), w])
    late = 0
    for step in range(rounds):
        in_flight = [(r, s) for rank in range(7) for r, senders in unmixed[step][rank].items()
                     for s in senders]
        assert all(step - 2 < r <= step for r, _ in in_flight)  # never more than tau late
        late += len(in_flight)
        mass = numerators[step].sum(0) + sum(before[r, s] / 2 for r, s in in_flight)
        torch.testing.assert_close(mass, x0.sum(0), rtol=1e-12, atol=1e-12)
        weight = w[step].sum() + sum(weights[r, s] / 2 for r, s in in_flight)
        assert weight.item() == pytest.approx(7.0, abs=1e-12)
    assert late > 0, "no push was ever mixed late: the test checks nothing"


def test_push_graphs():
    schedule = OnePeerExponential(8)
    assert [schedule.out_neighbors(3, k) for k in range(4)] == [(4,), (5,), (7,), (4,)]
    assert schedule.in_neighbors(0, 2) == (4,)
    assert OnePeerExponential(1).out_neighbors(0, 5) == ()
    for k in range(3):  # every step's P is column stochastic and a permutation mix
        assert np.allclose(schedule.push_matrix(k).sum(0), 1.0)
    with pytest.raises(TopologyError, match="not strongly connected"):
        StaticDigraph(3, [[0, 1], [1, 2]])
    with pytest.raises(TopologyError, match=r"edges\[1\]: self-loop"):
        StaticDigraph(3, [[0, 1], [2, 2]])
    with pytest.raises(TopologyError, match=r"edges\[0\]: expected a pair"):
        StaticDigraph(3, [[0, 7]])
    with pytest.raises(TopologyError, match="not strongly connected"):  # at the Peer too
        with Peer(0, Topology.ring(3), "sgp", transport=LoopbackHub(3).transport(0),
                  edges=[[0, 1], [1, 2]]):
            pass
