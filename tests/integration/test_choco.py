"""dpsgd with a compressor runs CHOCO-Gossip: real peers (threads) over ZeroMQ or loopback,
checked against the invariants of choco.md and a float64 oracle."""

from __future__ import annotations

import pytest
import torch

from gossip.compress import create
from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.strategies.dpsgd import ChocoGossip, DPSGDOptions
from gossip.strategies.dpsgd.compression import default_gamma
from gossip.transport import LoopbackHub


def disagreement(x: torch.Tensor) -> float:
    return float(((x - x.mean(0)) ** 2).sum())


def test_identity_compressor_with_gamma_one_is_exact_gossip(run_peers, local_topology, oracle):
    """choco.md invariant 2: Q = identity, gamma = 1, x̂ = 0 gives x <- W x from step one."""
    topology = local_topology("erdos_renyi", 7, p=0.4, seed=3)
    x0 = torch.randn(7, 101, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = x0.clone()
    for _ in range(4):
        expected = oracle.mix(topology, expected.unsqueeze(0))[0]
    hub = LoopbackHub(7)
    final = [None] * 7

    def peer_main(rank):
        strategy = ChocoGossip(rank=rank, topology=topology, transport=hub.transport(rank),
                               options=DPSGDOptions(compressor=create("none"), gamma=1.0))
        x = x0[rank].clone()
        for round in range(4):
            x = strategy.synchronize(x, round)
        final[rank] = x

    run_peers(7, peer_main)
    torch.testing.assert_close(torch.stack(final), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loopback", [True, False], ids=["loopback", "zmq"])
def test_topk_keeps_the_average_and_replicas_consistent(loopback, iterate, local_topology):
    topology = local_topology("ring", 5)
    x0 = torch.randn(5, 301, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    final, strategies = iterate(topology, "dpsgd", x0, 20, loopback=loopback,
                                      compressor="topk", density=0.05)
    # invariant 1: the average is untouched by gossip, whatever Q dropped
    torch.testing.assert_close(final.mean(0), x0.mean(0), rtol=1e-12, atol=1e-12)
    # invariant 3: s_i is sum_j w_ij x̂_j over the public copies each peer really holds
    weights = torch.tensor(topology.mixing_matrix())
    public = torch.stack([s.public for s in strategies])
    for rank, strategy in enumerate(strategies):
        torch.testing.assert_close(strategy.mixed, weights[rank] @ public, rtol=1e-10,
                                   atol=1e-12)
    assert disagreement(final) < disagreement(x0)


@pytest.mark.slow  # 2000 rounds
def test_topk_one_percent_reaches_consensus(iterate, local_topology):
    """choco.md invariant 4 on a smaller ring: error below 1e-3 of its start with the
    default gamma (naive top-1% gossip stalls near 0.1)."""
    topology = local_topology("ring", 6)
    x0 = torch.randn(6, 2000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    final, strategies = iterate(topology, "dpsgd", x0, 2000, compressor="topk",
                                      density=0.01)
    assert strategies[0].gamma == pytest.approx(0.02)
    assert disagreement(final) < 1e-3 * disagreement(x0)
    torch.testing.assert_close(final.mean(0), x0.mean(0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("compressor, options", [
    pytest.param("randomk", {"density": 0.05}, marks=pytest.mark.slow),
    pytest.param("qsgd", {"levels": 16}, marks=pytest.mark.slow),
    pytest.param("terngrad", {}, marks=pytest.mark.slow),
    pytest.param("sign", {}, marks=pytest.mark.slow),
    ("fp16", {}),
    pytest.param("bf16", {}, marks=pytest.mark.slow),
])
def test_default_gamma_converges_for_every_compressor(compressor, options, iterate,
                                                      local_topology):
    topology = local_topology("ring", 4)
    x0 = torch.randn(4, 400, generator=torch.Generator().manual_seed(3))
    final, _ = iterate(topology, "dpsgd", x0, 300, compressor=compressor, **options)
    assert disagreement(final) < 0.05 * disagreement(x0)
    torch.testing.assert_close(final.mean(0), x0.mean(0), rtol=0, atol=5e-4)  # float32 sums


def test_default_gamma_follows_the_compressor():
    assert default_gamma(create("topk", density=0.01), 10_000) == pytest.approx(0.02)
    assert default_gamma(create("randomk", density=0.01), 10_000) == pytest.approx(0.005)
    assert default_gamma(create("fp16"), 10_000) == pytest.approx(1.0)
    assert 0.3 <= default_gamma(create("sign"), 10_000) <= 0.5


@pytest.mark.parametrize("options, message", [
    ({"compressor": "topk", "error_feedback": True}, "drop error_feedback"),
    ({"compressor": "topk", "momentum": 0.9}, "drop error_feedback/momentum"),
    ({"compressor": "topk", "clip_norm": 1.0}, "clips gradients"),
    ({"gamma": 0.1}, "needs a compressor"),
    ({"compressor": "topk", "gamma": 1.5}, "gamma"),
    ({"compressor": "topk", "levels": 4}, "no option 'levels'"),
    ({"compressor": "zip"}, "unknown compressor 'zip'"),
])
def test_bad_compression_options_name_the_fault(options, message, local_topology):
    topology = local_topology("ring", 3)
    with (pytest.raises(ConfigError, match=message),
          Peer(0, topology, "dpsgd", transport=LoopbackHub(3).transport(0), **options)):
        pass
