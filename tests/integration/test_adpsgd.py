"""AD-PSGD's lock-free pairwise exchange between real peers over ZeroMQ (threads), and the
asynchronous training loop: invariants instead of a round-by-round oracle, since no two
runs interleave the same way."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from gossip.config import TrainConfig
from gossip.device import HostStaging
from gossip.errors import ConfigError
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.tasks.digits import build_mlp
from gossip.training.snapshots import consensus_over_time
from gossip.training.synchronous import train
from gossip.transport import LoopbackHub
from support import peer_once_all_bound, run_in_threads


@pytest.mark.slow  # 1,000 exchanges among five threads: about a second on an idle machine
def test_many_exchanges_with_delays_conserve_the_sum_and_get_one_reply_each(local_topology):
    """lr = 0 in float64 on an odd ring, random delays between steps, each peer stopping
    once it completed its share of 1,000 exchanges (so they finish at different times):
    after the drain, the sum of models is the initial one, and every request got exactly
    one reply."""
    size, each = 5, 200
    topology = local_topology("ring", size)
    x0 = torch.randn(size, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    final, strategies, stats = [None] * size, [None] * size, [None] * size
    all_bound, hub = threading.Barrier(size, timeout=10), LoopbackHub(size)

    def main(rank: int) -> None:
        delays = random.Random(rank)
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "adpsgd", all_bound, hub=hub,
                                 seed=rank) as peer:
            round = 0
            while peer.strategy.exchanges < each:
                x = peer.synchronize(x, round, out=x)
                time.sleep(delays.random() * 0.0005)  # injected delay: up to 0.5 ms a step
                round += 1
        final[rank], strategies[rank], stats[rank] = x, peer.strategy, peer.stats

    run_in_threads(size, main, timeout=60)
    total = torch.stack(final).sum(0)
    torch.testing.assert_close(total, x0.sum(0), rtol=1e-12, atol=1e-12 * x0.abs().sum())
    requests = sum(s.next_id for s in strategies)
    assert sum(s.exchanges for s in strategies) == requests >= size * each
    assert sum(s.answered for s in strategies) == requests
    by_kind = [s["by_kind"] for s in stats]
    sent = {kind: sum(k[kind]["messages_sent"] for k in by_kind) for kind in
            ("adpsgd.req", "adpsgd.rep")}
    assert sent["adpsgd.req"] == sent["adpsgd.rep"] == requests
    assert not torch.equal(torch.stack(final), x0)  # they did mix


def test_staged_through_host_memory_no_exchange_move_is_lost(local_topology, monkeypatch):
    """The path of a CUDA tensor, forced on CPU: the Peer stages every tensor through its host
    buffer. Polls and ``finish`` move that buffer between calls; the next call must add the
    caller's step to it, not copy the caller's tensor over it (the sum drifted by 0.1), and
    the moves ``finish`` made reach the caller's tensor. Each peer's step adds a known
    amount, so the final sum is the initial one plus every step."""
    monkeypatch.setattr(HostStaging, "run", HostStaging.stage)
    size, calls = 5, 60
    topology = local_topology("ring", size)
    x0 = torch.randn(size, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    final, staged = [None] * size, [None] * size
    all_bound, hub = threading.Barrier(size, timeout=10), LoopbackHub(size)

    def main(rank: int) -> None:
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "adpsgd", all_bound, hub=hub,
                                 seed=rank) as peer:
            for round in range(calls):
                x.add_(0.001 * (rank + 1))  # the caller's own step between calls
                x = peer.synchronize(x, round, out=x)
                peer.strategy.poll()  # exchanges applied between calls (as between batches)
                time.sleep(0.0005)
            staged[rank] = peer.strategy.exchanges + peer.strategy.answered
        final[rank] = x

    run_in_threads(size, main, timeout=60)
    assert sum(staged) > 0  # exchanges were applied on the staged buffer
    steps = sum(calls * 0.001 * (rank + 1) for rank in range(size))
    total = torch.stack(final).sum(0)
    torch.testing.assert_close(total, x0.sum(0) + steps, rtol=1e-12,
                               atol=1e-12 * (x0.abs().sum() + steps * 11))


def test_a_pair_is_bitwise_equal_after_one_exchange(local_topology, run_peers):
    """Bipartite on two peers: rank 0 asks, rank 1 only answers; small-integer models."""
    topology = local_topology("ring", 2)
    x0 = torch.tensor([[3.0, -8.0, 5.0], [6.0, 1.0, 0.0]])
    final = [None, None]
    all_bound = threading.Barrier(2, timeout=10)

    def main(rank: int) -> None:
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "adpsgd", all_bound, bipartite=True) as peer:
            peer.synchronize(x, 0, out=x)
        final[rank] = (x, peer.strategy.exchanges, peer.strategy.answered)

    run_peers(2, main)
    assert final[0][1:] == (1, 0) and final[1][1:] == (0, 1)
    assert torch.equal(final[0][0], final[1][0])
    assert torch.equal(final[0][0], x0.mean(0))


def test_bipartite_needs_a_two_colourable_graph():
    with pytest.raises(ConfigError, match=r"not 2-colourable \(odd cycle"):
        with Peer(0, local_ring(5), "adpsgd", transport=LoopbackHub(5).transport(0),
                  bipartite=True):
            pass


def local_ring(n: int):
    from gossip.topology import Topology
    return Topology.ring(n)


@pytest.mark.slow  # waits out a dead peer's dead_after
def test_a_dead_neighbour_is_skipped(local_topology):
    """Rank 2 of a ring of 3 dies mid-run (closes without goodbye); the others notice, never
    pick it again, and still finish cleanly with each other."""
    topology = local_topology("ring", 3)
    x0 = torch.arange(9, dtype=torch.float64).reshape(3, 3)
    partners_after, all_bound = {}, threading.Barrier(3, timeout=10)

    def main(rank: int) -> None:
        x = x0[rank].clone()
        try:
            with peer_once_all_bound(rank, topology, "adpsgd", all_bound, dead_after=0.3,
                                     timeout=10) as peer:
                for round in range(5):
                    peer.synchronize(x, round, out=x)
                    time.sleep(0.002)
                if rank == 2:
                    raise RuntimeError("killed")  # the error path: no goodbye, linger 0
                deadline = time.monotonic() + 5
                round = 5
                while 2 not in peer.transport.membership.firsthand():
                    assert time.monotonic() < deadline, "rank 2 never declared dead"
                    peer.synchronize(x, round, out=x)
                    time.sleep(0.01)
                    round += 1
                before = peer.strategy.exchanges
                for round in range(round, round + 20):
                    peer.synchronize(x, round, out=x)
                    time.sleep(0.002)
                    assert peer.strategy.outstanding is None or \
                        peer.strategy.outstanding[0] != 2
                partners_after[rank] = peer.strategy.exchanges - before
        except RuntimeError as exc:
            assert str(exc) == "killed" and rank == 2

    run_in_threads(3, main, timeout=30)
    assert partners_after[0] > 0 and partners_after[1] > 0  # they went on with each other


@pytest.mark.slow  # three Trainers (task, data, evaluation per round): seconds on 2 cores
def test_peers_with_different_budgets_all_finish_and_leave_snapshots(local_topology, tmp_path):
    """The asynchronous loop: ranks train 2, 5 and 8 steps of adpsgd with no barrier and
    all return; no consensus probe (a round-keyed all-reduce) runs. The consensus comes
    from snapshots instead: the final one is the models the peers end with."""
    size = 3
    topology = local_topology("ring", size)
    hub = LoopbackHub(size)
    records, models = [[] for _ in range(size)], [build_mlp() for _ in range(size)]

    def main(rank: int) -> None:
        config = TrainConfig(strategy="adpsgd", rounds=2 + 3 * rank, batch_size=8,
                             eval_every=1, timeout=10, snapshot_seconds=0.01)
        with Peer(rank, topology, "adpsgd", transport=hub.transport(rank, timeout=10)) as peer, \
                MetricsWriter(tmp_path / f"peer-{rank}.jsonl") as metrics:
            train(peer, config, metrics=metrics, on_round=records[rank].append,
                  model=models[rank])
            assert peer.strategy.exchanges > 0

    run_in_threads(size, main, timeout=60)
    assert [len(r) for r in records] == [2, 5, 8]
    assert all(line["consensus"] is None for r in records for line in r)
    assert all("staleness" not in line for r in records for line in r)
    rows = consensus_over_time(tmp_path / "snapshots")
    ends = torch.stack([parameters_to_vector(m.parameters()).double() for m in models])
    oracle = ((ends - ends.mean(0)) ** 2).sum(1).mean().item()
    assert rows[-1]["tick"] is None and rows[-1]["peers"] == size
    assert rows[-1]["consensus"] == pytest.approx(oracle, rel=1e-12)
    assert all(row["peers"] >= 2 for row in rows) and len(rows) >= 2  # ticks mid-run too


@pytest.mark.slow  # three Trainers: seconds on 2 cores
def test_budgets_in_samples_and_seconds_stop_each_peer_where_they_say(local_topology):
    """Rank 0 stops after 24 samples (3 steps of 8), rank 1 once 0.4 s of training have
    passed (0.1 s of emulated compute per step), rank 2 after its 4 rounds; all return."""
    size = 3
    topology = local_topology("ring", size)
    hub = LoopbackHub(size)
    records = [[] for _ in range(size)]
    budgets = [{"rounds": 50, "budget_samples": 24},
               {"rounds": 50, "budget_seconds": 0.4, "delays": {"compute": 0.1}},
               {"rounds": 4}]

    def main(rank: int) -> None:
        config = TrainConfig.from_dict({"strategy": "adpsgd", "batch_size": 8, "timeout": 10,
                                        **budgets[rank]})
        with Peer(rank, topology, "adpsgd", transport=hub.transport(rank, timeout=10)) as peer:
            train(peer, config, on_round=records[rank].append)

    run_in_threads(size, main, timeout=60)
    assert [r["samples"] for r in records[0]] == [8, 8, 8]
    times = [r["time"] for r in records[1]]
    assert 1 <= len(times) < 50 and times[-1] >= 0.4 and all(t < 0.4 for t in times[:-1]), times
    assert len(records[2]) == 4


@pytest.mark.parametrize("budget", [{"budget_samples": 64}, {"budget_seconds": 2.0}])
def test_budgets_in_samples_or_seconds_need_an_asynchronous_strategy(budget):
    with pytest.raises(ConfigError, match="budget_samples/budget_seconds with strategy dpsgd: "
                                          "it runs in lockstep rounds"):
        TrainConfig(strategy="dpsgd", **budget)
    with pytest.raises(ConfigError, match="budget_samples: -1 must be >= 0"):
        TrainConfig(strategy="adpsgd", budget_samples=-1)
    TrainConfig(strategy="adpsgd", **budget)


# -- liveness: a busy neighbour is not a dead one ---------------------------------------------


@pytest.mark.slow  # the slow peer computes longer than the timeout on purpose
@pytest.mark.parametrize("graph, size, bipartite, slow", [("ring", 4, True, 1),
                                                          ("line", 3, False, 1)])
def test_a_neighbour_computing_longer_than_the_timeout_is_waited_for(local_topology, graph,
                                                                     size, bipartite, slow):
    """Bug 10: one peer's steps take longer than ``timeout`` (0.6 s of compute each, timeout
    0.3 s); the others finish theirs at once and wait in ``finish`` for its reply and its
    done. It is alive (its link answers heartbeats), so they wait instead of giving up:
    everyone returns, nobody is declared dead, and no exchange is cut in half (lr = 0 in
    float64: the sum of models is the initial one)."""
    topology = local_topology(graph, size)
    x0 = torch.randn(size, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    final, lost = [None] * size, [None] * size
    all_bound = threading.Barrier(size, timeout=10)

    def main(rank: int) -> None:
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "adpsgd", all_bound, bipartite=bipartite,
                                 timeout=0.3, dead_after=5.0) as peer:
            for round in range(3):
                if rank == slow:
                    time.sleep(0.6)  # computing: no message leaves this peer meanwhile
                peer.synchronize(x, round, out=x)
        final[rank], lost[rank] = x, dict(peer.transport.membership.lost)

    run_in_threads(size, main, timeout=60)
    assert lost == [{}] * size
    torch.testing.assert_close(torch.stack(final).sum(0), x0.sum(0), rtol=1e-12, atol=1e-12)


def test_a_peer_that_takes_no_step_leaves_without_stalling_its_neighbours(local_topology):
    """Bug 11: rank 2 enters and leaves ``with Peer(...)`` without a step. Its goodbye
    reaches the neighbours it is linked to, so they neither wait for its hello nor take its
    leaving for a death (before: they waited for its hello until ``dead_after`` declared it
    dead)."""
    size = 3
    topology = local_topology("ring", size)
    x0 = torch.randn(size, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lost, exchanges = {}, {}
    all_bound, left = threading.Barrier(size, timeout=10), threading.Event()

    def main(rank: int) -> None:
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "adpsgd", all_bound, timeout=30,
                                 dead_after=2.0) as peer:
            if rank == 2:
                return
            left.wait(10)
            for round in range(5):
                peer.synchronize(x, round, out=x)
        lost[rank], exchanges[rank] = (dict(peer.transport.membership.lost),
                                       peer.strategy.exchanges)

    def run(rank: int) -> None:
        try:
            main(rank)
        finally:
            if rank == 2:
                left.set()

    run_in_threads(size, run, timeout=60)
    assert lost == {0: {}, 1: {}}
    assert exchanges[0] + exchanges[1] > 0  # they went on with each other


@pytest.mark.slow  # the neighbours start 1.5 s late on purpose
def test_a_peer_that_leaves_before_its_neighbours_start_still_tells_them(local_topology):
    """Bug 11, in a launch: rank 2 takes no step and leaves before its neighbours have even
    bound their addresses (they start 1.5 s later, past its goodbye's 1 s flush). It waits
    until its links are up, so its goodbye arrives: the neighbours do not wait for its
    hello (before: they did, until ``timeout``)."""
    size = 3
    topology = local_topology("ring", size)
    lost, left = {}, threading.Event()

    def main(rank: int) -> None:
        if rank != 2:
            left.wait(10)
            time.sleep(1.5)
        with Peer(rank, topology, "adpsgd", timeout=5.0, dead_after=2.0) as peer:
            if rank == 2:
                left.set()
                return
            x = torch.full((4,), float(rank), dtype=torch.float64)
            for round in range(3):
                peer.synchronize(x, round, out=x)
        lost[rank] = dict(peer.transport.membership.lost)

    run_in_threads(size, main, timeout=60)
    assert lost == {0: {}, 1: {}}
