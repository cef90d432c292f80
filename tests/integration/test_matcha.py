"""MATCHA gossip between real peers over ZeroMQ on loopback, each peer a thread.

Oracle: peer i returns (W(k) @ X)[i] with W(k) = I - alpha * sum of the Laplacians of the
matchings active in round k. The oracle draws the activations itself from the documented
schedule (``default_rng([seed, k])``, one uniform per matching, active iff below p_j) and
builds W(k) from the pairs by hand, so it shares no code with the strategy's round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossip.topology import Topology, matcha
from gossip.transport import codec

TOPOLOGIES = {
    "ring-3": ("ring", 3, {}),
    "star-5": ("star", 5, {}),
    "irregular-7": None,  # topologies/irregular-7.yaml
    "torus-2x4": ("torus", None, {"rows": 2, "cols": 4}),
    "exponential-8": ("exponential", 8, {}),
}


def make_topology(name: str, local_topology) -> Topology:
    if TOPOLOGIES[name] is None:
        return local_topology(name)
    kind, n, params = TOPOLOGIES[name]
    return local_topology(kind, n, **params)


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["ring-3", "star-5", *(
    pytest.param(name, marks=pytest.mark.slow) for name in ["irregular-7", "torus-2x4",
                                                            "exponential-8"])])
def test_each_round_mixes_over_the_active_matchings(name, dtype, inplace, local_topology,
                                                    run_rounds, make_data, oracle):
    topology = make_topology(name, local_topology)
    seed, rounds = 3, 8
    plan = matcha.plan(topology, 0.5)
    data = make_data(rounds, topology.size, (13,), dtype, seed=topology.size)
    run = run_rounds(topology, "matcha", data, inplace=inplace, budget=0.5, seed=seed)
    oracle.assert_close(run.results, oracle.matcha_mix(plan, seed, data))
    # The schedule really varied: not every round activated the same matchings.
    assert len({tuple(oracle.matcha_active(plan, seed, k)) for k in range(rounds)}) > 1
    # Exactly one message per active partner and round, plus one goodbye per partner met.
    for rank, stats in enumerate(run.stats):
        met = {q for k in range(rounds) for q in oracle.matcha_partners(plan, seed, k, rank)}
        sends = sum(len(oracle.matcha_partners(plan, seed, k, rank)) for k in range(rounds))
        assert stats["messages_sent"] == sends + len(met)


def test_isolated_peers_keep_their_value_and_send_nothing(local_topology, run_rounds, oracle,
                                                          make_data):
    """A small budget on a star leaves most leaves out of most rounds."""
    topology = local_topology("star", 5)
    plan = matcha.plan(topology, 0.2)
    seed, rounds = 1, 6
    data = make_data(rounds, 5, (7,), torch.float64, seed=2)
    run = run_rounds(topology, "matcha", data, inplace=True, budget=0.2, seed=seed)
    isolated = [(k, r) for k in range(rounds) for r in range(5)
                if not oracle.matcha_partners(plan, seed, k, r)]
    assert len(isolated) >= rounds  # at least the leaves outside each round's single edge
    for k, r in isolated:
        assert torch.equal(run.results[k, r], data[k, r])
    torch.testing.assert_close(run.results, oracle.matcha_mix(plan, seed, data), rtol=1e-12, atol=1e-12)


def test_full_budget_is_a_fixed_mixing_matrix(local_topology, run_rounds, make_data, oracle):
    """C_b = 1: every round is W = I - alpha L, alpha = 2 / (lambda_2 + lambda_max)."""
    topology = local_topology("exponential", 8)
    lap = np.diag([topology.degree(r) for r in range(8)]).astype(float)
    for a, b in topology.edges():
        lap[a, b] = lap[b, a] = -1.0
    eig = np.linalg.eigvalsh(lap)
    w = np.eye(8) - 2 / (eig[1] + eig[-1]) * lap
    data = make_data(3, 8, (9,), torch.float64, seed=5)
    run = run_rounds(topology, "matcha", data, budget=1.0, seed=11)
    oracle.assert_close(run.results, torch.from_numpy(np.einsum("ij,rjn->rin", w,
                                                                data.numpy())))


def test_single_peer_returns_its_value(run_rounds, make_data, local_topology):
    topology = local_topology("ring", 1)
    data = make_data(3, 1, (5,), torch.float32, seed=1)
    run = run_rounds(topology, "matcha", data, inplace=True, budget=0.5)
    assert torch.equal(run.results, data)
    assert run.stats[0]["messages_sent"] == 0


def test_mean_is_preserved(local_topology, run_rounds, make_data, oracle):
    topology = local_topology("ring", 7)
    data = make_data(5, 7, (6,), torch.float64, seed=8)
    results = run_rounds(topology, "matcha", data, budget=0.3, seed=0).results
    oracle.assert_close(results.mean(dim=1), data.mean(dim=1))


@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
def test_large_tensors_sent_zero_copy(inplace, local_topology, run_rounds, make_data, oracle):
    topology = local_topology("ring", 5)
    plan = matcha.plan(topology, 0.6)
    data = make_data(3, 5, (codec.ZERO_COPY_MIN_BYTES // 4 + 5,), torch.float32, seed=9)
    run = run_rounds(topology, "matcha", data, inplace=inplace, budget=0.6, seed=2)
    torch.testing.assert_close(run.results.double(), oracle.matcha_mix(plan, 2, data),
                               rtol=1e-5, atol=1e-5)


def test_peer_step_mixes_the_locally_updated_parameters(local_topology, train_steps, oracle):
    """Peer.step (default budget 0.5, seed 0): local SGD step, then round k of W(k)."""
    topology = local_topology("torus", rows=2, cols=4)
    steps = train_steps(topology, "matcha", steps=3, lr=0.05, same_init=False)
    plan = matcha.plan(topology, 0.5)
    half = (steps.before - 0.05 * steps.grads).double()
    mixed = torch.stack([torch.from_numpy(oracle.matcha_mixing(plan, 0, k)) @ half[k]
                         for k in range(3)])
    torch.testing.assert_close(steps.after.double(), mixed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options, culprit", [({"budget": 0.0}, "budget"),
                                              ({"budget": 2}, "budget"),
                                              ({"seed": -1}, "seed"),
                                              ({"sead": 1}, "sead")])
def test_bad_options_are_config_errors(options, culprit):
    from gossip.errors import ConfigError
    from gossip.peer import Peer

    topology = Topology.generate("ring", 3)
    with (pytest.raises(ConfigError, match=culprit),
          Peer(0, topology, "matcha", transport=_NoTransport(), **options)):
        pass


class _NoTransport:
    """Enough of a transport for a strategy to be built and the Peer closed."""

    def accept_kinds(self, kinds):
        pass

    def close(self, linger: float = 0.0):
        pass

    def shutdown(self, timeout: float = 10.0):
        pass
