"""Tests for gossip.tasks: partitioning, batch streams, evaluation, the digits task."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from gossip.errors import ConfigError
from gossip.tasks import (
    TASKS,
    BatchStream,
    Split,
    Task,
    create_task,
    evaluate,
    partition,
)


@pytest.fixture(scope="module")
def digits() -> Task:
    return create_task("digits", seed=0)


def _labels(n=1000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n)


# --- partition ---------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
@pytest.mark.parametrize("num_peers", [1, 3, 16])
def test_partition_disjoint_and_covering(scheme, num_peers):
    labels = _labels()
    shards = partition(labels, num_peers, scheme=scheme, alpha=0.3, seed=1)
    assert len(shards) == num_peers
    assert all(s.dtype == np.int64 and s.size > 0 for s in shards)
    joined = np.concatenate(shards)
    assert joined.size == labels.size
    assert np.array_equal(np.sort(joined), np.arange(labels.size))


def test_partition_iid_sizes_and_mix():
    shards = partition(_labels(1003), 10, seed=0)
    sizes = [s.size for s in shards]
    assert max(sizes) - min(sizes) <= 1
    # Shuffled, not contiguous blocks.
    assert not np.array_equal(shards[0], np.arange(shards[0].size))


def test_partition_accepts_tensor():
    labels = _labels()
    a = partition(torch.from_numpy(labels), 4, scheme="dirichlet", seed=3)
    b = partition(labels, 4, scheme="dirichlet", seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_partition_deterministic_by_seed(scheme):
    labels = _labels()
    a = partition(labels, 5, scheme=scheme, seed=7)
    b = partition(labels, 5, scheme=scheme, seed=7)
    c = partition(labels, 5, scheme=scheme, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def _label_dists(labels, shards, classes=10):
    return np.stack([np.bincount(labels[s], minlength=classes) / s.size for s in shards])


def test_partition_dirichlet_skew():
    labels = _labels(2000)
    skewed = _label_dists(labels, partition(labels, 8, scheme="dirichlet", alpha=0.1, seed=0))
    iid = _label_dists(labels, partition(labels, 8, scheme="iid", seed=0))
    # Total-variation distance of each peer's label distribution from the global one.
    glob = np.bincount(labels, minlength=10) / labels.size
    tv_skewed = 0.5 * np.abs(skewed - glob).sum(axis=1).mean()
    tv_iid = 0.5 * np.abs(iid - glob).sum(axis=1).mean()
    assert tv_iid < 0.1
    assert tv_skewed > 0.5
    # Typical peer is dominated by few classes.
    assert np.median(skewed.max(axis=1)) > 0.3


def test_partition_dirichlet_no_empty_peer_under_extreme_skew():
    labels = _labels(60, classes=3)
    shards = partition(labels, 50, scheme="dirichlet", alpha=0.01, seed=0)
    assert min(s.size for s in shards) >= 1
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(60))


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"num_peers": 2, "scheme": "bogus"}, "scheme"),
        ({"num_peers": 2, "scheme": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"num_peers": 2, "scheme": "dirichlet", "alpha": -1.0}, "alpha"),
        ({"num_peers": 0}, "num_peers"),
        ({"num_peers": 11}, "num_peers"),
    ],
)
def test_partition_errors(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        partition(_labels(10), **kwargs)


# --- BatchStream -------------------------------------------------------------


def _toy_split(n=50):
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    return Split(x, torch.arange(n) % 4)


def test_batchstream_shapes_and_consistency():
    split = _toy_split()
    stream = BatchStream(split, np.arange(10, 40), batch_size=8, seed=0)
    for _ in range(10):
        x, y = stream.next()
        assert x.shape == (8, 3) and x.dtype == torch.float32
        assert y.shape == (8,) and y.dtype == torch.int64
        # Features and labels come from the same rows, all inside the shard.
        rows = x[:, 0].long()
        assert torch.equal(y, rows % 4)
        assert ((rows >= 10) & (rows < 40)).all()


def test_batchstream_deterministic():
    split = _toy_split()
    a = BatchStream(split, np.arange(50), batch_size=7, seed=3)
    b = BatchStream(split, np.arange(50), batch_size=7, seed=3)
    c = BatchStream(split, np.arange(50), batch_size=7, seed=4)
    xa = [a.next()[0] for _ in range(20)]
    xb = [b.next()[0] for _ in range(20)]
    xc = [c.next()[0] for _ in range(20)]
    assert all(torch.equal(p, q) for p, q in zip(xa, xb))
    assert not all(torch.equal(p, q) for p, q in zip(xa, xc))


def test_batchstream_covers_shard_each_epoch_and_reshuffles():
    split = _toy_split()
    shard = np.arange(0, 48, 2)  # 24 rows, 3 batches of 8 per epoch
    stream = BatchStream(split, shard, batch_size=8, seed=0)
    epochs = []
    for e in range(3):
        rows = torch.cat([stream.next()[0][:, 0] for _ in range(3)]).long().numpy()
        assert stream.epoch == e
        assert np.array_equal(np.sort(rows), shard)
        epochs.append(rows)
    assert not np.array_equal(epochs[0], epochs[1])


def test_batchstream_drops_partial_batch():
    stream = BatchStream(_toy_split(), np.arange(10), batch_size=4, seed=0)
    seen = [stream.next()[0].shape[0] for _ in range(6)]
    assert seen == [4] * 6
    assert stream.epoch == 2  # 2 batches per epoch; the 2 leftover rows are skipped


def test_batchstream_small_shard_gives_whole_shard():
    stream = BatchStream(_toy_split(), np.array([3, 5, 7]), batch_size=32, seed=0)
    for _ in range(3):
        x, _ = stream.next()
        assert sorted(x[:, 0].long().tolist()) == [3, 5, 7]


def test_batchstream_errors():
    split = _toy_split()
    with pytest.raises(ConfigError, match="batch_size"):
        BatchStream(split, np.arange(5), batch_size=0, seed=0)
    with pytest.raises(ConfigError, match="indices"):
        BatchStream(split, np.array([], dtype=np.int64), batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="indices"):
        BatchStream(split, np.array([0, 50]), batch_size=4, seed=0)


# --- evaluate ----------------------------------------------------------------


class _FirstFeature(nn.Module):
    """Predicts class 1 when feature 0 > 0, else class 0, with confident logits."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(100.0))

    def forward(self, x):
        return torch.stack([torch.zeros_like(x[:, 0]), self.scale * x[:, 0]], dim=1)


def test_evaluate_trivial_model():
    x = torch.tensor([[1.0], [-1.0], [2.0], [-3.0]])
    y = torch.tensor([1, 0, 0, 0])  # third example is misclassified
    model = _FirstFeature()
    model.train()
    loss, acc = evaluate(model, Split(x, y), batch_size=3)  # 2 batches, uneven
    assert acc == pytest.approx(0.75)
    # Correct ones have ~0 loss, the wrong one has loss ~200; mean over 4.
    assert loss == pytest.approx(200 / 4, rel=1e-3)
    assert model.training  # mode restored
    model.eval()
    evaluate(model, Split(x, y))
    assert not model.training


def test_evaluate_empty_split():
    with pytest.raises(ConfigError):
        evaluate(_FirstFeature(), Split(torch.zeros(0, 1), torch.zeros(0, dtype=torch.int64)))


# --- digits task / registry --------------------------------------------------


def test_digits_task_shapes(digits):
    assert "digits" in TASKS.names()
    assert digits.name == "digits" and digits.num_classes == 10
    assert digits.train.x.shape == (1437, 64) and digits.test.x.shape == (360, 64)
    assert digits.train.x.dtype == torch.float32 and digits.train.y.dtype == torch.int64
    assert torch.isfinite(digits.train.x).all() and torch.isfinite(digits.test.x).all()
    # Standardized with train statistics (non-constant pixels have mean 0, std 1).
    assert digits.train.x.mean(0).abs().max() < 1e-4
    std = digits.train.x.std(0, unbiased=False)
    assert ((std - 1).abs() < 1e-3).sum() >= 60
    # Stratified: per-class proportions match between train and test.
    tr = np.bincount(digits.train.y.numpy(), minlength=10) / len(digits.train)
    te = np.bincount(digits.test.y.numpy(), minlength=10) / len(digits.test)
    assert np.abs(tr - te).max() < 0.01


def test_digits_split_seeded(digits):
    again = create_task("digits", seed=0)
    other = create_task("digits", seed=1)
    assert torch.equal(again.train.x, digits.train.x)
    assert not torch.equal(other.train.y, digits.train.y)


def test_digits_model_deterministic(digits):
    torch.manual_seed(5)
    a = digits.build_model()
    torch.manual_seed(5)
    b = digits.build_model()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert a(digits.test.x[:2]).shape == (2, 10)


def test_unknown_task():
    with pytest.raises(ConfigError, match="digits"):
        create_task("nope")


def test_digits_sanity_training(digits):
    torch.manual_seed(0)
    model = digits.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stream = BatchStream(digits.train, np.arange(len(digits.train)), batch_size=32, seed=0)
    for _ in range(300):
        x, y = stream.next()
        opt.zero_grad()
        digits.loss_fn(model(x), y).backward()
        opt.step()
    loss, acc = evaluate(model, digits.test, digits.loss_fn)
    assert acc >= 0.93
    assert loss < 0.5


@pytest.mark.slow  # a fresh interpreter importing torch
def test_import_does_not_load_sklearn():
    code = "import sys, gossip, gossip.tasks, gossip.metrics; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
