"""gTop-k and SparDL surviving a death (gossip/strategies/elastic.py): a round some survivor
completed is adopted by the others with its global index set, from which each completes its
residual as its own completion would; a round nobody completed is redone. Checked against
an oracle run without deaths: the P peers up to the last round completed with them, then the
survivors alone from their residuals; results and residuals bitwise equal in every round.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gossip.transport import LoopbackHub
from support import peer_once_all_bound
from test_elastic import TIMEOUT, assert_one_view, run_elastic

VICTIM_ROUND, ROUNDS = 2, 5


def oracle(run_peers, local_topology, strategy, x, rounds, residuals=None, **options):
    """Every peer of ``x[rank, round]`` (over loopback, no deaths) synchronizes ``rounds``,
    starting from ``residuals[rank]`` if given; per rank its results and residuals."""
    size = x.shape[0]
    topology = local_topology("ring", size)
    hub, all_bound = LoopbackHub(size), threading.Barrier(size, timeout=TIMEOUT)

    def main(rank):
        results, kept = [], []
        with peer_once_all_bound(rank, topology, strategy, all_bound, hub=hub,
                                 timeout=TIMEOUT, **options) as peer:
            if residuals is not None:
                peer.strategy.load_state_dict({"residual": residuals[rank].clone()})
            for round in rounds:
                results.append(peer.synchronize(x[rank, round], round).clone())
                kept.append(peer.strategy.residual.clone())
        return results, kept

    return run_peers(size, main, timeout=6 * TIMEOUT)


def _cases():
    """(strategy, options, P, victim, messages it sent in the round of its death): gtop-k's
    root (slot 0) before the round, after its first and second broadcast send, and an inner
    node after its reduce send and its broadcast send; SparDL at P = 5 at each of its 6
    messages (3 reduce-scatter, 3 all-gather), at P = 8 in either phase (7 survivors: no
    power of two either)."""
    for mode in ("conserve", "reference"):
        for victim, sends in ((0, 0), (0, 1), (0, 2), (2, 1), (2, 2)):
            yield pytest.param("gtopk", {"residual_mode": mode}, 5, victim, sends,
                               id=f"gtopk-{mode}-{victim}-{sends}",
                               marks=[pytest.mark.slow] if mode == "reference" and sends else [])
    for sends in range(7):
        yield pytest.param("spardl", {}, 5, 2, sends, id=f"spardl-2-{sends}",
                           marks=[pytest.mark.slow] if sends in (1, 5) else [])
    for sends in (2, 4):
        yield pytest.param("spardl", {}, 8, 3, sends, id=f"spardl-8-3-{sends}")


@pytest.mark.parametrize("strategy, options, size, victim, sends", list(_cases()))
def test_sparse_all_reduce_survivors_match_an_oracle_after_a_death(
        strategy, options, size, victim, sends, local_topology, run_peers):
    """Rounds adopted (gtop-k after a root's broadcast send or an inner node's reduce send,
    SparDL in its all-gather) and redone (SparDL in its reduce-scatter, either before the
    round) alike."""
    options = {"density": 0.3, **options}
    topology = local_topology("ring", size)
    residuals: dict[int, list] = {r: [] for r in range(size)}

    def keep_residual(rank, peer):
        residuals[rank].append(peer.strategy.residual.clone())

    outcome, peers, x = run_elastic(run_peers, topology, rounds=ROUNDS,
                                    kills={victim: (VICTIM_ROUND, sends)}, strategy=strategy,
                                    after_round=keep_residual, **options)
    survivors = [r for r in range(size) if r != victim]
    how = assert_one_view(peers, survivors, VICTIM_ROUND)
    # The P peers ran every round up to the last one some survivor completed with them.
    full = VICTIM_ROUND + (how != {"redone"})
    before = oracle(run_peers, local_topology, strategy, x, range(full), **options)
    after = oracle(run_peers, local_topology, strategy, x[survivors], range(full, ROUNDS),
                   residuals=[before[r][1][-1] for r in survivors], **options)
    for slot, rank in enumerate(survivors):
        results = [*before[rank][0], *after[slot][0]]
        kept = [*before[rank][1], *after[slot][1]]
        assert isinstance(outcome[rank], torch.Tensor), (rank, outcome[rank])
        for round in range(ROUNDS):
            assert torch.equal(outcome[rank][round], results[round]), (rank, round, how)
            assert torch.equal(residuals[rank][round], kept[round]), (rank, round, how)


def test_an_adopted_sparse_round_needs_its_global_set(local_topology):
    """A round adopted without its global index set, or before this peer did its part of
    it, is refused naming what is wrong."""
    from gossip.errors import ProtocolError
    from gossip.peer import Peer

    hub = LoopbackHub(2)
    with Peer(0, local_topology("ring", 2), "spardl", transport=hub.transport(0),
              density=0.5) as peer:
        with pytest.raises(ProtocolError, match="without its global index set"):
            peer.strategy.adopted(3, ())
        with pytest.raises(ProtocolError, match="had not done its part"):
            peer.strategy.adopted(3, (torch.zeros(0, dtype=torch.int64),))
