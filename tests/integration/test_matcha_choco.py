"""matcha with a compressor: CHOCO's compressed differences on per-edge public copies.

Oracles: exact MATCHA (W(k) @ X, activations drawn by test_matcha's independent schedule) for
the identity compressor at gamma 1; the invariants of choco.md otherwise (average preserved,
both ends of an edge hold bit-identical copies, consensus reached).
"""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.compress import create
from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.strategies.matcha import ChocoMatcha, MatchaOptions
from gossip.topology import matcha
from gossip.transport import LoopbackHub


def disagreement(x: torch.Tensor) -> float:
    return float(((x - x.mean(0)) ** 2).sum())


@pytest.mark.parametrize("kind, n, params", [("ring", 3, {}), ("irregular-7", None, {}),
                                             ("torus", None, {"rows": 2, "cols": 4})])
def test_identity_compressor_with_gamma_one_is_exact_matcha(kind, n, params, run_peers,
                                                            local_topology, oracle):
    topology = local_topology(kind, n, **params)
    x0 = torch.randn(topology.size, 53, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(0))
    hub = LoopbackHub(topology.size)
    final = [None] * topology.size

    def peer_main(rank: int) -> None:
        strategy = ChocoMatcha(rank=rank, topology=topology, transport=hub.transport(rank),
                               options=MatchaOptions(compressor=create("none"), gamma=1.0,
                                                     seed=5))
        x = x0[rank].clone()
        for round in range(12):
            x = strategy.synchronize(x, round, out=x)
        final[rank] = x

    run_peers(topology.size, peer_main)
    final = torch.stack(final)
    plan = matcha.plan(topology, 0.5)
    expected = x0.numpy()
    for k in range(12):
        expected = oracle.matcha_mixing(plan, 5, k) @ expected
    torch.testing.assert_close(final, torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loopback", [True, False], ids=["loopback", "zmq"])
def test_topk_keeps_the_average_and_edge_copies_identical(loopback, iterate, local_topology):
    topology = local_topology("irregular-7")
    x0 = torch.randn(7, 301, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    final, strategies = iterate(topology, "matcha", x0, 30, loopback=loopback,
                                      compressor="topk", density=0.05)
    torch.testing.assert_close(final.mean(0), x0.mean(0), rtol=1e-12, atol=1e-12)
    for i, strategy in enumerate(strategies):
        assert set(strategy.mine) == set(strategy.theirs) <= set(topology.neighbors(i))
        for j, copy in strategy.mine.items():  # what j holds of i is what i thinks it holds
            assert torch.equal(strategies[j].theirs[i], copy)
    assert disagreement(final) < disagreement(x0)


@pytest.mark.slow  # hundreds of rounds each
@pytest.mark.parametrize("compressor, options, rounds, reach", [
    ("topk", {"density": 0.05}, 400, 1e-3),
    ("randomk", {"density": 0.05}, 400, 0.05),
    ("qsgd", {}, 150, 1e-3),
    ("sign", {}, 300, 0.01),
])
def test_default_gamma_reaches_consensus(compressor, options, rounds, reach, iterate,
                                         local_topology):
    """choco.md invariant 4 on a time-varying graph: with the default gamma the disagreement
    falls below ``reach`` of its start (1e-3 for top-k and QSGD), the average untouched."""
    topology = local_topology("ring", 6)
    x0 = torch.randn(6, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    final, _ = iterate(topology, "matcha", x0, rounds, compressor=compressor, **options)
    assert disagreement(final) < reach * disagreement(x0)
    torch.testing.assert_close(final.mean(0), x0.mean(0), rtol=1e-10, atol=1e-12)


def test_compressed_matcha_trains_through_peer_step(local_topology, run_peers):
    """peer.step on a tiny model: parameters mix after the local update, the average of the
    peers' parameters equals the average of their locally updated ones."""
    topology = local_topology("ring", 4)
    after, before = [None] * 4, [None] * 4

    def peer_main(rank: int) -> None:
        torch.manual_seed(rank)
        model = torch.nn.Linear(5, 3, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with Peer(rank, topology, "matcha", timeout=10, compressor="topk",
                  density=0.3, budget=1.0) as peer:
            model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
            with torch.no_grad():
                local = [p - 0.1 * p.grad for p in model.parameters()]
            peer.step(model, optimizer)
            before[rank] = torch.cat([t.reshape(-1) for t in local])
            after[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    run_peers(4, peer_main, timeout=60)
    torch.testing.assert_close(torch.stack(after).mean(0), torch.stack(before).mean(0))
    assert not torch.equal(torch.stack(after), torch.stack(before))


@pytest.mark.parametrize("options, message", [
    ({"compressor": "topk", "error_feedback": True}, "drop error_feedback"),
    ({"compressor": "topk", "clip_norm": 1.0}, "clips gradients"),
    ({"gamma": 0.1}, "needs a compressor"),
    ({"compressor": "topk", "gamma": 0.0}, "gamma"),
])
def test_bad_compression_options_name_the_fault(options, message, local_topology):
    topology = local_topology("ring", 3)
    with (pytest.raises(ConfigError, match=message),
          Peer(0, topology, "matcha", transport=LoopbackHub(3).transport(0), **options)):
        pass


def test_one_tensor_per_instance(local_topology):
    topology = local_topology("ring", 2)
    hub = LoopbackHub(2)
    options = MatchaOptions(compressor=create("topk", density=0.5), budget=1.0)
    strategy = ChocoMatcha(rank=0, topology=topology, transport=hub.transport(0),
                           options=options)
    other = ChocoMatcha(rank=1, topology=topology, transport=hub.transport(1),
                        options=options)
    threads = [threading.Thread(target=s.synchronize, args=(torch.ones(4), 0))
               for s in (strategy, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    with pytest.raises(ConfigError, match="one tensor of 4 torch.float32; got 5"):
        strategy.synchronize(torch.ones(5), 1)
