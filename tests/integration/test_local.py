"""Local SGD (``local``) against oracles: mini-batch SGD at H = 1, bytes only in averaging
rounds, bitwise agreement after exact and group averages, the warm-up, the optimizer state,
and model buffers synchronized by parameter strategies."""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.transport import LoopbackHub
from support import BatchNormNet, peer_once_all_bound, run_in_threads, run_training_steps

TIMEOUT = 10.0


def test_period_one_with_plain_sgd_is_ring_allreduce_training(local_topology):
    topology = local_topology("ring", 3)
    local = run_training_steps(topology, "local", steps=3, loopback=True, period=1)
    ring = run_training_steps(topology, "ring-allreduce", steps=3, loopback=True)
    torch.testing.assert_close(local.after, ring.after, rtol=1e-6, atol=1e-6)


def test_warmup_rounds_average_gradients_then_nothing_is_sent(local_topology):
    """Post-local SGD: the warm-up rounds are ring-allreduce's gradient steps (bitwise), the
    next local round changes each peer by its own gradient only."""
    topology = local_topology("ring", 3)
    local = run_training_steps(topology, "local", steps=3, loopback=True, period=50,
                               warmup_rounds=2)
    ring = run_training_steps(topology, "ring-allreduce", steps=2, loopback=True)
    assert torch.equal(local.after[:2], ring.after)
    torch.testing.assert_close(local.after[2], local.before[2] - 0.1 * local.grads[2])


def _sync_rounds(topology, rounds: int, sizes: dict, *, dim: int = 7, **options):
    """Each peer synchronizes rank-specific integers for ``rounds`` rounds with ``local``
    (and one ``ring-allreduce`` reference round, tag ``rref``); returns results
    ``[round][rank]`` and per-round bytes sent ``[rank][round]``."""
    size = topology.size
    results = [[None] * size for _ in range(rounds)]
    sent = [[0] * rounds for _ in range(size)]
    bound = threading.Barrier(size, timeout=TIMEOUT)

    def main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, "local", bound, timeout=TIMEOUT,
                                 **options) as peer:
            ref = peer.add_strategy("ring-allreduce", tag="rref")
            before = peer.stats["bytes_sent"]
            ref.synchronize(torch.ones(dim, dtype=torch.float64), 0)
            sizes[rank] = peer.stats["bytes_sent"] - before
            for round in range(rounds):
                before = peer.stats["bytes_sent"]
                x = torch.arange(dim, dtype=torch.float64) * (rank + 1) + round
                results[round][rank] = peer.synchronize(x, round)
                sent[rank][round] = peer.stats["bytes_sent"] - before

    run_in_threads(size, main, timeout=3 * TIMEOUT)
    return results, sent


def test_bytes_grow_only_in_averaging_rounds_and_peers_agree_bitwise_after(local_topology):
    topology = local_topology("ring", 5)
    ring_bytes: dict[int, int] = {}
    results, sent = _sync_rounds(topology, 7, ring_bytes, period=3, warmup_rounds=1)
    averaging = {0, 3, 6}  # the warm-up round, then every third
    for rank in range(5):
        for round in range(7):
            expected = ring_bytes[rank] if round in averaging else 0
            assert sent[rank][round] == expected, (rank, round)
    for round in range(7):
        row = results[round]
        if round in averaging:
            assert all(torch.equal(y, row[0]) for y in row), round
            mean = torch.stack([torch.arange(7.0, dtype=torch.float64) * (r + 1) + round
                                for r in range(5)]).mean(0)
            torch.testing.assert_close(row[0], mean)
        else:
            for rank, y in enumerate(row):
                assert torch.equal(y, torch.arange(7.0, dtype=torch.float64) * (rank + 1) + round)


def test_hierarchical_groups_equal_their_group_mean_bitwise(local_topology):
    topology = local_topology("ring", 5)
    groups = [[0, 2, 4], [1, 3]]
    results, sent = _sync_rounds(topology, 4, {}, period=4, group_period=2, groups=groups)
    inputs = [[torch.arange(7, dtype=torch.float64) * (r + 1) + round for r in range(5)]
              for round in range(4)]
    for group in groups:  # round 1: a group round; the oracle sums in rank order too
        total = inputs[1][group[0]].clone()
        for r in group[1:]:
            total.add_(inputs[1][r])
        for r in group:
            assert torch.equal(results[1][r], total / len(group))
            assert sent[r][1] == sent[group[0]][1] > 0
    for r in range(5):  # round 3: global (ring) average; rounds 0 and 2: nothing sent
        assert torch.equal(results[3][r], results[3][0])
        assert sent[r][0] == sent[r][2] == 0


def test_groups_must_nest_and_cover_every_rank(local_topology):
    with pytest.raises(ConfigError, match="group_period must divide period"):
        Peer(0, local_topology("ring", 3), "local", period=4, group_period=3)
    hub = LoopbackHub(3)
    with pytest.raises(ConfigError, match="rank 2 is in no group"):
        with Peer(0, local_topology("ring", 3), "local", transport=hub.transport(0),
                  period=4, group_period=2, groups=[[0, 1]]):
            pass


@pytest.mark.parametrize("strategy, options", [
    ("dpsgd", {}), ("local", {"period": 1, "optimizer_state": "average"}),
    ("local", {"period": 1, "optimizer_state": "reset"})])
def test_parameter_strategies_synchronize_buffers_and_optimizer_state(
        strategy, options, local_topology):
    """BatchNorm running statistics are mixed like the parameters (complete graph of 3:
    every Metropolis weight 1/3, so D-PSGD and the exact mean agree up to rounding); with
    ``average`` the momentum too, with ``reset`` it is gone."""
    topology = local_topology("complete", 3)
    hub = LoopbackHub(3)
    stats, momenta, states = [None] * 3, [None] * 3, [None] * 3

    def main(rank: int) -> None:
        model = BatchNormNet()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p) + i)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.arange(12.0).view(4, 3) * (rank + 1)
        with Peer(rank, topology, strategy, transport=hub.transport(rank, timeout=TIMEOUT),
                  **options) as peer:
            model(x).pow(2).sum().backward()
            local = model.norm.running_mean.clone()
            peer.step(model, optimizer)
        stats[rank] = (local, model.norm.running_mean.clone(), model.norm.running_var.clone())
        states[rank] = dict(optimizer.state)
        momenta[rank] = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]

    run_in_threads(3, main, timeout=3 * TIMEOUT)
    mean = torch.stack([s[0] for s in stats]).mean(0)
    for _, running_mean, _ in stats:
        torch.testing.assert_close(running_mean, mean)
    if options.get("optimizer_state") == "average":
        for p in range(len(momenta[0])):
            assert all(torch.equal(m[p], momenta[0][p]) for m in momenta)
    if options.get("optimizer_state") == "reset":
        assert all(not state for state in states)
