"""Sparse-set arithmetic, the sparse-block wire format (and its checks), options and state of
the sparse all-reduce strategies, against numpy oracles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.errors import ConfigError, ProtocolError
from gossip.strategies import STRATEGIES
from gossip.strategies.sparse.sets import keep_topk, member, merge_sum, select
from gossip.strategies.sparse.wire import encode_block, pack, unpack
from gossip.topology import Topology
from gossip.transport import LoopbackHub, Message, codec

index_sets = st.lists(st.integers(0, 200), max_size=60, unique=True).map(
    lambda xs: np.array(sorted(xs), dtype=np.int64))


def values_for(idx: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(idx.size).astype(np.float32)


@settings(max_examples=150, deadline=None)
@given(index_sets, index_sets, st.integers(0, 2**31))
def test_merge_sum_is_the_union_with_sums(a, b, seed):
    av, bv = values_for(a, seed), values_for(b, seed + 1)
    idx, val = merge_sum(a, av, b, bv)
    expected: dict[int, np.float32] = {}
    for i, v in [*zip(a.tolist(), av), *zip(b.tolist(), bv)]:
        expected[i] = expected.get(i, np.float32(0)) + v
    assert idx.tolist() == sorted(expected)
    assert val.tolist() == [expected[i] for i in sorted(expected)]
    assert member(a, b).tolist() == [i in set(b.tolist()) for i in a.tolist()]


@settings(max_examples=150, deadline=None)
@given(index_sets, st.integers(1, 70), st.integers(0, 2**31))
def test_keep_topk_splits_by_magnitude_and_stays_sorted(idx, k, seed):
    val = values_for(idx, seed)
    val[::7] = 0  # zeros are never kept
    (ki, kv), (di, _) = keep_topk(idx, val, k)
    nonzero = np.abs(val[val != 0])
    assert ki.size == min(k, nonzero.size)
    assert np.all(kv != 0) and np.all(np.diff(ki) > 0) and np.all(np.diff(di) > 0)
    assert sorted(ki.tolist() + di.tolist()) == idx.tolist()
    if ki.size and nonzero.size > ki.size:
        assert np.abs(kv).min() >= np.sort(nonzero)[-ki.size - 1]
    np.testing.assert_array_equal(val[np.searchsorted(idx, ki)], kv)


@pytest.mark.parametrize("n, k", [(10, 3), (1000, 10), (600_000, 6000), (7, 7)])
def test_select_is_the_exact_topk_without_zeros(n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::5] = 0
    idx, val = select(x, k, torch.Generator().manual_seed(1))
    a = x.numpy()
    order = np.argsort(-np.abs(a), kind="stable")[:k]
    want = np.sort(order[a[order] != 0])
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(val, a[want])


# -- wire -----------------------------------------------------------------------------


def roundtrip(msg: Message, src: int = 3) -> Message:
    """The message as a receiver decodes it off the wire."""
    header, frames = codec.encode(msg, src)
    return codec.decode([header] + [bytearray(f.numpy().tobytes()) for f in frames])


@pytest.mark.parametrize("coding", ["compact", "int32"])
def test_blocks_roundtrip_and_forward_their_bytes(coding):
    rng = np.random.default_rng(0)
    blocks = []
    for b, count in [(2, 5), (0, 0), (1, 40)]:
        idx = np.sort(rng.choice(100, count, replace=False)).astype(np.int64)
        blocks.append(encode_block(b, idx, rng.standard_normal(count).astype(np.float32), 100,
                                   coding))
    got = unpack(roundtrip(pack("t.x", 4, blocks, n=290, step=1)), rank=0, n=290, step=1,
                 blocks=[2, 0, 1], length=100, limit=40, dtype=torch.float32)
    for sent, came in zip(blocks, got):
        assert came.id == sent.id and came.scheme == sent.scheme
        np.testing.assert_array_equal(came.idx, sent.idx)
        np.testing.assert_array_equal(came.val, sent.val)
        np.testing.assert_array_equal(came.data, sent.data)
    # Forwarded as received: same bytes, same decoded blocks.
    again = unpack(roundtrip(pack("t.x", 4, got[::-1], n=290, step=2)), rank=0, n=290, step=2,
                   blocks=[1, 0, 2], length=100, limit=40, dtype=torch.float32)
    np.testing.assert_array_equal(again[0].idx, blocks[2].idx)


def good_message(**meta_changes) -> Message:
    block = encode_block(0, np.array([1, 5, 9]), np.ones(3, np.float32), 10, "int32")
    msg = pack("t.x", 0, [block], n=10, step=0)
    return Message(msg.kind, msg.round, meta={**msg.meta, **meta_changes}, buffers=msg.buffers)


def raw_indices(indices: list[int]) -> Message:
    data = torch.from_numpy(np.array(indices, "<i4").view(np.uint8))
    values = torch.ones(len(indices))
    meta = {"n": 10, "s": 0, "b": [0], "k": [len(indices)], "ix": ["raw"], "nb": [data.numel()]}
    return Message("t.x", 0, meta=meta, buffers=(values, data))


@pytest.mark.parametrize("msg, error", [
    (good_message(n=11), "tensor length 11, ours is 10"),
    (good_message(s=1), "step 1 blocks"),
    (good_message(b=[1]), "expected step 0 blocks \\[0\\]"),
    (good_message(k=[4]), "counts \\[4\\] exceed the 3 entries"),
    (good_message(k=[2]), "3 values and 12 index bytes, header says 2"),
    (good_message(k=["3"]), "malformed block header"),
    (good_message(nb=[11]), "index bytes"),
    (good_message(ix=["nope"]), "unknown index scheme"),
    (raw_indices([5, 1, 9]), "not sorted"),
    (raw_indices([1, 1, 9]), "duplicate index 1"),
    (raw_indices([1, 5, 10]), "out of range"),
    (raw_indices([-1, 5, 9]), "out of range"),
    (Message("t.x", 0, meta=good_message().meta, buffers=good_message().buffers[:1]),
     "1 buffers"),
    (Message("t.x", 0, meta=good_message().meta,
             buffers=(torch.ones(3, dtype=torch.float64), good_message().buffers[1])),
     "float64"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_messages_are_protocol_errors_naming_the_peer(msg, error):
    with pytest.raises(ProtocolError, match=f"rank 0: peer 3 sent t.x round 0 .*({error})"):
        unpack(roundtrip(msg), rank=0, n=10, step=0, blocks=[0], length=10, limit=3,
               dtype=torch.float32)


# -- options and state ----------------------------------------------------------------------

NAMES = ["topk-allgather", "gtopk", "spardl"]


def build(name: str, size: int = 1, rank: int = 0, hub: LoopbackHub | None = None, **options):
    hub = hub or LoopbackHub(size)
    return STRATEGIES.create(name, rank=rank, topology=Topology.generate("ring", size),
                           transport=hub.transport(rank, timeout=5), options=options)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("options, error", [
    ({"density": 0}, "density"), ({"density": 1.5}, "density"), ({"density": "x"}, "density"),
    ({"error_feedback": "yes"}, "error_feedback"), ({"indices": "zip"}, "indices"),
    ({"compressor": "topk"}, "takes no compressor"), ({"bogus": 1}, "no option 'bogus'"),
])
def test_bad_options_are_config_errors_naming_the_option(name, options, error):
    with pytest.raises(ConfigError, match=error):
        build(name, **options)


def test_gtopk_residual_mode_is_checked():
    with pytest.raises(ConfigError, match="residual_mode must be one of conserve, reference"):
        build("gtopk", residual_mode="paper")


@pytest.mark.parametrize("name", NAMES)
def test_single_peer_keeps_the_topk_and_carries_the_rest(name):
    """P = 1: result = top-k of x + residual, residual = the rest; state_dict round-trips."""
    strategy = build(name, density=0.3)
    x = torch.tensor([0.5, -3.0, 1.0, 0.0, 2.0, -0.25, 0.1, 4.0, 0.3, -1.5])  # k = 3
    y = strategy.synchronize(x, 0)
    assert y.tolist() == [0, -3.0, 0, 0, 2.0, 0, 0, 4.0, 0, 0]
    assert torch.equal(strategy.residual, x - y)
    state = strategy.state_dict()
    other = build(name, density=0.3)
    other.load_state_dict(state)
    out = torch.empty(10)
    z = other.synchronize(x, 1, out=out)  # residual carried: x + (x - y)
    assert z.data_ptr() == out.data_ptr()
    assert torch.equal(z, strategy.synchronize(x, 1))
    assert z.tolist() == [0, -3.0, 0, 0, 0, 0, 0, 4.0, 0, -3.0]  # top 3 of 2x - y
    with pytest.raises(ConfigError, match="got a tensor of 9 elements; its residual has 10"):
        other.synchronize(x[:9], 2)


@pytest.mark.parametrize("name", NAMES)
def test_without_error_feedback_the_residual_is_dropped(name):
    strategy = build(name, density=0.3, error_feedback=False)
    x = torch.tensor([0.5, -3.0, 1.0, 0.0, 2.0, -0.25, 0.1, 4.0, 0.3, -1.5])
    first = strategy.synchronize(x, 0)
    assert torch.equal(strategy.residual, x - first)  # still reported
    assert torch.equal(strategy.synchronize(x, 1), first)  # but not added


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_non_float_tensors(name):
    strategy = build(name)
    assert strategy.synchronize(torch.zeros(0), 0).numel() == 0
    with pytest.raises(ConfigError, match="float32, float64 or float16"):
        strategy.synchronize(torch.zeros(3, dtype=torch.int64), 1)
