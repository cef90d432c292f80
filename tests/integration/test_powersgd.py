"""PowerSGD (gossip/strategies/ring/powersgd.py) against a numpy float64 oracle, with real
peers over ZeroMQ on loopback as threads, odd peer counts and sizes P does not divide: the
rank-r approximation, error feedback against the global M^, every peer identical, the
warm-up a plain ring, the byte ledger, the layout from Peer.step and overlap, checkpoints."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from gossip import matrix
from gossip.errors import ConfigError
from gossip.strategies import STRATEGIES
from gossip.strategies.ring.lowrank import blocks, first_factor
from support import peer_once_all_bound, run_in_threads

# A conv kernel (viewed 6 x 27), a bias, a linear layer, its bias, a small matrix: 307
# elements, which neither 3 nor 5 divides.
SHAPES = [(6, 3, 3, 3), (6,), (5, 17), (5,), (2, 3)]
NUMEL = sum(math.prod(s) for s in SHAPES)
TIMEOUT = 10.0


def rounds(topology, data: torch.Tensor, *, shapes=SHAPES, strategy="powersgd",
           state=None, **options) -> tuple[torch.Tensor, list[dict], list[dict]]:
    """Every peer synchronizes ``data[round, rank]`` in place (after ``use_layout(shapes)``
    and loading ``state[rank]`` if given); the results [round, rank], each peer's strategy
    state and transport stats."""
    n_rounds, size = data.shape[:2]
    results = torch.empty_like(data)
    states, stats = [None] * size, [None] * size
    bound = threading.Barrier(size, timeout=TIMEOUT)

    def main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, strategy, bound, timeout=TIMEOUT,
                                 **options) as peer:
            if state is not None:
                peer.strategy.load_state_dict(state[rank])
            if shapes is not None:
                peer.strategy.use_layout(shapes)
            for r in range(n_rounds):
                x = data[r, rank].clone()
                results[r, rank] = peer.synchronize(x, r, out=x)
            states[rank], stats[rank] = peer.strategy.state_dict(), peer.stats

    run_in_threads(size, main, timeout=6 * TIMEOUT)
    return results, states, stats


def inputs(n_rounds: int, size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rounds, size, NUMEL, generator=g, dtype=torch.float64)


def orth(m: np.ndarray) -> np.ndarray:
    return np.linalg.qr(m)[0]


def oracle(data: torch.Tensor, *, rank: int, seed: int = 0, tag: str = "powersgd",
           min_compression_rate: float = 2.0) -> tuple[np.ndarray, list[dict]]:
    """One-process PowerSGD of the mean over peers, with the strategy's first Q: per round
    the result, and per matrix the peers' residuals after the last round."""
    n_rounds, size = data.shape[:2]
    x = data.numpy()
    layout = blocks(SHAPES, NUMEL, rank=rank, min_compression_rate=min_compression_rate)
    out = np.empty((n_rounds, NUMEL))
    errors = {i: np.zeros((size, b.rows, b.cols)) for i, b in enumerate(layout) if b.rank}
    factors = {}
    for r in range(n_rounds):
        for i, b in enumerate(layout):
            if not b.rank:
                out[r, b.start:b.stop] = x[r, :, b.start:b.stop].mean(0)
                continue
            a = x[r, :, b.start:b.stop].reshape(size, b.rows, b.cols) + errors[i]
            q = factors.get(i)
            if q is None:
                q = first_factor(seed, f"{tag}.{i}", r, b.cols, b.rank, torch.float64).numpy()
            p = orth(a.mean(0) @ orth(q))
            q = a.mean(0).T @ p
            approx = p @ q.T
            out[r, b.start:b.stop] = approx.reshape(-1)
            errors[i], factors[i] = a - approx, q
    return out, [{i: e[w] for i, e in errors.items()} for w in range(size)]


@pytest.mark.parametrize("size", [3, 5])
def test_full_rank_without_the_rate_check_is_the_ring_mean(size, local_topology):
    data = inputs(2, size)
    results, _, _ = rounds(local_topology("ring", size), data, start_iter=0,
                           matrix_rank=27, min_compression_rate=0.0)
    for r in range(2):
        for y in results[r]:
            torch.testing.assert_close(y, data[r].mean(0), rtol=1e-9, atol=1e-9)


def test_one_peer_rebuilds_an_exactly_rank_r_matrix_in_one_step(local_topology):
    g = torch.Generator().manual_seed(3)
    m = torch.randn(9, 2, generator=g, dtype=torch.float64) @ torch.randn(
        2, 14, generator=g, dtype=torch.float64)
    results, states, _ = rounds(local_topology("ring", 1), m.reshape(1, 1, -1), shapes=[(9, 14)],
                                start_iter=0, matrix_rank=2)
    torch.testing.assert_close(results[0, 0], m.reshape(-1), rtol=1e-9, atol=1e-9)
    assert states[0]["errors"]["0"].abs().max() < 1e-9


# Rank 3 orthogonalizes by QR, not Gram-Schmidt; at rate 2 it would compress nothing.
@pytest.mark.parametrize("size, rank, rate", [(3, 1, 2.0), (5, 2, 2.0), (3, 3, 1.0)])
def test_the_oracle_of_the_mean_every_peer_identical(size, rank, rate, local_topology):
    data = inputs(4, size, seed=size)
    results, states, _ = rounds(local_topology("ring", size), data, start_iter=0,
                                matrix_rank=rank, min_compression_rate=rate)
    expected, errors = oracle(data, rank=rank, min_compression_rate=rate)
    for r in range(4):
        for w in range(size):  # M^ bitwise the same everywhere, and the oracle's
            assert torch.equal(results[r, w], results[r, 0])
        np.testing.assert_allclose(results[r, 0].numpy(), expected[r], rtol=1e-7, atol=1e-9)
    assert states[0]["errors"], "nothing was compressed"
    for key, q in states[0]["factors"].items():
        assert all(torch.equal(s["factors"][key], q) for s in states)
    for key in states[0]["errors"]:
        ours = torch.stack([s["errors"][key] for s in states])
        # mean_w e_w is the residual of the mean: mean_w (M_w + e_w) - M^
        np.testing.assert_allclose(ours.mean(0).numpy(),
                                   np.mean([errors[w][int(key)] for w in range(size)], 0),
                                   rtol=1e-7, atol=1e-9)
        for w in range(size):
            np.testing.assert_allclose(ours[w].numpy(), errors[w][int(key)], rtol=1e-7,
                                       atol=1e-9)


def test_the_warm_up_is_bitwise_the_ring_allreduce(local_topology):
    data = inputs(3, 5, seed=7).float()
    ours, _, stats = rounds(local_topology("ring", 5), data, start_iter=3, matrix_rank=2)
    ring, _, _ = rounds(local_topology("ring", 5), data, shapes=None,
                        strategy="ring-allreduce")
    assert torch.equal(ours, ring)
    for s in stats:  # the P ring sent nothing
        assert {k for k in s["by_kind"] if k.startswith("powersgd.")} == {"powersgd.q.rs",
                                                                            "powersgd.q.ag"}


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_byte_ledger_is_the_formula(size, dtype, local_topology):
    rank, n_rounds = 2, 3
    data = inputs(n_rounds, size, seed=1).to(dtype)
    _, _, stats = rounds(local_topology("ring", size), data, start_iter=0, matrix_rank=rank)
    layout = blocks(SHAPES, NUMEL, rank=rank, min_compression_rate=2.0)
    factors = sum(b.rank * (b.rows + b.cols) for b in layout)
    dense = sum(b.stop - b.start for b in layout if not b.rank)
    assert factors and dense  # both rings carry something
    b = data.element_size()
    formula = 2 * (size - 1) / size * b * (factors + dense) * n_rounds
    messages = 4 * (size - 1) * n_rounds  # two serial all-reduces per round
    total = 0
    for s in stats:
        ours = {k: v for k, v in s["by_kind"].items() if k.startswith("powersgd.")}
        assert sum(v["messages_sent"] for v in ours.values()) == messages
        sent = sum(v["bytes_sent"] for v in ours.values())
        total += sent
        # Segments differ by one element at most: within a header and an element a message.
        assert abs(sent - formula) <= messages * (256 + b)
    # Over all peers every segment is sent exactly 2(P-1) times: only the headers remain.
    assert 0 < total - size * formula <= size * messages * 256


def test_a_checkpoint_resumes_the_same_rounds(local_topology):
    data = inputs(4, 3, seed=2)
    whole, _, _ = rounds(local_topology("ring", 3), data, start_iter=1)
    first, states, _ = rounds(local_topology("ring", 3), data[:2], start_iter=1)
    rest, _, _ = rounds(local_topology("ring", 3), data[2:], start_iter=1, state=states)
    assert torch.equal(torch.cat([first, rest]), whole)


def test_without_a_layout_a_matrix_is_one_and_a_vector_goes_dense(local_topology):
    g = torch.Generator().manual_seed(5)
    m = torch.randn(1, 3, 8, 9, generator=g, dtype=torch.float64)
    results, states, _ = rounds(local_topology("ring", 3), m.expand(1, 3, 8, 9).clone(),
                                shapes=None, start_iter=0)
    assert set(states[0]["errors"]) == {"0"} and states[0]["shapes"] is None
    flat = inputs(1, 3)
    results, states, _ = rounds(local_topology("ring", 3), flat, shapes=None, start_iter=0)
    assert torch.equal(results[0, 0], results[0, 2]) and not states[0]["errors"]
    torch.testing.assert_close(results[0, 0], flat[0].mean(0))


class Net(torch.nn.Module):
    """A conv layer and two linear ones on 1 x 6 x 6 inputs."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 16, 24)
        self.fc2 = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


@pytest.mark.parametrize("overlap", [False, True])
def test_peer_step_tells_the_layout_and_every_model_stays_identical(overlap, local_topology):
    size, steps = 3, 6
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, 16, 1, 6, 6, generator=g), torch.randint(0, 3, (size, 16),
                                                                       generator=g)
    losses, params, layouts = [[] for _ in range(size)], [None] * size, [None] * size
    topology = local_topology("ring", size)
    bound = threading.Barrier(size, timeout=TIMEOUT)
    torch.manual_seed(1)  # here, once: threads seeding the global generator would race
    init = Net().state_dict()

    def main(rank: int) -> None:
        model = Net()
        model.load_state_dict(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with peer_once_all_bound(rank, topology, "powersgd", bound, timeout=TIMEOUT,
                                 start_iter=1, matrix_rank=2) as peer:
            if overlap:  # 4 KiB buckets: several, each with its own layout
                peer.attach(model, bucket_mb=4 / 1024, first_bucket_mb=4 / 1024)
            for _ in range(steps):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[rank]), y[rank])
                loss.backward()
                peer.step(model, opt)
                losses[rank].append(loss.item())
            params[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            layouts[rank] = peer.strategy.shapes

    run_in_threads(size, main, timeout=6 * TIMEOUT)
    assert all(torch.equal(p, params[0]) for p in params)
    shapes = [tuple(p.shape) for p in Net().parameters()]
    if overlap:  # bucket 0 holds the last parameters
        assert layouts[0] and layouts[0] == tuple(shapes[-len(layouts[0]):])
        assert len(layouts[0]) < len(shapes)
    else:
        assert layouts[0] == tuple(shapes)
    assert losses[0][-1] < losses[0][0]


def test_refusals_are_one_line():
    for name in ("spardl", "gtopk", "topk-allgather", "ring-allreduce", "dpsgd"):
        with pytest.raises(ConfigError, match="'powersgd' is a strategy, not a compressor "
                                              r"\(e.g. --strategy powersgd\)") as caught:
            STRATEGIES.options(name, {"compressor": "powersgd", "density": 0.1})
        assert "\n" not in str(caught.value)
    for wrapper in ("local", "nonblocking"):
        with pytest.raises(ConfigError, match="not exactly") as caught:
            STRATEGIES.options(wrapper, {"inner": "powersgd"})
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="matrix_rank must be >= 1"):
        STRATEGIES.options("powersgd", {"matrix_rank": 0})
    with pytest.raises(ConfigError, match="layout's tensors hold 6 elements, the vector 7"):
        blocks([(2, 3)], 7, rank=1, min_compression_rate=2.0)
    assert matrix.cell(matrix.Row("powersgd", {}), matrix.feature("overlap")) is None


@pytest.mark.parametrize("rank", [1, 3])  # Gram-Schmidt, QR
def test_zero_and_fp16_gradients_stay_finite(rank, local_topology):
    """A zero matrix gives zero, not NaN (a zero column in Gram-Schmidt); fp16 values
    whose squares overflow fp16 are orthogonalized in fp32."""
    shapes = [(12, 20)]
    zero = torch.zeros(1, 1, 240, dtype=torch.float64)
    results, _, _ = rounds(local_topology("ring", 1), zero, shapes=shapes, start_iter=0,
                           matrix_rank=rank)
    assert torch.equal(results, zero)
    g = torch.Generator().manual_seed(9)
    big = 1000 * torch.randn(1, 1, 240, generator=g)
    half, _, _ = rounds(local_topology("ring", 1), big.half(), shapes=shapes, start_iter=0,
                        matrix_rank=rank)
    full, _, _ = rounds(local_topology("ring", 1), big, shapes=shapes, start_iter=0,
                        matrix_rank=rank)
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), full, rtol=0.02, atol=0.02 * full.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gradients_are_staged_and_every_model_stays_identical(local_topology):
    size = 3
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, 16, 1, 6, 6, generator=g), torch.randint(0, 3, (size, 16),
                                                                       generator=g)
    params, losses = [None] * size, [[] for _ in range(size)]
    topology = local_topology("ring", size)
    bound = threading.Barrier(size, timeout=TIMEOUT)
    torch.manual_seed(1)
    init = Net().state_dict()

    def main(rank: int) -> None:
        model = Net()
        model.load_state_dict(init)
        model.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with peer_once_all_bound(rank, topology, "powersgd", bound, timeout=TIMEOUT,
                                 start_iter=1, matrix_rank=2) as peer:
            for _ in range(5):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x[rank].cuda()),
                                                         y[rank].cuda())
                loss.backward()
                peer.step(model, opt)
                losses[rank].append(loss.item())
            params[rank] = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
            assert peer.strategy.shapes == tuple(tuple(p.shape) for p in model.parameters())

    run_in_threads(size, main, timeout=6 * TIMEOUT)
    assert all(torch.equal(p, params[0]) for p in params)
    assert losses[0][-1] < losses[0][0]
