"""A peer dies mid-run; real peers over ZeroMQ on loopback, each a thread of this process.

The victim "dies" by closing its transport without a goodbye (linger 0), which is what its
neighbours see of a kill -9: every connection to it closes at once and nothing answers on
its address. It dies right after a round that every peer has completed, so the oracle is
deterministic: W before the death round, W' after (the dead peer's row and column gone, each
neighbour's weight for it moved onto that neighbour's own). End to end, with real processes
and SIGKILL, see test_launch_reports_a_killed_peer_and_the_survivors_finish.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch

from gossip.errors import PeerGone, PeerTimeout
from gossip.metrics import read_jsonl
from gossip.peer import Peer
from gossip.strategies.matcha import Matcha, MatchaOptions
from gossip.transport import LoopbackHub, Message
from support import launch_and_kill, peer_once_all_bound

DEAD_AFTER = 0.5
TIMEOUT = 10.0  # far above what detection takes: a wait that ends by timeout fails the test


class Killed(Exception):
    """The victim's way out of its thread."""


def run_with_victim(run_peers, topology, strategy, *, x0, rounds, victim, dies_before,
                    **options):
    """Every peer iterates ``x <- synchronize(x, round)`` from ``x0[rank]``; the victim
    closes its transport without a goodbye once every peer has finished round
    ``dies_before - 1``. Returns per rank the results of each round (or the exception that
    ended it), the seconds from the death to that exception, and each survivor's Peer."""
    size = topology.size
    all_bound = threading.Barrier(size, timeout=TIMEOUT)
    before_death = threading.Barrier(size, timeout=TIMEOUT)
    died_at: list[float] = []
    ended: dict[int, float] = {}
    peers: dict[int, Peer] = {}

    def main(rank: int):
        results = []
        try:
            with peer_once_all_bound(rank, topology, strategy, all_bound, timeout=TIMEOUT,
                                     dead_after=DEAD_AFTER, **options) as peer:
                peers[rank] = peer
                x = x0[rank].clone()
                for round in range(rounds):
                    if round == dies_before:
                        before_death.wait()
                        if rank == victim:
                            died_at.append(time.monotonic())
                            peer.transport.close()  # no goodbye, every socket closed
                            raise Killed
                    x = peer.synchronize(x, round)
                    results.append(x.clone())
        except Killed:
            return None
        except PeerGone as exc:
            ended[rank] = time.monotonic()
            return exc
        ended[rank] = time.monotonic()
        return torch.stack(results)

    outcome = run_peers(size, main, timeout=3 * TIMEOUT)
    elapsed = {rank: when - died_at[0] for rank, when in ended.items()}
    return outcome, elapsed, peers


def without(victim: int, w: np.ndarray) -> np.ndarray:
    """W' of the survivors: the victim's row and column cut, its weight moved to the
    diagonal of each neighbour's row (rows keep summing to 1)."""
    w = w.copy()
    for i in range(len(w)):
        if i != victim:
            w[i, i] += w[i, victim]
    w[victim, :] = 0
    w[:, victim] = 0
    w[victim, victim] = 1
    return w


def iterate(mixings, x0: torch.Tensor) -> torch.Tensor:
    """x_{k+1} = W_k x_k, float64; ``[round, rank, n]``."""
    x, out = x0.double().numpy(), []
    for w in mixings:
        x = w @ x
        out.append(x)
    return torch.from_numpy(np.stack(out))


def survivors_of(size: int, victim: int) -> list[int]:
    return [r for r in range(size) if r != victim]


def assert_consensus_kept_average(results: torch.Tensor, survivors: list[int], start: int):
    """From the death on the survivors' average stays put and their spread shrinks."""
    kept = results[:, survivors].double()
    mean = kept.mean(dim=1)
    torch.testing.assert_close(mean[start:], mean[start].expand_as(mean[start:]),
                               rtol=1e-9, atol=1e-9)
    spread = (kept - mean[:, None]).norm(dim=(1, 2))
    assert spread[-1] < 0.2 * spread[start], spread


# -- gossip: the survivors drop the dead peer and go on ----------------------------------------


@pytest.mark.parametrize("graph, victim, strategy, options", [
    ("ring", 3, "dpsgd", {}),
    pytest.param("irregular-7", 2, "dpsgd", {}, marks=pytest.mark.slow),
    pytest.param("ring", 5, "nonblocking", {"inner": "dpsgd"}, marks=pytest.mark.slow),
], ids=["dpsgd-ring-8", "dpsgd-irregular-7", "nonblocking-dpsgd-ring-8"])
def test_gossip_survivors_drop_the_dead_peer_and_keep_mixing(graph, victim, strategy, options,
                                                              local_topology, run_peers):
    topology = local_topology(graph, 8 if graph == "ring" else None)
    size, rounds, dies_before = topology.size, 60, 3
    x0 = torch.randn(size, 5, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
    outcome, elapsed, peers = run_with_victim(run_peers, topology, strategy, x0=x0, rounds=rounds,
                                              victim=victim, dies_before=dies_before, **options)
    survivors = survivors_of(size, victim)
    w = topology.mixing_matrix()
    expected = iterate([w] * dies_before + [without(victim, w)] * (rounds - dies_before), x0)
    results = torch.stack([outcome[r] for r in survivors], dim=1)
    torch.testing.assert_close(results, expected[:, survivors], rtol=1e-10, atol=1e-10)
    assert_consensus_kept_average(expected, survivors, dies_before)
    for rank in topology.neighbors(victim):  # first hand, in the round it was missed
        assert peers[rank].lost_peers == {victim: dies_before}
        inner = peers[rank].strategy
        assert getattr(inner, "inner", inner).dropped == {victim: dies_before}
    for rank in survivors:  # the others heard of it from a neighbour of the victim
        assert set(peers[rank].lost_peers) == {victim}
    # Detection costs the dead-peer delay and a little, once; not a timeout per round.
    assert max(elapsed.values()) < DEAD_AFTER + 0.2 * rounds + 3.0, elapsed


def matcha_without(plan, seed: int, round: int, victim: int | None) -> np.ndarray:
    """W(k) with the victim's edges never active (their weight stays on the diagonal)."""
    w = np.eye(plan.size)
    draws = np.random.default_rng([seed, round]).random(len(plan.matchings))
    for j, p in enumerate(plan.probabilities):
        if draws[j] < p:
            for a, b in plan.matchings[j]:
                if victim not in (a, b):
                    w[a, b] = w[b, a] = plan.alpha
                    w[a, a] -= plan.alpha
                    w[b, b] -= plan.alpha
    return w


def test_matcha_survivors_never_activate_edges_to_the_dead_peer(local_topology, run_peers):
    topology = local_topology("exponential-8")
    size, rounds, dies_before, victim, seed = 8, 60, 4, 6, 3
    x0 = torch.randn(size, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    outcome, _, peers = run_with_victim(run_peers, topology, "matcha", x0=x0, rounds=rounds,
                                        victim=victim, dies_before=dies_before, budget=0.6,
                                        seed=seed)
    plan = Matcha(rank=0, topology=topology, transport=_NoTransport(),
                  options=MatchaOptions(budget=0.6)).plan
    expected = iterate([matcha_without(plan, seed, k, victim if k >= dies_before else None)
                        for k in range(rounds)], x0)
    survivors = survivors_of(size, victim)
    results = torch.stack([outcome[r] for r in survivors], dim=1)
    torch.testing.assert_close(results, expected[:, survivors], rtol=1e-10, atol=1e-10)
    assert_consensus_kept_average(expected, survivors, dies_before)
    partners = {r for r in topology.neighbors(victim)}
    for rank in partners:
        assert victim in peers[rank].strategy.dropped


@pytest.mark.slow
def test_compressed_matcha_survivors_drop_the_edges_and_reach_consensus(local_topology,
                                                                        run_peers):
    """Per-edge CHOCO copies: the dead peer's edges go, the survivors' edges still cancel
    pairwise, so their average stays put from the death on and they keep converging."""
    topology = local_topology("exponential-8")
    size, rounds, dies_before, victim = 8, 60, 4, 6
    x0 = torch.randn(size, 50, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    outcome, _, peers = run_with_victim(run_peers, topology, "matcha", x0=x0, rounds=rounds,
                                        victim=victim, dies_before=dies_before, budget=0.6,
                                        compressor="topk", density=0.5)
    survivors = survivors_of(size, victim)
    results = torch.stack([outcome[r] for r in survivors], dim=1)
    assert_consensus_kept_average(results, list(range(len(survivors))), dies_before)
    for rank in topology.neighbors(victim):
        assert victim in peers[rank].strategy.dropped


class _NoTransport:
    """Just enough of a transport to build a strategy and read its plan."""

    def connect(self, ranks):
        pass


def test_choco_stops_naming_the_dead_peer(local_topology, run_peers):
    """CHOCO keeps the neighbours' public copies only as one weighted sum: it cannot take
    one out, so it stops with a clear error (documented choice)."""
    topology = local_topology("ring", 3)  # both survivors are its neighbours
    x0 = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    outcome, _, _ = run_with_victim(run_peers, topology, "dpsgd", x0=x0, rounds=4, victim=2,
                                    dies_before=2, compressor="topk", density=0.5)
    for rank in topology.neighbors(2):
        assert isinstance(outcome[rank], PeerGone) and outcome[rank].rank == 2
        assert "CHOCO-Gossip" in str(outcome[rank]) and "cannot drop peer 2" in str(outcome[rank])


# -- all-reduce: every survivor stops at once with an error naming the dead peer ---------------


@pytest.mark.parametrize("strategy, options", [
    ("ring-allreduce", {}),
    pytest.param("ring-allreduce", {"compressor": "qsgd", "error_feedback": True},
                 marks=pytest.mark.slow),
    pytest.param("topk-allgather", {"density": 0.3}, marks=pytest.mark.slow),
    pytest.param("gtopk", {"density": 0.3}, marks=pytest.mark.slow),
    ("spardl", {"density": 0.3}),
], ids=["ring", "ring-qsgd", "topk-allgather", "gtopk", "spardl"])
def test_allreduce_survivors_stop_naming_the_dead_peer(strategy, options, local_topology,
                                                       run_peers):
    topology = local_topology("ring", 8)
    victim, dies_before = 5, 2
    x0 = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    outcome, elapsed, _ = run_with_victim(run_peers, topology, strategy, x0=x0, rounds=6,
                                          victim=victim, dies_before=dies_before, **options)
    address = topology.address(victim)
    for rank in survivors_of(8, victim):
        error = outcome[rank]
        assert isinstance(error, PeerGone), (rank, error)
        assert error.rank == victim
        text = str(error)
        assert f"peer {victim} ({address}) is dead" in text, text
        assert re.search(rf"round {dies_before}\b", text), text
    # Within the dead-peer delay plus slack, far below the message timeout.
    assert max(elapsed.values()) < DEAD_AFTER + 2.0 < TIMEOUT, elapsed


def test_malformed_control_messages_are_rejected_not_obeyed():
    hub = LoopbackHub(3)
    t0, t1 = hub.transport(0), hub.transport(1)
    t1.send(0, Message("ctl.gone", 0, meta={"rank": "2"}))
    t1.send(0, Message("ctl.gone", 0, meta={"rank": 7, "why": "made up"}))
    t1.send(0, Message("ctl.resume", 0, meta={"round": 1}))  # no skip
    with pytest.raises(PeerTimeout):
        t0.recv(timeout=0.1)
    assert t0.stats.messages_rejected == 3
    assert not t0.membership.lost and t0.membership.skip_through == -1
    assert [r.split(": bad meta: ")[1].rsplit(" (", 1)[0] for r in t0.stats.rejections] == [
        "rank='2' is not an int", "rank 7 is not a peer", "skip=None is not an int"]
    # Rejected: not counted as received, and the claimed sender is no contact of ours.
    assert t0.stats.messages_recv == 0 and not t0.contacts
    assert set(t0.stats.by_kind) == {"<rejected>"}


# -- a peer that leaves is not a dead one -----------------------------------------------------


def test_a_peer_that_takes_no_step_is_dropped_at_its_goodbye_not_judged_dead(local_topology,
                                                                             run_peers):
    """Bug 11: rank 2 of a ring of 5 enters and leaves ``with Peer(...)`` without a step.
    It says goodbye to the neighbours it is linked to, so their wait for its round-0 message
    ends at once (PeerGone: it left) and D-PSGD drops it as it drops a dead one, with nobody
    declaring it dead (before: no goodbye, a broken link, a death after ``dead_after``)."""
    size, victim, rounds = 5, 2, 3
    topology = local_topology("ring", size)
    x0 = torch.randn(size, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    all_bound, left = threading.Barrier(size, timeout=TIMEOUT), threading.Event()

    def main(rank: int):
        try:
            with peer_once_all_bound(rank, topology, "dpsgd", all_bound, timeout=TIMEOUT,
                                     dead_after=1.0) as peer:
                if rank == victim:
                    return None
                assert left.wait(TIMEOUT)
                x, results = x0[rank].clone(), []
                for round in range(rounds):
                    x = peer.synchronize(x, round)
                    results.append(x)
        finally:
            if rank == victim:
                left.set()
        return torch.stack(results), dict(peer.transport.membership.lost)

    outcome = run_peers(size, main, timeout=3 * TIMEOUT)
    want = iterate([without(victim, topology.mixing_matrix())] * rounds, x0)
    for rank in survivors_of(size, victim):
        results, lost = outcome[rank]
        assert lost == {}, (rank, lost)
        torch.testing.assert_close(results, want[:, rank], rtol=1e-12, atol=1e-12)


# -- end to end: gossip launch, a peer SIGKILLed mid-run ------------------------------------------


@pytest.mark.slow
def test_launch_reports_a_killed_peer_and_the_survivors_finish(tmp_path):
    """5 peers (each a process: 4 s of CPU to start): two of the survivors are not the
    victim's neighbours and learn of the death second-hand, as with more."""
    peers, rounds, victim = 5, 50, 3
    run_dir = tmp_path / "run"
    launch, out, err, killed_after = launch_and_kill(
        run_dir, peers=peers, rounds=rounds, victim=victim, after=8,
        flags=("--tolerate-deaths", "1"))
    assert launch.returncode == 0, err
    assert re.search(rf"peer {victim} died \(killed by SIGKILL\) after \d+ round", err + out)
    assert re.search(rf"peer {victim} lost: noticed by 4 of 4 survivors", out), out
    for rank in survivors_of(peers, victim):
        records = read_jsonl(run_dir / f"peer-{rank}.jsonl")
        assert [r["round"] for r in records] == list(range(rounds))
        lost = records[-1]["lost_peers"]
        assert list(lost) == [str(victim)] and lost[str(victim)] >= killed_after - 1
        assert records[-1]["accuracy"] > 0.5


@pytest.mark.slow
def test_launch_exits_non_zero_naming_a_peer_that_died_uninvited(tmp_path):
    """The survivors finish, the table is printed, and the exit status says a peer died
    (it was 0 as long as one peer finished)."""
    launch, out, err, _ = launch_and_kill(tmp_path / "run", peers=3, rounds=40, victim=1,
                                           after=3)
    assert launch.returncode == 1, (out, err)
    assert "mean test accuracy" in out
    assert re.search(rf"^error: 1 peer\(s\) died: peer 1 died \(killed by SIGKILL\) "
                     rf"after \d+ round\(s\); logs in ", err, re.M), err
