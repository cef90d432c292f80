"""Elastic runs: a ring all-reduce whose survivors agree on a view without a dead peer and go
on, every survivor's result bitwise equal in every round (gossip/strategies/elastic.py,
gossip/transport/epochs.py). Real peers over ZeroMQ on loopback, each a thread of this process;
the victim "dies" by closing its transport without a goodbye (what a kill -9 looks like to
the others: see test_dead_peers.py), at a chosen message of a chosen round.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.errors import ConfigError, PeerGone
from gossip.peer import Peer
from support import peer_once_all_bound

DEAD_AFTER = 0.5
TIMEOUT = 10.0


class Killed(Exception):
    """The victim's way out of its thread."""


def inputs(size: int, rounds: int, n: int = 23) -> torch.Tensor:
    """``[rank, round, n]``: each peer's input of each round."""
    return torch.randn(size, rounds, n, generator=torch.Generator().manual_seed(size),
                       dtype=torch.float64)


def run_elastic(run_peers, topology, *, rounds, kills, strategy="ring-allreduce",
                **options):
    """Every peer runs ``synchronize(inputs[rank, round], round)``; ``kills`` maps a victim to
    ``(round, sends)``: it dies in that round once it sent ``sends`` messages of it (0:
    before the round). Returns per rank its results (a ``[round, n]`` tensor, the rounds it
    completed) or the exception that ended it, and each survivor's Peer."""
    size = topology.size
    x = inputs(size, rounds)
    all_bound = threading.Barrier(size, timeout=TIMEOUT)
    peers: dict[int, Peer] = {}

    def main(rank: int):
        results = []
        try:
            with peer_once_all_bound(rank, topology, strategy, all_bound, timeout=TIMEOUT,
                                     dead_after=DEAD_AFTER, elastic=True, **options) as peer:
                peers[rank] = peer
                for round in range(rounds):
                    if rank in kills and kills[rank][0] == round:
                        arm(peer, kills[rank][1])
                    results.append(peer.synchronize(x[rank, round], round).clone())
        except Killed:
            return None
        except PeerGone as exc:
            return exc
        return torch.stack(results)

    return run_peers(size, main, timeout=6 * TIMEOUT), peers, x


def arm(peer: Peer, sends: int) -> None:
    """Make ``peer`` die once it sent ``sends`` more messages (now, for 0)."""
    transport, send = peer.transport, peer.transport.send
    count = [0]

    def die():
        transport.close()  # no goodbye, every socket closed
        raise Killed

    if sends == 0:
        die()

    def counted(dst, msg, **kwargs):
        delivery = send(dst, msg, **kwargs)
        count[0] += 1
        if count[0] == sends:
            die()
        return delivery

    transport.send = counted


def check_survivors(outcome, x, survivors, *, dies: int, size: int):
    """Bitwise equal results on every survivor in every round; before the death the mean of
    all, after it the survivors' mean, and in the death's round one of the two."""
    results = [outcome[r] for r in survivors]
    for r, result in zip(survivors, results):
        assert isinstance(result, torch.Tensor), (r, result)
    first = results[0]
    for result in results[1:]:
        assert torch.equal(result, first)
    everyone = x.mean(dim=0)
    theirs = x[survivors].mean(dim=0)
    torch.testing.assert_close(first[:dies], everyone[:dies], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first[dies + 1:], theirs[dies + 1:], rtol=1e-12, atol=1e-12)
    assert (torch.allclose(first[dies], everyone[dies], rtol=1e-12, atol=1e-12)
            or torch.allclose(first[dies], theirs[dies], rtol=1e-12, atol=1e-12))


@pytest.mark.parametrize("sends", range(0, 9))
def test_ring_survivors_agree_after_a_death_at_each_step(sends, local_topology, run_peers):
    """P = 5: the victim dies after each of its 2(P-1) messages of round 2 (0: between
    rounds); every survivor adopts or redoes that round alike."""
    size, victim, dies, rounds = 5, 2, 2, 5
    topology = local_topology("ring", size)
    outcome, peers, x = run_elastic(run_peers, topology, rounds=rounds,
                                    kills={victim: (dies, sends)})
    survivors = [r for r in range(size) if r != victim]
    check_survivors(outcome, x, survivors, dies=dies, size=size)
    assert_one_view(peers, survivors, dies)


def assert_one_view(peers, survivors, dies):
    """One view, epoch 1 of the survivors, on every survivor; the death's round adopted by
    those behind or redone by all, never both."""
    views = [peers[r].transport.membership.epochs.view for r in survivors]
    assert all(view == views[0] for view in views), views
    assert views[0].epoch == 1 and views[0].members == tuple(survivors), views[0]
    # the round of the death was adopted by those behind, or redone by all: never both
    how = {peers[r].strategy.recovered.get(dies, "completed") for r in survivors}
    assert how in ({"completed"}, {"completed", "adopted"}, {"redone"}), how
    return how
