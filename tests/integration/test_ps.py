"""Parameter servers (``ps``) against oracles, real peers over ZeroMQ on loopback: sync is
the mean, bitwise on every worker; S = P colocated shards move ring-allreduce's payload;
async unit-vector deltas count pushes exactly; ssp pulls are never more than s clocks
stale; dead servers and workers are named errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from click.testing import CliRunner

from gossip.cli import main
from gossip.config import TrainConfig
from gossip.errors import ConfigError, PeerGone
from gossip.sim import NetworkModel, Simulation, simulate_run
from gossip.strategies import STRATEGIES
from gossip.strategies.ps.shards import participants
from gossip.topology import Topology
from gossip.transport import Message
from support import make_local_topology, peer_once_all_bound, run_in_threads

TIMEOUT = 10.0


def ps_topology(size: int, servers: list[int] | None) -> Topology:
    """``size`` peers on free local ports; ``servers`` serve only (None: no roles, every
    peer trains and serves a shard)."""
    plain = make_local_topology("complete", size)
    if servers is None:
        return plain
    data = {**plain.to_dict(), "servers": servers}
    del data["edges"]  # implied: every worker linked to every server
    return Topology.from_dict(data)


def run_ps(topology: Topology, body, **options) -> list:
    """``body(peer, rank)`` on every worker; servers only serve. Returns body's results."""
    bound = threading.Barrier(topology.size, timeout=TIMEOUT)
    workers = topology.roles.workers if topology.roles else range(topology.size)

    def main(rank: int):
        with peer_once_all_bound(rank, topology, "ps", bound, timeout=TIMEOUT,
                                 **options) as peer:
            if rank not in workers:
                peer.serve()
                return peer.strategy
            return body(peer, rank)

    return run_in_threads(topology.size, main, timeout=4 * TIMEOUT)


@pytest.mark.parametrize("scale", [float("nan"), -1, 0, float("inf")])
def test_scale_must_be_a_positive_finite_number(scale):
    """Refused at start: with NaN every reply was rejected as non-finite, then a timeout."""
    with pytest.raises(ConfigError, match="^scale must be a positive finite number, got"):
        STRATEGIES.options("ps", {"mode": "async", "scale": scale})
    assert STRATEGIES.options("ps", {"mode": "async", "scale": 0.5}).scale == 0.5


@pytest.mark.parametrize("size, servers", [(5, None), (4, [0]), (5, [1, 3])])
def test_sync_is_the_mean_bitwise_on_every_worker(size, servers):
    topology = ps_topology(size, servers)
    workers = topology.roles.workers if topology.roles else tuple(range(size))
    data = {w: torch.randn(3, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(w))
            for w in workers}
    results = run_ps(topology, lambda peer, rank: [peer.synchronize(data[rank][r], r)
                                                   for r in range(3)])
    for r in range(3):
        mean = torch.stack([data[w][r] for w in workers]).mean(0)
        first = results[workers[0]][r]
        torch.testing.assert_close(first, mean)
        assert all(torch.equal(results[w][r], first) for w in workers)


def test_partial_participation_averages_the_drawn_workers_only():
    """Each round the workers drawn from (seed, round) push; every worker gets their mean."""
    topology = ps_topology(5, None)
    data = torch.arange(5 * 3 * 7, dtype=torch.float64).view(5, 3, 7) ** 1.5
    results = run_ps(topology, lambda peer, rank: [peer.synchronize(data[rank, r], r)
                                                   for r in range(3)],
                     participation=0.6, seed=4)
    drawn = [participants(tuple(range(5)), 0.6, 4, r) for r in range(3)]
    assert len(set(drawn)) > 1 and all(len(d) == 3 for d in drawn)
    for r in range(3):
        torch.testing.assert_close(results[0][r], data[list(drawn[r]), r].mean(0))
        assert all(torch.equal(results[w][r], results[0][r]) for w in range(5))


def test_colocated_shards_send_ring_allreduces_payload():
    """S = P, every peer a worker and a server: each peer's tensor bytes equal those of
    ring-allreduce on the same peers and vector (2 (P - 1) / P of it)."""
    topology = ps_topology(3, None)
    payload = {}
    bound = threading.Barrier(3, timeout=TIMEOUT)

    def main(rank: int) -> None:
        counted = {"ps": 0, "ring": 0}
        with peer_once_all_bound(rank, topology, "ps", bound, timeout=TIMEOUT) as peer:
            ring = peer.add_strategy("ring-allreduce")
            send = peer.transport.send

            def counting(dst, msg, **kw):
                counted[msg.kind.split(".")[0]] += sum(b.numel() * b.element_size()
                                                       for b in msg.buffers)
                return send(dst, msg, **kw)

            peer.transport.send = counting
            x = torch.arange(12, dtype=torch.float32) + rank
            peer.synchronize(x, 0)
            ring.synchronize(x, 0)
            peer.transport.send = send
        payload[rank] = counted

    run_in_threads(3, main, timeout=3 * TIMEOUT)
    for rank in range(3):
        assert payload[rank]["ps"] == payload[rank]["ring"] == 2 * 2 * 4 * 4, payload


def test_async_unit_deltas_count_every_push():
    """Worker w pushes e_w at every step (scale 1): each pull is a vector of push counts
    whose own entry is the puller's count so far; the servers end at the exact counts."""
    topology = ps_topology(5, [0, 1])  # 2 servers, workers 2, 3, 4
    steps = {2: 4, 3: 6, 4: 5}

    def body(peer, rank):
        x = peer.synchronize(torch.zeros(5), 0)  # the common start: the mean of zeros
        for step in range(1, steps[rank] + 1):
            x = x.clone()
            x[rank] += 1
            x = peer.synchronize(x, step)
            assert x[rank] == step and bool((x == x.round()).all()), x
            assert all(0 <= x[w] <= steps[w] for w in steps), x
            time.sleep(0.002 * rank)
        return x

    results = run_ps(topology, body, mode="async", scale=1.0)
    model = torch.cat([results[0].server.model, results[1].server.model])
    assert model.tolist() == [0, 0, 4, 6, 5]


def test_shard_k_lives_on_the_kth_server_listed():
    """servers: [3, 1]: the first shard of the vector on rank 3, the second on rank 1."""
    topology = ps_topology(5, [3, 1])
    x = torch.arange(7, dtype=torch.float64)
    results = run_ps(topology, lambda peer, rank: peer.synchronize(x.clone(), 0), mode="async")
    assert all(torch.equal(results[w], x) for w in (0, 2, 4))
    assert results[3].server.model.tolist() == [0, 1, 2]  # bounds(7, 2): [0, 3), [3, 7)
    assert results[1].server.model.tolist() == [3, 4, 5, 6]


def test_ssp_pulls_are_never_more_than_s_clocks_stale():
    topology = ps_topology(4, [0])  # workers 1, 2, 3; worker 3 is slow
    s = 1

    def body(peer, rank):
        x = peer.synchronize(torch.zeros(4), 0)
        for step in range(1, 7):
            x = x.clone()
            x[rank] += 1
            if rank == 3:
                time.sleep(0.03)
            x = peer.synchronize(x, step)
            assert all(x[w] >= step - s for w in (1, 2, 3)), (rank, step, x)
        return peer.strategy.pulled_clocks

    results = run_ps(topology, body, mode="ssp", staleness=s, scale=1.0)
    for rank in (1, 2, 3):
        assert all(low >= clock - s for clock, low in results[rank]), results[rank]


def test_backup_steps_use_the_first_pushes_and_the_late_worker_gets_the_same_means():
    """backup 1, worker 3 always last: each step is the mean of workers 1 and 2, and worker
    3, holding answers of steps it has not pushed yet, gets each step's own mean."""
    topology = ps_topology(4, [0])
    closed = [threading.Barrier(3, timeout=TIMEOUT) for _ in range(3)]

    def body(peer, rank):
        out = []
        for r in range(3):
            if rank == 3:
                closed[r].wait()  # step r closed without us: workers 1 and 2 got its mean
            out.append(peer.synchronize(torch.full((5,), float(rank * 10 + r)), r))
            if rank != 3:
                closed[r].wait()
        return out

    results = run_ps(topology, body, backup=1)
    for r in range(3):
        assert torch.equal(results[1][r], torch.full((5,), 15.0 + r)), results[1]
        assert torch.equal(results[3][r], results[1][r]) and torch.equal(results[2][r],
                                                                         results[1][r])
    assert results[0].server.late_pushes == 3


@pytest.mark.slow
def test_a_dead_server_is_a_named_error_on_every_worker():
    data = make_local_topology("complete", 3).to_dict()
    data["peers"][0]["role"] = "both"  # the others are workers
    topology = Topology.from_dict(data)
    bound = threading.Barrier(3, timeout=TIMEOUT)
    errors = {}

    def main(rank: int) -> None:
        try:
            with peer_once_all_bound(rank, topology, "ps", bound, timeout=TIMEOUT,
                                     dead_after=0.5) as peer:
                peer.synchronize(torch.ones(4), 0)  # every link is up
                if rank == 0:
                    raise RuntimeError("the server crashes")
                peer.synchronize(torch.ones(4), 1)
        except (RuntimeError, PeerGone) as exc:
            errors[rank] = exc

    run_in_threads(3, main, timeout=3 * TIMEOUT)
    for rank in (1, 2):
        assert isinstance(errors[rank], PeerGone), errors
        assert "parameter server 0" in str(errors[rank]) and "shard 0" in str(errors[rank])


@pytest.mark.slow
def test_a_dead_worker_stops_a_sync_server_by_name_or_is_covered_by_a_backup():
    for backup, expected in ((0, PeerGone), (1, None)):
        topology = ps_topology(4, [0])
        bound = threading.Barrier(4, timeout=TIMEOUT)
        outcome = {}

        def main(rank: int) -> None:
            try:
                with peer_once_all_bound(rank, topology, "ps", bound, timeout=TIMEOUT,
                                         dead_after=0.5, backup=backup) as peer:
                    if rank == 0:
                        peer.serve()
                        return
                    peer.synchronize(torch.zeros(4), 0)  # every link is up
                    if rank == 3:
                        raise RuntimeError("a worker crashes")
                    outcome[rank] = peer.synchronize(torch.full((4,), float(rank)), 1)
            except (RuntimeError, PeerGone) as exc:
                outcome[rank] = exc

        run_in_threads(4, main, timeout=3 * TIMEOUT)
        if expected is None:  # step 1 used the two live workers' pushes
            assert torch.equal(outcome[1], torch.full((4,), 1.5)), outcome
            assert torch.equal(outcome[2], outcome[1])
        else:
            assert isinstance(outcome[0], PeerGone) and "worker(s) 3" in str(outcome[0]), outcome
            for rank in (1, 2):  # told by the server: they blamed the server's death
                assert isinstance(outcome[rank], PeerGone) and outcome[rank].rank == 3, outcome
                assert "worker 3 is dead" in str(outcome[rank]), outcome


@pytest.mark.parametrize("probe", ["exchange", "oracle"])
def test_a_simulated_run_serves_on_ranks_that_only_serve(tmp_path, probe, capsys):
    """`gossip simulate` with roles: ranks 3 and 1 serve (they wrote no records and the bar
    counted no rounds of theirs), the workers train with one model; the consensus probe,
    which servers never join, is skipped with either probe (not waited for in vain)."""
    topology = Topology.from_dict({"size": 5, "servers": [3, 1]})
    config = TrainConfig.from_dict({"strategy": "ps", "rounds": 3, "batch_size": 16,
                                    "eval_every": 1, "seed": 3})
    sim = simulate_run(config, topology, tmp_path, Simulation(
        network=NetworkModel(rate="100mbit"), probe=probe), progress="ps")
    assert sim.failed == {}
    assert sorted(p.name for p in tmp_path.glob("peer-*.jsonl")) == [
        "peer-0.jsonl", "peer-2.jsonl", "peer-4.jsonl"]
    last = [sim.records[w][-1] for w in (0, 2, 4)]
    assert all(len(sim.records[w]) == 3 for w in (0, 2, 4)) and sim.records[3] == []
    assert len({line["accuracy"] for line in last}) == 1  # sync ps: the same model
    assert all(line["consensus"] is None for line in last)
    assert last[0]["time"] < config.timeout  # no probe waited for the servers
    assert "100%" in capsys.readouterr().err.split("\r")[-1]


def test_simulate_with_every_worker_killed_is_one_error_not_a_crash(tmp_path):
    """Both workers killed, the server finishes: the summary had no peer to show (min() of
    an empty sequence); now the run fails in one line naming the first death."""
    topo = tmp_path / "ps.yaml"
    topo.write_text("size: 3\nservers: [0]\n")
    result = CliRunner().invoke(main, [
        "simulate", "--topology", str(topo), "--strategy", "ps", "--option", "mode=async",
        "--rounds", "50", "--rate", "10mbit", "--kill", "1:0.05", "--kill", "2:0.05",
        "--quiet", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1, result.output
    assert "every simulated peer that trains died; the first: peer 1 died" in result.output
    assert not isinstance(result.exception, ValueError)


@pytest.mark.parametrize("servers", [[3], None])
def test_a_sync_worker_that_stops_early_is_named_by_the_others(servers):
    """Worker 4 trains 2 rounds, the others 4: their round 2 can never close. The server
    heard worker 4's goodbye, so each other worker fails naming it (it waited its timeout
    and blamed the server: "no answer from server(s) 3"); the servers end normally."""
    topology = ps_topology(5, servers)
    workers = topology.roles.workers if topology.roles else tuple(range(5))
    outcome = {}
    bound = threading.Barrier(5, timeout=TIMEOUT)

    def main(rank: int) -> None:
        try:
            with peer_once_all_bound(rank, topology, "ps", bound, timeout=TIMEOUT,
                                     dead_after=0.5) as peer:
                if rank not in workers:
                    peer.serve()
                    outcome[rank] = "served"
                    return
                for r in range(2 if rank == 4 else 4):
                    peer.synchronize(torch.full((7,), float(rank)), r)
                outcome[rank] = "trained"
        except PeerGone as exc:  # PeerTimeout, its base, would be the old blame
            outcome[rank] = exc

    run_in_threads(5, main, timeout=4 * TIMEOUT)
    assert outcome[4] == "trained", outcome
    for rank in set(workers) - {4}:
        assert isinstance(outcome[rank], PeerGone) and outcome[rank].rank == 4, outcome
        assert "worker 4 stopped after round 1" in str(outcome[rank]), outcome
    if servers:
        assert outcome[3] == "served", outcome


def test_a_backup_covers_a_sync_worker_that_stops_early():
    """backup 1: after worker 4's goodbye the steps close on workers 0 and 2, unrefused."""
    topology = ps_topology(5, [3, 1])

    def body(peer, rank):
        return [peer.synchronize(torch.full((7,), float(rank)), r)
                for r in range(2 if rank == 4 else 4)]

    results = run_ps(topology, body, backup=1)
    for rank in (0, 2):
        assert all(torch.equal(x, torch.full((7,), 1.0)) for x in results[rank][2:]), results


def test_a_refusal_from_a_peer_that_does_not_serve_is_rejected_and_training_goes_on():
    """Worker 2 forges a refusal of round 1 to rank 0 (worker and server); rank 0 rejects
    it and gets round 1's mean (it reads the forgery first: 2's push follows it on the link)."""
    data = make_local_topology("complete", 3).to_dict()
    data["peers"][0]["role"], data["peers"][1]["role"] = "both", "server"  # 2: a worker
    topology = Topology.from_dict(data)

    def body(peer, rank):
        peer.synchronize(torch.zeros(5), 0)
        if rank == 2:
            peer.transport.send(0, Message(kind="ps", round=1,
                                           meta={"op": "refuse", "worker": 2, "last": 0}))
        x = peer.synchronize(torch.full((5,), float(rank)), 1)
        return x, peer.stats["messages_rejected"]

    results = run_ps(topology, body)
    assert torch.equal(results[0][0], torch.full((5,), 1.0)), results
    assert torch.equal(results[2][0], results[0][0])
    assert results[0][1] == 1 and results[2][1] == 0, results


@pytest.mark.slow  # the workers compute longer than the timeout on purpose
def test_a_server_waits_for_workers_computing_longer_than_the_timeout():
    """Bug 3: ``local`` over ``ps`` with a server-only rank; between two averages each worker
    computes 4 x 0.15 s, longer than the 0.4 s timeout, and sends nothing. The workers are
    alive (their links answer heartbeats), so the server waits for them instead of raising
    "no goodbye from worker(s) 0, 1", and every average is the workers' mean."""
    topology = ps_topology(3, [2])
    bound = threading.Barrier(3, timeout=TIMEOUT)

    def main(rank: int):
        with peer_once_all_bound(rank, topology, "local", bound, timeout=0.4, dead_after=5.0,
                                 inner="ps", period=4) as peer:
            if rank == 2:
                peer.serve()
                return dict(peer.transport.membership.lost)
            x = torch.full((5,), float(rank), dtype=torch.float64)
            for round in range(8):
                time.sleep(0.15)  # a step's compute: nothing leaves this peer meanwhile
                x = peer.synchronize(x, round)
            return x, dict(peer.transport.membership.lost)

    results = run_in_threads(3, main, timeout=4 * TIMEOUT)
    assert results[2] == {}
    for rank in (0, 1):
        x, lost = results[rank]
        assert lost == {} and torch.equal(x, torch.full((5,), 0.5, dtype=torch.float64))


@pytest.mark.slow  # a worker computes longer than the timeout on purpose
def test_a_training_server_waits_for_a_worker_computing_longer_than_the_timeout():
    """Rank 0 serves and trains (role both): its own wait is for its own shard's answer,
    which needs rank 2's push, and rank 2 computes 0.6 s a round with a 0.3 s timeout. The
    wait goes on while the workers it needs are alive: every round is the mean."""
    data = make_local_topology("complete", 3).to_dict()
    data["peers"][0]["role"] = "both"  # the others are workers
    topology = Topology.from_dict(data)
    bound = threading.Barrier(3, timeout=TIMEOUT)

    def main(rank: int):
        with peer_once_all_bound(rank, topology, "ps", bound, timeout=0.3,
                                 dead_after=5.0) as peer:
            out = []
            for round in range(3):
                if rank == 2:
                    time.sleep(0.6)  # a step's compute: nothing leaves this peer meanwhile
                out.append(peer.synchronize(torch.full((4,), float(rank + round)), round))
            return out

    results = run_in_threads(3, main, timeout=4 * TIMEOUT)
    for round in range(3):
        assert all(torch.equal(results[r][round], torch.full((4,), 1.0 + round)) for r in range(3))
