"""Peer over ZeroMQ: configuration and misuse errors, start order, socket cleanup, step()."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossip.errors import ConfigError, PeerNotOpen, PeerTimeout, ProtocolError, TransportError
from gossip.peer import Peer

STRATEGIES = ["ring-allreduce", "dpsgd"]


# -- configuration errors -------------------------------------------------------------------


def test_unknown_strategy_lists_the_known_ones(local_topology):
    with pytest.raises(ConfigError, match="unknown strategy 'gossip-all'") as info:
        Peer(0, local_topology("ring", 2), "gossip-all")
    assert "dpsgd" in str(info.value) and "ring-allreduce" in str(info.value)


@pytest.mark.parametrize("strategy, option", [("dpsgd", "piece_bytes"),
                                              ("ring-allreduce", "bogus")])
def test_unknown_option_is_named(strategy, option, local_topology):
    with pytest.raises(ConfigError, match=f"strategy '{strategy}' has no option '{option}'"):
        Peer(0, local_topology("ring", 2), strategy, **{option: 1})


@pytest.mark.parametrize("rank", [-1, 3, 10])
def test_rank_outside_the_topology(rank, local_topology):
    with pytest.raises(ConfigError, match=rf"rank {rank} is not in the topology \(ranks 0..2\)"):
        Peer(rank, local_topology("ring", 3), "dpsgd")


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_timeout_must_be_positive(timeout, local_topology):
    with pytest.raises(ConfigError, match="timeout must be positive"):
        Peer(0, local_topology("ring", 2), "dpsgd", timeout=timeout)


def test_bad_option_value_fails_on_enter_and_frees_the_address(local_topology):
    topology = local_topology("ring", 1)
    with pytest.raises(ConfigError, match="piece_bytes must be >= 64, got 63"):
        with Peer(0, topology, "ring-allreduce", piece_bytes=63):
            pass
    with Peer(0, topology, "ring-allreduce", timeout=2) as peer:  # the port is free again
        assert torch.equal(peer.synchronize(torch.ones(3), 0), torch.ones(3))


def test_synchronize_outside_with_block(local_topology):
    with pytest.raises(PeerNotOpen, match="Peer is not open"):
        Peer(0, local_topology("ring", 1), "dpsgd").synchronize(torch.ones(2), 0)


def test_address_in_use_is_a_transport_error_naming_it(local_topology):
    topology = local_topology("ring", 2)
    with Peer(0, topology, "dpsgd", timeout=2):
        with pytest.raises(TransportError, match=f"cannot listen on {topology.address(0)}"):
            with Peer(0, topology, "dpsgd", timeout=2):
                pass


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("out", [torch.zeros(4), torch.zeros(3, dtype=torch.float64),
                                 torch.zeros(6)[::2]], ids=["shape", "dtype", "strided"])
def test_out_must_match_the_input(strategy, out, local_topology):
    with Peer(0, local_topology("ring", 1), strategy, timeout=2) as peer:
        with pytest.raises(ConfigError, match="out must be a contiguous torch.float32 tensor "
                                              "of shape \\(3,\\)"):
            peer.synchronize(torch.ones(3), 0, out=out)


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_ring_allreduce_refuses_non_float_tensors(size, dtype, local_topology, run_peers):
    topology = local_topology("ring", size)

    def peer_main(rank: int) -> None:
        with Peer(rank, topology, "ring-allreduce", timeout=2) as peer:
            with pytest.raises(ConfigError, match=f"floating-point tensors, got {dtype}"):
                peer.synchronize(torch.ones(5, dtype=dtype), 0)

    run_peers(size, peer_main)


# -- peers that disagree ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_different_tensor_lengths_are_a_protocol_error(strategy, local_topology, run_peers):
    topology = local_topology("ring", 3)
    lengths = [5, 5, 7]

    def peer_main(rank: int) -> BaseException | None:
        try:
            with Peer(rank, topology, strategy, timeout=1.0) as peer:
                peer.synchronize(torch.ones(lengths[rank]), 0)
        except (ProtocolError, PeerTimeout) as exc:
            return exc
        return None

    errors = run_peers(3, peer_main)
    protocol = [str(e) for e in errors if isinstance(e, ProtocolError)]
    assert protocol, f"no ProtocolError: {errors}"
    assert all(isinstance(e, (ProtocolError, PeerTimeout)) for e in errors), errors
    for text in protocol:
        assert "same length" in text and ("7" in text and "5" in text), text


# -- start order, goodbyes ------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peers_may_start_in_any_order(strategy, local_topology, run_peers, oracle):
    """Higher ranks start first: messages to a peer not bound yet wait in ZeroMQ's queue."""
    topology = local_topology("star", 4)
    data = torch.arange(4 * 6, dtype=torch.float64).reshape(1, 4, 6) ** 1.5
    started = [threading.Event() for _ in range(4)]

    def peer_main(rank: int) -> torch.Tensor:
        if rank < 3:  # each rank opens once the one above it has
            assert started[rank + 1].wait(10), f"rank {rank + 1} never started"
        with Peer(rank, topology, strategy, timeout=5) as peer:
            started[rank].set()
            return peer.synchronize(data[0, rank], 0)

    results = torch.stack(run_peers(4, peer_main)).unsqueeze(0)
    if strategy == "dpsgd":
        oracle.assert_mixed(topology, results, data)
    else:
        oracle.assert_mean_everywhere(results, data)


def test_failed_peer_does_not_hang_its_neighbours_shutdown(local_topology, run_peers):
    """Rank 1 leaves with an exception (no goodbye); rank 0 still closes in bounded time."""
    topology = local_topology("ring", 2)
    closed_after: list[float] = []

    class Crash(Exception):
        pass

    all_bound = threading.Barrier(2, timeout=5)
    # Rank 1 crashes only once rank 0 holds its round-0 message: a crash drops what is still
    # queued (linger 0), and on a loaded machine that may be the round-0 message itself.
    round_done = threading.Barrier(2, timeout=5)

    def peer_main(rank: int) -> None:
        try:
            with Peer(rank, topology, "dpsgd", timeout=1.0) as peer:
                all_bound.wait()
                peer.synchronize(torch.ones(3), 0)
                round_done.wait()
                if rank == 1:
                    raise Crash  # leaves without a goodbye
                start = time.monotonic()
        except Crash:
            return
        closed_after.append(time.monotonic() - start)

    run_peers(2, peer_main)
    # It waits `timeout` for the goodbye, then up to 1 s (flush) for its own to leave.
    # The upper bound leaves a loaded machine room, and is still far from a stuck close.
    assert len(closed_after) == 1 and 1.0 - 0.05 < closed_after[0] < 1.0 + 1.0 + 6.0


# -- Peer.step ------------------------------------------------------------------------------


def test_step_with_ring_allreduce_applies_the_averaged_gradient(local_topology, train_steps):
    steps = train_steps(local_topology("ring", 3), "ring-allreduce", lr=0.1)
    expected = steps.before - 0.1 * steps.grads.mean(dim=1, keepdim=True)
    torch.testing.assert_close(steps.after, expected, rtol=1e-5, atol=1e-6)
    for rank in range(1, 3):
        assert torch.equal(steps.after[:, rank], steps.after[:, 0])
    assert torch.equal(steps.frozen_after, torch.ones(3, 3))


def test_step_with_dpsgd_mixes_the_locally_updated_parameters(local_topology, train_steps):
    topology = local_topology("star", 4)
    steps = train_steps(topology, "dpsgd", lr=0.1, same_init=False)
    mixing = torch.from_numpy(topology.mixing_matrix()).float()
    expected = torch.einsum("ij,sjd->sid", mixing, steps.before - 0.1 * steps.grads)
    torch.testing.assert_close(steps.after, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(steps.after[:, 0], steps.after[:, 1])  # a real mix, not a mean
    assert torch.equal(steps.frozen_after, torch.ones(4, 3))
