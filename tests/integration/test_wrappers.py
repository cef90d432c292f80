"""Wrapper strategies forward every hook their inner strategy has: local SGD over an
asynchronous inner strategy (adpsgd) polls and drains it like adpsgd alone."""

from __future__ import annotations

import random
import threading
import time

import torch

from support import peer_once_all_bound, run_in_threads


def test_local_over_adpsgd_drains_its_exchanges_on_exit(local_topology):
    """Real peers over ZeroMQ on a ring of 3 (lr = 0, float64), each stopping after its own
    number of steps (5, 9, 13), period 2. Leaving the peer runs local's finish, which must be
    adpsgd's: complete the last exchange and answer the neighbours until they are done.
    Then every request got its reply and the sum of models is the initial one (without the
    forwarding a peer left with its last request unanswered and the sum moved)."""
    size = 3
    topology = local_topology("ring", size)
    x0 = torch.randn(size, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    final, inner = [None] * size, [None] * size
    all_bound = threading.Barrier(size, timeout=30)

    def main(rank: int) -> None:
        delays = random.Random(rank)
        x = x0[rank].clone()
        with peer_once_all_bound(rank, topology, "local", all_bound, timeout=30, period=2,
                                 inner="adpsgd", inner_options={"seed": rank}) as peer:
            assert peer.strategy.synchronous is False
            for round in range(5 + 4 * rank):
                x = peer.synchronize(x, round, out=x)
                with peer.communicating():
                    peer.strategy.poll()  # between mini-batches, as the async runner does
                time.sleep(delays.random() * 0.002)
        final[rank], inner[rank] = x, peer.strategy.inner

    run_in_threads(size, main, timeout=90)
    requests = sum(s.next_id for s in inner)
    assert requests > 0
    assert sum(s.exchanges for s in inner) == requests == sum(s.answered for s in inner)
    total = torch.stack(final).sum(0)
    torch.testing.assert_close(total, x0.sum(0), rtol=1e-12, atol=1e-12 * x0.abs().sum())
