"""ring-allreduce with a compressor: quantized partial sums around the ring, real peers."""

from __future__ import annotations

import pytest
import torch

from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.transport import LoopbackHub


@pytest.mark.parametrize("size", [2, 3, 5, 7])
@pytest.mark.parametrize("inplace", [False, True], ids=["out=None", "out=x"])
def test_fp16_ring_is_the_mean_to_half_precision_and_identical_everywhere(
        size, inplace, local_topology, run_rounds, make_data, oracle):
    topology = local_topology("ring", size)
    data = make_data(2, size, (1003,), torch.float32, seed=size)
    run = run_rounds(topology, "ring-allreduce", data, inplace=inplace, compressor="fp16",
                     piece_bytes=1024)
    expected = oracle.mean(data).unsqueeze(1).expand(run.results.shape)
    torch.testing.assert_close(run.results.double(), expected, rtol=0, atol=5e-3)
    for rank in range(1, size):
        assert torch.equal(run.results[:, rank], run.results[:, 0])


@pytest.mark.slow  # 400 rounds
@pytest.mark.parametrize("compressor", ["qsgd", "terngrad"])
def test_unbiased_quantizers_average_to_the_mean_over_rounds(compressor, local_topology,
                                                              run_rounds, oracle):
    """Each round draws new rounding noise (seeded by the round), so the average of many
    rounds of the same input converges to the exact mean like 1/sqrt(rounds)."""
    size, rounds = 3, 400
    topology = local_topology("ring", size)
    x = torch.randn(size, 50, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    data = x.unsqueeze(0).expand(rounds, -1, -1).contiguous()
    run = run_rounds(topology, "ring-allreduce", data, loopback=True, compressor=compressor)
    mean = x.mean(0)
    single = (run.results[0, 0] - mean).norm()
    averaged = (run.results[:, 0].mean(0) - mean).norm()
    assert single > 0.01 * mean.norm(), "no rounding noise at all: test would prove nothing"
    assert averaged < 3 * single / rounds ** 0.5


@pytest.mark.slow  # 2 x 200 rounds
def test_error_feedback_makes_biased_sign_converge_on_average(local_topology, run_rounds):
    """sign is biased; with error feedback what it drops comes back, so the running average
    of the results approaches the true mean (without it the error stays put)."""
    size, rounds = 3, 200
    topology = local_topology("ring", size)
    x = torch.randn(size, 40, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    data = x.unsqueeze(0).expand(rounds, -1, -1).contiguous()
    errors = {}
    for feedback in (False, True):
        run = run_rounds(topology, "ring-allreduce", data, loopback=True, compressor="sign",
                         error_feedback=feedback)
        errors[feedback] = float((run.results[:, 0].mean(0) - x.mean(0)).norm())
    assert errors[True] < 0.1 * errors[False]


def test_one_peer_returns_its_input_exactly(local_topology, run_rounds, make_data):
    data = make_data(2, 1, (17,), torch.float32)
    run = run_rounds(local_topology("ring", 1), "ring-allreduce", data, compressor="sign")
    assert torch.equal(run.results, data)


@pytest.mark.parametrize("compressor", ["topk", "threshold"])
def test_sparsifiers_are_refused_with_the_sparse_strategies_named(compressor, local_topology):
    topology = local_topology("ring", 3)
    with (pytest.raises(ConfigError, match="gtopk or spardl"),
          Peer(0, topology, "ring-allreduce", transport=LoopbackHub(3).transport(0),
               compressor=compressor)):
        pass


@pytest.mark.parametrize("size", [1, 3, 4])
def test_randomk_averages_the_same_entries_on_every_peer(size, local_topology, run_rounds,
                                                         make_data, oracle):
    topology = local_topology("ring", size)
    data = make_data(3, size, (1001,), torch.float64, seed=size)
    run = run_rounds(topology, "ring-allreduce", data, inplace=True, compressor="randomk",
                     density=0.1)
    mean = oracle.mean(data)
    for round in range(3):
        kept = run.results[round, 0] != 0
        assert kept.sum() == 101
        for rank in range(size):
            assert torch.equal(run.results[round, rank], run.results[round, 0])
        torch.testing.assert_close(run.results[round, 0][kept], mean[round][kept])
    assert not torch.equal(run.results[0, 0] != 0, run.results[1, 0] != 0), "same entries"


@pytest.mark.slow  # 2 x 200 rounds
def test_randomk_with_error_feedback_sends_everything_eventually(local_topology, run_rounds):
    """Unscaled random-k alone applies only density x the mean on average; with error
    feedback what was not picked is sent later, so the average approaches the mean."""
    size, rounds = 3, 200
    topology = local_topology("ring", size)
    x = torch.randn(size, 200, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    data = x.unsqueeze(0).expand(rounds, -1, -1).contiguous()
    errors = {}
    for feedback in (False, True):
        run = run_rounds(topology, "ring-allreduce", data, loopback=True,
                         compressor="randomk", density=0.1, error_feedback=feedback)
        errors[feedback] = float((run.results[:, 0].mean(0) - x.mean(0)).norm())
    assert errors[False] > 0.8 * float(x.mean(0).norm())
    assert errors[True] < 0.3 * errors[False]
