"""The contract every registered strategy keeps, run over ``STRATEGIES.names()`` and each
strategy's representative option sets (``Options.examples``): a strategy registered later is
covered without editing this file. Real peers over real ZeroMQ sockets on loopback.

What a strategy promises beyond the contract is a capability (``exact_mean``,
``preserves_mean``), and is checked when it says so.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from gossip.errors import ConfigError, PeerTimeout, ProtocolError
from gossip.overlap import plan_buckets, refusal
from gossip.overlap.buckets import MIB
from gossip.peer import Peer
from gossip.strategies import STRATEGIES
from gossip.options import TaggedOptions
from gossip.transport import LoopbackHub
from support import assert_same

CASES = [pytest.param(name, dict(options), id=f"{name}-{json.dumps(options, sort_keys=True)}")
         for name in STRATEGIES.names() for options in STRATEGIES.entry(name).options.examples]
TIMEOUT = 5.0


def _overlaps_gradients(name: str, options: dict) -> bool:
    caps = STRATEGIES.strategy_class(name, options).capabilities_for(
        STRATEGIES.options(name, options))
    return caps["operates_on"] == "grads" and refusal(caps) is None


# Every gradient strategy (and option set) that Peer.attach overlaps, from the registry.
OVERLAP_CASES = [case for case in CASES if _overlaps_gradients(*case.values)]


def rounds(run_peers, topology, name: str, options: dict, inputs: list[list[torch.Tensor]], *,
           inplace: bool = True, hub: LoopbackHub | None = None) -> tuple[list, list]:
    """Each peer synchronizes ``inputs[round][rank]`` (a copy) round after round; returns
    the results ``[round][rank]`` and the peers' strategies."""
    size = topology.size
    results = [[None] * size for _ in inputs]
    strategies = [None] * size
    bound = threading.Barrier(size, timeout=TIMEOUT)

    def main(rank: int) -> None:
        transport = hub.transport(rank, timeout=TIMEOUT) if hub else None
        with Peer(rank, topology, name, timeout=TIMEOUT, transport=transport,
                  **options) as peer:
            bound.wait()
            for round, row in enumerate(inputs):
                x = row[rank].clone()
                y = peer.synchronize(x, round, out=x if inplace else None)
                assert y.shape == x.shape and y.dtype == x.dtype
                if inplace:
                    assert y.data_ptr() == x.data_ptr(), "out=x did not write in place"
                results[round][rank] = y.clone()
            strategies[rank] = peer.strategy

    run_peers(size, main, timeout=6 * TIMEOUT)
    return results, strategies


def data(size: int, numel: int, dtype: torch.dtype, n_rounds: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
             for _ in range(size)] for _ in range(n_rounds)]


def check_capabilities(strategy, inputs, results, dtype) -> None:
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for round, (row, out) in enumerate(zip(inputs, results)):
        assert all(torch.isfinite(y).all() for y in out), f"round {round}: not finite"
        if strategy.exact_mean:
            mean = torch.stack(row).double().mean(0).to(dtype)
            for y in out:
                torch.testing.assert_close(y, mean, **tolerance)
                assert torch.equal(y, out[0]), "peers disagree on the mean"
        if strategy.preserves_mean and round == 0:  # later rounds mix the results, not inputs
            torch.testing.assert_close(torch.stack(out).double().mean(0),
                                       torch.stack(row).double().mean(0), **tolerance)


@pytest.mark.parametrize("name, options", CASES)
def test_one_peer_alone(name, options, local_topology, run_peers):
    inputs = data(1, 6, torch.float32, 2)
    results, (strategy,) = rounds(run_peers, local_topology("ring", 1), name, options, inputs)
    check_capabilities(strategy, inputs, results, torch.float32)
    if strategy.exact_mean or strategy.preserves_mean:  # the mean of one peer is its value
        assert all(torch.equal(out[0], row[0]) for row, out in zip(inputs, results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, options", CASES)
def test_odd_peers_two_rounds_in_place(name, options, dtype, local_topology, run_peers):
    """Three peers, 11 values (not a multiple of 3), two rounds in a row, out= the input."""
    inputs = data(3, 11, dtype, 2, seed=3)
    results, strategies = rounds(run_peers, local_topology("ring", 3), name, options, inputs)
    check_capabilities(strategies[0], inputs, results, dtype)


@pytest.mark.parametrize("name, options", CASES)
def test_a_tensor_shorter_than_the_peer_count(name, options, local_topology, run_peers):
    inputs = data(5, 3, torch.float64, 2, seed=5)
    results, strategies = rounds(run_peers, local_topology("ring", 5), name, options, inputs,
                                 inplace=False)
    check_capabilities(strategies[0], inputs, results, torch.float64)


@pytest.mark.parametrize("name, options", CASES)
def test_mismatched_lengths_are_a_clear_error_not_a_hang(name, options, local_topology,
                                                        run_peers):
    """Rank 0 synchronizes 7 values, the others 8: some peer says the lengths differ; every
    peer ends (error or timeout) instead of hanging."""
    topology = local_topology("ring", 3)
    outcomes = [None] * 3

    def main(rank: int) -> None:
        try:
            with Peer(rank, topology, name, timeout=1.0, **options) as peer:
                for round in range(3):  # a gossip edge may be idle in one round
                    peer.synchronize(torch.ones(7 if rank == 0 else 8), round)
            outcomes[rank] = "finished"
        except (ProtocolError, ConfigError, PeerTimeout) as exc:
            outcomes[rank] = exc

    run_peers(3, main, timeout=30)
    clear = [o for o in outcomes if isinstance(o, (ProtocolError, ConfigError))]
    assert clear, outcomes
    assert any("length" in str(o) or "elements" in str(o) for o in clear), clear


@pytest.mark.parametrize("name, options", CASES)
def test_state_dict_round_trip(name, options, local_topology, run_peers):
    """What a checkpoint keeps loads into a fresh instance and comes back out the same."""
    topology = local_topology("ring", 3)
    inputs = data(3, 9, torch.float64, 2, seed=7)
    _, strategies = rounds(run_peers, topology, name, options, inputs, hub=LoopbackHub(3))
    state = strategies[1].state_dict()
    fresh_hub = LoopbackHub(3)
    with Peer(1, topology, name, transport=fresh_hub.transport(1), **options) as peer:
        peer.strategy.load_state_dict(state)
        assert_same(peer.strategy.state_dict(), state)


def test_every_strategy_documents_its_options_and_capabilities():
    for row in STRATEGIES.describe():
        assert row["doc"], f"{row['name']} has no docstring"
        assert all(o["doc"] for o in row["options"]), f"{row['name']}: an option without doc"
        assert row["capabilities"]["operates_on"] in ("grads", "params"), row


def test_every_strategy_names_its_messages_by_its_tag():
    """A tag per instance keeps two on one transport apart (overlap's buckets retag)."""
    for name in STRATEGIES.names():
        options = STRATEGIES.options(name, {})
        assert isinstance(options, TaggedOptions), name
        assert options.kinds and all(kind == options.tag or kind.startswith(options.tag + ".")
                                     for kind in options.kinds), (name, options.kinds)


# -- under overlap (Peer.attach): buckets during backward ---------------------------------

LAYERS = (7, 13, 11, 9, 5)  # no size a multiple of the peer count
TINY_BUCKETS = 40 * 8 / MIB  # about 40 float64: one or two parameters a bucket


def _mlp() -> torch.nn.Sequential:
    layers = []
    for a, b in zip(LAYERS, LAYERS[1:]):
        layers += [torch.nn.Linear(a, b, dtype=torch.float64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _loss(model, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("name, options", OVERLAP_CASES)
def test_overlapped_buckets_at_odd_peers(name, options, size, local_topology, run_peers):
    """An odd number of peers train an MLP of odd sizes with plain SGD through
    ``Peer.attach`` with many tiny buckets. Each step's averaged gradient is exactly what
    the strategy gives run blocking, bucket after bucket, on the same local gradients (one
    instance per bucket, tags ``TAG.bI``); an exact-mean strategy gives the
    averaged-gradient oracle, bitwise the same on every peer."""
    steps, lr = 3, 0.5
    topology = local_topology("ring", size)
    # Built once: peer threads each seeding torch's global RNG and building a model would
    # race on it and start from different weights (which reproduces issue 25's "0.25
    # off, peers differ" at three peers, whatever the buckets).
    init = _mlp().state_dict()
    g = torch.Generator().manual_seed(11)
    batches = [[(torch.randn(4, LAYERS[0], generator=g, dtype=torch.float64),
                 torch.randn(4, LAYERS[-1], generator=g, dtype=torch.float64))
                for _ in range(size)] for _ in range(steps)]
    bound = threading.Barrier(size, timeout=TIMEOUT)

    def train(rank: int):
        model, shadow = _mlp(), _mlp()
        model.load_state_dict(init)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        local, averaged, after = [], [], []
        with Peer(rank, topology, name, timeout=TIMEOUT, **options) as peer:
            bound.wait()
            peer.attach(model, bucket_mb=TINY_BUCKETS, first_bucket_mb=TINY_BUCKETS)
            for step in range(steps):
                shadow.load_state_dict(model.state_dict())  # this peer's own gradient
                shadow.zero_grad()
                _loss(shadow, batches[step][rank]).backward()
                local.append(_flat(p.grad for p in shadow.parameters()))
                optimizer.zero_grad()
                _loss(model, batches[step][rank]).backward()
                peer.step(model, optimizer)
                averaged.append(_flat(p.grad for p in model.parameters()))
                after.append(_flat(model.parameters()))
            buckets = peer.overlap_metrics()["buckets"]
        return torch.stack(local), torch.stack(averaged), torch.stack(after), buckets

    out = run_peers(size, train, timeout=12 * TIMEOUT)
    local, averaged, after = (torch.stack([o[i] for o in out], dim=1) for i in range(3))
    plan = plan_buckets([p.numel() for p in _mlp().parameters()], 8,
                        bucket_mb=TINY_BUCKETS, first_bucket_mb=TINY_BUCKETS)
    assert len(plan) > 4 and [o[3] for o in out] == [len(plan)] * size

    # The blocking strategy, bucket after bucket, on the same local gradients.
    tag = STRATEGIES.options(name, options).tag
    bound = threading.Barrier(size, timeout=TIMEOUT)

    def blocking(rank: int) -> torch.Tensor:
        got = torch.empty_like(local[:, rank])
        with Peer(rank, topology, name, timeout=TIMEOUT, **options) as peer:
            bound.wait()
            per_bucket = [peer.strategy] + [
                peer.add_strategy(name, **{**options, "tag": f"{tag}.b{b.index}"})
                for b in plan[1:]]
            shapes = [p.shape for p in _mlp().parameters()]
            for b, strategy in zip(plan, per_bucket):  # what overlap tells each bucket's
                strategy.use_layout([shapes[i] for i in sorted(b.indices)])
            for step in range(steps):
                for b, strategy in zip(plan, per_bucket):
                    x = local[step, rank, b.start:b.stop].clone()
                    with peer.communicating():
                        got[step, b.start:b.stop] = strategy.average_gradients(x, 1, step)
        return got

    expected = torch.stack(run_peers(size, blocking, timeout=12 * TIMEOUT), dim=1)
    assert torch.isfinite(after).all()
    for step in range(steps):
        for rank in range(size):
            assert torch.equal(averaged[step, rank], expected[step, rank]), (step, rank)

    if STRATEGIES.strategy_class(name, options).capabilities_for(
            STRATEGIES.options(name, options))["exact_mean"]:
        oracle = _mlp()
        oracle.load_state_dict(init)
        for step in range(steps):
            grads = []
            for rank in range(size):
                oracle.zero_grad()
                _loss(oracle, batches[step][rank]).backward()
                grads.append(_flat(p.grad for p in oracle.parameters()))
            mean = torch.stack(grads).mean(0)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(
                    _flat(oracle.parameters()) - lr * mean, oracle.parameters())
            for rank in range(size):
                torch.testing.assert_close(after[step, rank], _flat(oracle.parameters()))
                assert torch.equal(after[step, rank], after[step, 0]), "peers disagree"
