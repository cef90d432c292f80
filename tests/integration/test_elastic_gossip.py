"""Gossip under elastic views: dpsgd (and CHOCO) members rebuild their graph and
Metropolis-Hastings weights at each view's first round (gossip/strategies/elastic_gossip.py,
Topology.view_graph). Real peers over ZeroMQ on loopback, each a thread of this process.
Each peer's "model" is its vector x, mixed by ``synchronize`` once a round (no training), so
a round's outputs are W @ X exactly; a joiner takes its donor's x (and strategy state).
"""

from __future__ import annotations

import threading

import networkx as nx
import numpy as np
import pytest
import torch

from gossip.transport.state_bytes import state_from_bytes, state_to_bytes
from support import peer_once_all_bound
from support.waiting import pace_joins

TIMEOUT = 10.0
N = 23


class Killed(BaseException):
    """A member's way out of its thread once it "died" (kill -9: no goodbye)."""


def oracle_weights(graph: nx.Graph) -> dict[int, dict[int, float]]:
    """Metropolis-Hastings on ``graph`` (any node ids), computed here: w_ij = 1 / (1 +
    max(d_i, d_j)) per edge, w_ii the rest of the row."""
    degree = dict(graph.degree())
    rows = {i: {j: 1.0 / (1 + max(degree[i], degree[j])) for j in graph[i]} for i in graph}
    for i, row in rows.items():
        row[i] = 1.0 - sum(row.values())
    return rows


def exponential(n: int) -> nx.Graph:
    """i ~ i + 2^k mod n, built here."""
    return nx.Graph([(i, (i + 2 ** k) % n) for i in range(n) for k in range(n.bit_length())
                     if 2 ** k < n])


def graph_on(kind: str, members) -> nx.Graph:
    """The graph the rule gives a view: the generator's over the sorted ids."""
    ids = sorted(members)
    graph = {"ring": nx.cycle_graph, "exponential": exponential}[kind](len(ids))
    return nx.relabel_nodes(graph, dict(enumerate(ids)))


def run_gossip(run_peers, topology, *, members, rounds, joins=None, leaves=None, kills=None,
               strategy="dpsgd", on_open=None, **options):
    """Ranks < ``members`` run from round 0, each rank in ``joins`` enters once rank 0
    completed round ``joins[rank]`` (rank 0 waits for its ask); a rank in ``leaves`` leaves
    after that round, one in ``kills`` dies after it. Returns per rank: its first round, its
    x after each round (and the one it entered with, at first - 1), its W row at each round
    ({id: weight}, itself included), its view at each round, the state its donor handed it.
    ``on_open(rank, peer)`` is called as each peer opens."""
    size, joins, leaves, kills = topology.size, joins or {}, leaves or {}, kills or {}
    x0 = torch.randn(size, N, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
    all_bound = threading.Barrier(size, timeout=TIMEOUT)
    progress = threading.Condition()
    done = [-1]
    records = {rank: {"x": {}, "row": {}, "view": {}, "first": 0} for rank in range(size)}

    def main(rank: int):
        try:
            run(rank)
        except Killed:
            pass
        return records[rank]  # a killed peer's rounds too

    def run(rank: int):
        out = records[rank]
        with peer_once_all_bound(rank, topology, strategy, all_bound, timeout=TIMEOUT,
                                 dead_after=0.5, elastic=True, spares=size - members,
                                 **options) as peer:
            x = x0[rank].clone()
            if on_open is not None:
                on_open(rank, peer)
            if rank >= members:
                with progress:
                    assert progress.wait_for(lambda: done[0] >= joins[rank], timeout=TIMEOUT)
                entered = peer.enter()
                assert entered is not None
                out["first"], data = entered
                state = state_from_bytes(data)
                x = state["x"]
                peer.strategy.take_handover(state["strategy"])
                out["x"][out["first"] - 1] = x.clone()
                out["handed"] = state["strategy"]
            for round in range(out["first"], rounds):
                x = peer.synchronize(x, round)
                out["x"][round] = x.clone()
                out["view"][round] = peer.view
                mixing = getattr(peer.strategy, "mixing", peer.strategy)  # dpsgd's, CHOCO's
                out["row"][round] = {**mixing.weights, rank: mixing.self_weight}
                out["public"] = getattr(peer.strategy, "public", None)
                peer.hand_over(round, lambda: state_to_bytes(
                    {"x": x, "strategy": peer.strategy.handover_state()}))
                if kills.get(rank) == round:
                    peer.transport.close()
                    raise Killed
                if leaves.get(rank) == round:
                    peer.leave()
                    return
                if rank == 0:
                    pace_joins(peer, round, progress, done, joins, TIMEOUT)

    return run_peers(size, main, timeout=6 * TIMEOUT), x0


def ran(outcome, round):
    """The ranks that completed ``round``."""
    return sorted(r for r, out in enumerate(outcome) if round in out["x"])


@pytest.mark.parametrize("kind", ["ring", "exponential"])
def test_dpsgd_rebuilds_its_graph_at_each_view_after_a_join_a_leave_and_a_death(
        kind, local_topology, run_peers):
    """P = 5, then a join (6), a leave (5), a death (4): at each view's first round every
    member's row is the Metropolis-Hastings row of the generator's graph over the view's
    sorted ids (built here with networkx), sums to 1, and the round's outputs are W @ X (so
    the sum of the x's is kept); the joiner enters with its donor's x."""
    members, rounds = 5, 46
    topology = local_topology(kind, members + 1)
    outcome, _ = run_gossip(run_peers, topology, members=members, rounds=rounds,
                            joins={5: 1}, leaves={2: 16}, kills={3: 30})
    joiner = outcome[5]
    views = {}
    for out in outcome:
        for round, view in out["view"].items():
            views.setdefault(view.epoch, view)
    # one view per change, in order: the join, the leave, the death
    assert [views[e].members for e in sorted(views)] == [
        (0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5), (0, 1, 3, 4, 5), (0, 1, 4, 5)], views
    join, leave, death = (views[e] for e in sorted(views)[1:])
    assert joiner["first"] == join.round and join.round < 16 < leave.round < 30 < death.round
    donor = join.joins[5]
    assert torch.equal(joiner["x"][join.round - 1], outcome[donor]["x"][join.round - 1])
    for view in (join, leave, death):
        r = view.round
        assert ran(outcome, r) == list(view.members)
        oracle = oracle_weights(graph_on(kind, view.members))
        for m in view.members:
            row = outcome[m]["row"][r]
            assert row.keys() == oracle[m].keys(), (m, view)
            assert sum(row.values()) == pytest.approx(1.0, abs=1e-12)
            for j, w in oracle[m].items():
                assert row[j] == pytest.approx(w, abs=1e-12), (m, j, view)
        # the round on the new view: X_out = W X_in, the mean kept
        ids = list(view.members)
        w = np.array([[oracle[i].get(j, 0.0) for j in ids] for i in ids])
        before = np.stack([outcome[m]["x"][r - 1].numpy() for m in ids])
        after = np.stack([outcome[m]["x"][r].numpy() for m in ids])
        np.testing.assert_allclose(after, w @ before, rtol=0, atol=1e-12)
        np.testing.assert_allclose(after.mean(axis=0), before.mean(axis=0), rtol=0, atol=1e-12)
    # between the leave (and the death) and the next view, the neighbours drop the gone
    # member, its weight folded into their own: the sum over the living is kept
    for r in (17, 31):
        living = ran(outcome, r)
        before = sum(outcome[m]["x"][r - 1] for m in living)
        after = sum(outcome[m]["x"][r] for m in living)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


def test_choco_joiner_takes_its_donors_public_copy_and_its_neighbours_get_it_whole(
        local_topology, run_peers):
    """CHOCO (dpsgd with top-k) at P = 5 on a ring, one join: the joiner's x and x̂ are its
    donor's at the round before the view; at the view's first round every member's s_i is
    rebuilt from its neighbours' x̂ sent whole, bitwise w_ii x̂_i + sum_j w_ij x̂_j (their
    public copies agree with the owners'), and the round keeps the sum of the x's."""
    members, rounds = 5, 14
    topology = local_topology("ring", members + 1)
    public: dict[tuple[int, int], torch.Tensor] = {}  # (rank, round) -> x̂ before the round
    mixed: dict[tuple[int, int], torch.Tensor] = {}  # (rank, round) -> s_i after the resync

    def watch(rank, peer):
        inner = peer.strategy.inner
        exchange = inner.share_public

        def exchanging(round):
            public[rank, round] = inner.public.clone()
            exchange(round)
            mixed[rank, round] = inner.mixed.clone()
        inner.share_public = exchanging

    outcome, _ = run_gossip(run_peers, topology, members=members, rounds=rounds, joins={5: 1},
                            strategy="dpsgd", compressor="topk", density=0.3, on_open=watch)
    joiner = outcome[5]
    view = joiner["view"][joiner["first"]]
    r, donor = view.round, view.joins[5]
    assert torch.equal(joiner["x"][r - 1], outcome[donor]["x"][r - 1])
    assert torch.equal(public[5, r], public[donor, r])  # x̂: the donor's, handed over
    assert torch.equal(joiner["handed"]["public"], public[donor, r])
    oracle = oracle_weights(graph_on("ring", view.members))
    for m in view.members:
        expected = torch.mul(public[m, r], oracle[m][m])
        for j in sorted(oracle[m].keys() - {m}):
            expected.add_(public[j, r], alpha=oracle[m][j])
        assert torch.equal(mixed[m, r], expected), m
    before = sum(outcome[m]["x"][r - 1] for m in view.members)
    after = sum(outcome[m]["x"][r] for m in view.members)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)
