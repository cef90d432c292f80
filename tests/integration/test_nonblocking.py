"""Non-blocking SGD with real peers (threads) over loopback ZeroMQ: without delays it is
blocking SGD, the all-reduce weights by finished samples, and nobody deadlocks when a peer
finished no mini-batch."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from gossip.config import TrainConfig
from gossip.faults import DelayConfig
from gossip.tasks import create_task
from gossip.training.synchronous import train

pytestmark = pytest.mark.timeout(90)

P = 3
INNERS = {"ring-allreduce": {}, "dpsgd": {}, "matcha": {"budget": 0.5}}


def train_peers(topology, open_peer, run_peers, config: TrainConfig, *, lockstep: bool = False,
                pause: dict[int, float] | None = None):
    """Train every rank in a thread from the same initial model; returns each rank's final
    flat parameters and its metrics records.

    ``lockstep``: no peer starts a mini-batch before all finished the previous one (equal
    speeds, made exact). ``pause``: rank -> seconds it sleeps after each round but the last.
    """
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        initial = create_task(config.task, seed=config.seed).build_model()
    barrier = threading.Barrier(topology.size, timeout=20)
    records = [[] for _ in range(topology.size)]

    def on_round(rank, record):
        records[rank].append(record)
        if pause and rank in pause and record["round"] < config.rounds - 1:
            time.sleep(pause[rank])  # the point: a peer late for the next round

    def main(rank):
        # Compared bitwise: a gemm splits its sums by the threads it gets (scheduler-
        # dependent with several peers on two cores), so one thread each.
        torch.set_num_threads(1)
        model = copy.deepcopy(initial)
        with open_peer(rank, topology, config.strategy, **config.options) as peer:
            train(peer, config, model=model, on_round=lambda r: on_round(rank, r),
                  on_minibatch=(lambda round, done: barrier.wait()) if lockstep else None)
        return parameters_to_vector(model.parameters()).detach()

    params = run_peers(topology.size, main, timeout=60)
    return torch.stack(params), records


def config_for(strategy: str, options: dict, **overrides) -> TrainConfig:
    settings = {"rounds": 3, "batch_size": 32, "minibatches": 1, "eval_every": 100, "seed": 1}
    settings.update(overrides)
    return TrainConfig(strategy=strategy, options=options, **settings)


@pytest.mark.parametrize("inner", ["dpsgd", *(pytest.param(inner, marks=pytest.mark.slow)
                                             for inner in ["ring-allreduce", "matcha"])])
def test_without_delays_equals_blocking_sgd(inner, local_topology, open_peer, run_peers):
    topology = local_topology("ring", P)
    options = INNERS[inner]
    nonblocking = config_for("nonblocking", {"inner": inner, "inner_options": options},
                             minibatches=4)
    got, records = train_peers(topology, open_peer, run_peers, nonblocking, lockstep=True)
    for rank in range(P):
        assert [r["minibatches"] for r in records[rank]] == [4, 4, 4]
        assert [r["samples"] for r in records[rank]] == [32, 32, 32]
    # The same 4 mini-batches accumulated by blocking SGD: the same arithmetic for gossip;
    # the all-reduce sums one extra element (the count), which moves its segment bounds.
    accumulated, _ = train_peers(topology, open_peer, run_peers,
                                 config_for(inner, options, minibatches=4))
    if inner == "ring-allreduce":
        torch.testing.assert_close(got, accumulated, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got, accumulated)
    # Blocking SGD on the whole batch of 32 at once: equal up to float32 summation order.
    whole, _ = train_peers(topology, open_peer, run_peers, config_for(inner, options))
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-6)


def test_allreduce_weights_by_finished_samples(local_topology, open_peer, run_peers, make_data):
    """Oracle: every peer gets (sum of all finished mini-batch gradients) / (their count),
    bit-identical on every peer, whatever each finished (zero included)."""
    size = 4
    topology = local_topology("ring", size)
    counts = [[3, 0, 1, 4], [0, 0, 0, 2], [4, 4, 4, 4], [0, 0, 0, 0]]
    data = make_data(len(counts), size, (11,), torch.float64)
    for round, row in enumerate(counts):
        for rank, count in enumerate(row):
            if count == 0:
                data[round, rank] = 0.0  # a peer that finished nothing has nothing accumulated

    def main(rank):
        with open_peer(rank, topology, "nonblocking", inner="ring-allreduce") as peer:
            return torch.stack([peer.strategy.average_gradients(data[round, rank].clone(),
                                                                counts[round][rank], round)
                                for round in range(len(counts))])

    results = run_peers(size, main)
    for round, row in enumerate(counts):
        total = sum(row)
        expected = data[round].sum(0) / total if total else torch.zeros(11, dtype=torch.float64)
        for rank in range(size):
            torch.testing.assert_close(results[rank][round], expected, rtol=1e-12, atol=1e-12)
            assert torch.equal(results[rank][round], results[0][round])


@pytest.mark.parametrize("inner", ["ring-allreduce",
                                   pytest.param("dpsgd", marks=pytest.mark.slow)])
def test_no_deadlock_when_a_peer_finished_none(inner, local_topology, open_peer, run_peers):
    """Rank 1 is late for every round: the others have finished (and sent STOP) before it
    starts, so it joins the exchange with zero mini-batches."""
    topology = local_topology("ring", P)
    config = config_for("nonblocking", {"inner": inner}, batch_size=16, minibatches=2,
                        eval_every=1)
    params, records = train_peers(topology, open_peer, run_peers, config, pause={1: 0.5})
    late = [r["minibatches"] for r in records[1]]
    assert 0 in late[1:], late
    assert all(r["loss"] is not None or r["minibatches"] == 0 for r in records[1])
    # A round closes when the first peer has finished all its mini-batches (which of the
    # prompt two depends on the scheduler: on a loaded machine one may finish none).
    for round in range(len(late)):
        assert max(records[rank][round]["minibatches"] for rank in range(P)) == 2, round
    if inner == "ring-allreduce":  # the same step everywhere, even for the peer with none
        assert torch.equal(params[1], params[0]) and torch.equal(params[2], params[0])
        assert records[0][-1]["consensus"] == pytest.approx(0.0, abs=1e-12)


def test_fast_peers_do_not_wait_for_a_slow_one(local_topology, open_peer, run_peers):
    """Rank 2 is an 8x slower device: each round it finishes the mini-batch it is on when a
    fast peer has finished all four, and the round's update uses what was finished."""
    topology = local_topology("ring", P)
    delays = DelayConfig(compute=0.004, slowdown={2: 8.0})
    config = config_for("nonblocking", {"inner": "ring-allreduce"}, rounds=4, minibatches=4,
                        eval_every=1, delays=delays)
    params, records = train_peers(topology, open_peer, run_peers, config)
    slow = [r["minibatches"] for r in records[2]]
    assert all(1 <= c < 4 for c in slow[1:]), slow  # round 0 may see staggered starts
    for round in range(config.rounds):  # the first to finish all four closed the round
        assert max(records[rank][round]["minibatches"] for rank in range(P)) == 4
    # (a peer stopped before its first mini-batch of a round sleeps nothing in that round)
    assert all(sum(r["delay_s"] for r in records[rank]) > 0 for rank in range(P))
    assert torch.equal(params[2], params[0]) and torch.equal(params[1], params[0])
