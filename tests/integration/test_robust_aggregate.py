"""Robust aggregates on the strategies that gather whole vectors, real peers over ZeroMQ on
loopback, each a thread: ps sync (5 workers and a server) and topk-allgather (5 peers), one
of them a bare transport sending a huge or NaN vector under valid headers each round. The
honest results stay within CenteredClip's bound of the honest mean."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip.strategies import STRATEGIES
from gossip.strategies.sparse.wire import encode_block, pack
from gossip.topology import Topology
from gossip.transport import Message
from support import make_local_topology, run_on_transports

NUMEL, ROUNDS, TAU = 11, 4, 1.0
PAYLOADS = {"huge": 1e30, "nan": math.nan}


def honest_vectors(count: int) -> torch.Tensor:
    """Each honest peer's (fixed) vector: a common one plus a little noise each."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(NUMEL, generator=g) + 0.01 * torch.randn(count, NUMEL, generator=g)


def run(topology: Topology, strategy: str, options: dict, attacker: int, vectors, attack):
    """Honest workers synchronize their vector ``ROUNDS`` times (a server-only rank serves);
    ``attack(transport, round)`` is the attacker's every round. Returns {rank: results} and
    {rank: strategy} of the honest ranks."""
    workers = topology.roles.workers if topology.roles else tuple(range(topology.size))
    results: dict[int, list[torch.Tensor]] = {}
    honest: dict[int, object] = {}

    def setup(rank: int, transport) -> None:
        if rank == attacker:
            transport.accept_kinds((STRATEGIES.options(strategy, options).tag,))
            return
        peer = honest[rank] = STRATEGIES.create(strategy, rank=rank, topology=topology,
                                                transport=transport, options=options)
        transport.accept_kinds(peer.kinds, receiver_checks_finite=peer.checks_own_result)

    def work(rank: int, transport) -> None:
        if rank == attacker:
            for round in range(ROUNDS):
                attack(transport, round)
            return
        if rank in workers:
            mine = vectors[workers.index(rank) - (rank > attacker)]
            results[rank] = [honest[rank].synchronize(mine.clone(), r) for r in range(ROUNDS)]
        honest[rank].serve()

    run_on_transports(topology, setup, work)
    return results, honest


def assert_within_the_bound(results: dict, vectors: torch.Tensor, n: int) -> None:
    """CenteredClip from the median with one liar of n and honest vectors closer than tau:
    every aggregate within tau / (n - 1) + s of the honest mean (s: the honest spread), and
    the same bits on every honest peer."""
    mean = vectors.double().mean(dim=0)
    spread = float(torch.linalg.vector_norm(vectors.double() - mean, dim=1).max())
    first = next(iter(results.values()))
    for got in results.values():
        for round, aggregate in enumerate(got):
            assert torch.equal(aggregate, first[round])
            off = float(torch.linalg.vector_norm(aggregate.double() - mean))
            assert off <= TAU / (n - 1) + spread


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_ps_sync_with_one_worker_pushing_garbage(payload):
    """Server rank 0, workers 1..5; worker 5 pushes ``payload`` everywhere, then says
    goodbye like any worker."""
    plain = make_local_topology("complete", 6)
    topology = Topology.from_dict({**{k: v for k, v in plain.to_dict().items()
                                      if k != "edges"}, "servers": [0]})
    vectors = honest_vectors(4)
    options = {"mode": "sync", "robust": "centered-clip", "tau": TAU}

    def attack(transport, round):
        shard = torch.full((NUMEL,), PAYLOADS[payload])
        transport.send(0, Message(kind="ps", round=round, buffers=(shard,),
                                  meta={"op": "push", "n": NUMEL, "clock": 0}))
        if round == ROUNDS - 1:
            transport.send(0, Message(kind="ps", round=round, meta={"op": "done"}))

    results, honest = run(topology, "ps", options, 5, vectors, attack)
    assert sorted(results) == [1, 2, 3, 4]
    assert_within_the_bound(results, vectors, 5)
    server = honest[0].server
    assert server.flagged == (ROUNDS if payload == "nan" else 0)
    assert torch.equal(server.last_aggregate, results[1][-1])
    assert torch.equal(honest[0].state_dict()["aggregates"]["ps"], results[1][-1])


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_topk_allgather_with_one_peer_sending_garbage_sets(payload):
    """5 peers, density 1 (whole vectors); rank 4 sends every entry as ``payload``."""
    topology = make_local_topology("complete", 5)
    vectors = honest_vectors(4)
    options = {"density": 1.0, "robust": "centered-clip", "tau": TAU}

    def attack(transport, round):
        idx = np.arange(NUMEL, dtype=np.int64)
        val = np.full(NUMEL, PAYLOADS[payload], dtype=np.float32)
        msg = pack("tkag", round, [encode_block(0, idx, val, NUMEL, "compact")], n=NUMEL,
                   step=0)
        for dst in range(4):
            transport.send(dst, msg)

    results, honest = run(topology, "topk-allgather", options, 4, vectors, attack)
    assert sorted(results) == [0, 1, 2, 3]
    assert_within_the_bound(results, vectors, 5)
    assert honest[0].record_fields(ROUNDS - 1) == {"robust_flagged": int(payload == "nan")}
    assert torch.equal(honest[0].state_dict()["aggregate"], results[0][-1])


def test_without_robust_one_huge_set_drags_the_mean():
    """The reason for all this: the plain mean follows the attacker anywhere."""
    topology = make_local_topology("complete", 5)
    vectors = honest_vectors(4)

    def attack(transport, round):
        idx = np.arange(NUMEL, dtype=np.int64)
        val = np.full(NUMEL, 1e30, dtype=np.float32)
        msg = pack("tkag", round, [encode_block(0, idx, val, NUMEL, "compact")], n=NUMEL,
                   step=0)
        for dst in range(4):
            transport.send(dst, msg)

    results, honest = run(topology, "topk-allgather", {"density": 1.0}, 4, vectors, attack)
    assert float(results[0][0].abs().min()) > 1e28
    assert "aggregate" not in honest[0].state_dict() and not honest[0].record_fields(0)
