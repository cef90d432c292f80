"""Bounded staleness for dpsgd (``staleness: s``): s = 0 is lockstep D-PSGD bit for bit;
with s > 0 every round mixes neighbour models at most s rounds old, and says how old."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.training.synchronous import train
from gossip.transport import LoopbackHub, Message
from gossip.transport.windowed import recv_latest
from support import run_in_threads


def test_staleness_zero_is_dpsgd_bit_for_bit(local_topology, run_rounds, make_data):
    topology = local_topology("ring", 5)
    data = make_data(3, 5, (11,), torch.float32, seed=2)
    plain = run_rounds(topology, "dpsgd", data).results
    assert torch.equal(run_rounds(topology, "dpsgd", data, staleness=0).results, plain)


def test_the_newest_message_in_the_window_is_used_and_older_ones_dropped():
    hub = LoopbackHub(2)
    receiver, sender = hub.transport(0, timeout=2), hub.transport(1, timeout=2)
    for round in (3, 4, 5, 7):
        sender.send(0, Message("gossip", round, meta={"r": round}))
    msg = recv_latest(receiver, src=1, kind="gossip", first=4, last=6)
    assert msg.round == 5
    assert [m.round for m in receiver.inbox] == [7]  # 3 and 4 can no longer be used
    sender.send(0, Message("gossip", 8))
    assert recv_latest(receiver, src=1, kind="gossip", first=8, last=9).round == 8
    assert len(receiver.inbox) == 0


def test_staleness_with_a_compressor_is_refused():
    with pytest.raises(ConfigError, match="staleness"):
        TrainConfig(strategy="dpsgd", options={"staleness": 2, "compressor": "topk"})
    with pytest.raises(ConfigError, match="staleness"):
        TrainConfig(strategy="dpsgd", options={"staleness": 99})


@pytest.mark.slow  # trains three peers with injected delays (about 2 s)
def test_with_seeded_delays_every_record_is_within_the_bound(local_topology):
    s, size = 2, 3
    topology = local_topology("ring", size)
    config = TrainConfig.from_dict({
        "strategy": "dpsgd", "options": {"staleness": s}, "rounds": 12, "batch_size": 8,
        "minibatches": 2, "eval_every": 100, "timeout": 10,
        "delays": {"compute": 0.004, "slowdown": {1: 5.0}, "straggler_prob": 0.2,
                   "straggler_mean": 0.02}})
    records = [[] for _ in range(size)]
    hub = LoopbackHub(size)
    start = threading.Barrier(size, timeout=10)

    def main(rank: int) -> None:
        with Peer(rank, topology, "dpsgd", transport=hub.transport(rank, timeout=10),
                  staleness=s) as peer:
            start.wait()
            train(peer, config, on_round=records[rank].append)

    run_in_threads(size, main, timeout=60)
    used = [line["staleness"] for lines in records for line in lines]
    assert len(used) == 12 * size and all(0 <= u <= s for u in used), used
    assert max(used) > 0, "the slow peer's neighbours never ran ahead: the test cannot fail"
    # Clocks: finishing round r needs a neighbour's model of round r - s, which it sends
    # only after recording its round r - s - 1; so no peer gets more than s + 1 ahead.
    wall = [[line["wall"] for line in lines] for lines in records]
    for i in range(size):
        for j in topology.neighbors(i):
            assert all(wall[j][r - s - 1] < wall[i][r] for r in range(s + 1, 12)), (i, j)


@pytest.mark.parametrize("compensate", [True, False])
def test_peers_that_agree_move_on_as_one_whatever_the_staleness(local_topology, compensate):
    """Every peer adds the same step c each round from the same start, rank 2 is slow, so
    its neighbours mix its models up to 2 rounds late. Compensated (x_j(t) + x_i(r) -
    x_i(t)), every peer stays exactly on x0 + (r + 1) c; mixed as they are, the late models
    pull the fast peers back (the control: it must miss)."""
    size, s, rounds = 5, 2, 12
    topology = local_topology("ring", size)
    hub = LoopbackHub(size)
    x0 = torch.randn(17, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c = torch.randn(17, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    errors, stale = [0.0] * size, [0] * size

    def main(rank: int) -> None:
        with Peer(rank, topology, "dpsgd", transport=hub.transport(rank, timeout=10),
                  staleness=s, compensate=compensate) as peer:
            x = x0.clone()
            for round in range(rounds):
                if rank == 2:
                    time.sleep(0.03)
                x = peer.synchronize(x + c, round)
                errors[rank] = max(errors[rank], (x - (x0 + (round + 1) * c)).abs().max().item())
                stale[rank] = max(stale[rank], peer.strategy.record_fields(round)["staleness"])

    run_in_threads(size, main, timeout=60)
    assert max(stale) > 0, "nobody mixed a late model: the test cannot fail"
    if compensate:
        assert max(errors) < 1e-12, errors
    else:
        assert max(errors) > 1e-3, errors
