"""Index-set encodings: every scheme round-trips, the smallest is chosen, top-k payloads stay
within the byte bound, and truncated or garbage data is rejected with ProtocolError only."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gossip.compress import create, decode_indices, encode_indices
from gossip.compress.indices import (
    _ENCODERS,
    SCHEMES,
    _sizes,
    pack_bits,
    unpack_bits,
    varint_decode,
    varint_encode,
)
from gossip.compress.sparse import k_for
from gossip.errors import ProtocolError

FAST = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def random_set(n: int, k: int, seed: int, clustered: bool = False) -> np.ndarray:
    """k distinct sorted indices in [0, n): uniform, or packed into a few runs."""
    rng = np.random.default_rng(seed)
    if clustered and k:
        starts = rng.integers(0, n, size=max(1, k // 50))
        idx = np.unique(np.clip((starts[:, None] + np.arange(50)).ravel(), 0, n - 1))[:k]
        return idx.astype(np.int64)
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def index_sets():
    @st.composite
    def build(draw):
        n = draw(st.one_of(st.integers(1, 300), st.integers(1, 3_000_000)))
        k = draw(st.one_of(st.integers(0, min(n, 5)), st.integers(0, min(n, 50_000))))
        return n, random_set(n, k, draw(st.integers(0, 2**32)), draw(st.booleans()))

    return build()


@FAST
@given(case=index_sets())
@example(case=(3_000_000, random_set(3_000_000, 50_000, 0)))
@example(case=(3_000_000, random_set(3_000_000, 50_000, 1, clustered=True)))
def test_every_scheme_round_trips(case):
    n, a = case
    deltas = np.diff(a, prepend=0)
    sizes = _sizes(a, deltas, n)
    for scheme in sizes:
        data = torch.from_numpy(np.ascontiguousarray(_ENCODERS[scheme](a, deltas, n)))
        assert data.numel() == sizes[scheme], scheme  # size formulas match the encoders
        assert np.array_equal(decode_indices(scheme, data, a.size, n).numpy(), a), scheme


@FAST
@given(case=index_sets())
def test_the_smallest_scheme_is_chosen_and_never_exceeds_log2_n_bits(case):
    n, a = case
    scheme, data = encode_indices(torch.from_numpy(a), n)
    sizes = _sizes(a, np.diff(a, prepend=0), n)
    assert data.dtype == torch.uint8 and data.numel() == min(sizes.values())
    # Sizing only what can still win picks what sizing everything does, ties included.
    assert scheme == min(sizes.items(), key=lambda item: item[1])[0]
    assert np.array_equal(decode_indices(scheme, data, a.size, n).numpy(), a)
    # Any index set: at most ceil(log2 n) bits per index plus the scheme's header byte.
    bound = 1 + math.ceil(a.size * math.ceil(math.log2(n)) / 8) if n > 1 else 1
    assert data.numel() <= bound


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(log_n=st.floats(0, 7), log_density=st.floats(-4, 0), seed=st.integers(0, 2**16),
       method=st.sampled_from(["sampled", "exact"]))
@example(log_n=7.0, log_density=-2.0, seed=0, method="sampled")  # 10M at 1 %
@example(log_n=7.0, log_density=-4.0, seed=1, method="sampled")
@example(log_n=6.0, log_density=0.0, seed=2, method="sampled")  # everything: a bitmap
@example(log_n=6.5, log_density=-0.7, seed=3, method="exact")
def test_topk_payload_bytes_are_within_the_bound(log_n, log_density, seed, method):
    n, density = max(1, int(10**log_n)), 10**log_density
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    p = create("topk", density=density, method=method).compress(x, key="w", round=seed)
    k = k_for(density, n)
    total = p.nbytes + len(msgpack.packb(dict(p.meta)))
    bound = 1.15 * (4 * k + k * math.ceil(math.log2(n)) / 8) + 64
    assert total <= bound, (n, k, p.meta, total, bound)


def test_bound_also_holds_for_threshold_and_clustered_indices():
    x = torch.zeros(1_000_000)
    x[200_000:210_000] = 1.0  # one dense run
    x[999_999] = 1.0  # and one far away
    p = create("threshold", threshold=0.5).compress(x)
    k = p.meta["k"]
    assert k == 10_001
    assert p.nbytes + len(msgpack.packb(dict(p.meta))) <= 1.15 * (4 * k + k * 20 / 8) + 64


@pytest.mark.parametrize("width", [0, 1, 5, 8, 13, 31, 40, 57, 58, 63])
def test_bit_packing_round_trips_every_width(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, 2**width if width else 1, size=1001, dtype=np.uint64)
    data = pack_bits(values, width)
    assert data.size == (1001 * width + 7) // 8
    assert np.array_equal(unpack_bits(data, width, 1001), values)


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 1001])
def test_narrow_packing_lays_out_the_bits_one_by_one(width, count):
    """Widths up to 8 are packed by shifts within a word; the oracle spells every value out
    bit by bit, LSB first (bits above ``width`` are dropped)."""
    rng = np.random.default_rng(width * 1000 + count)
    values = rng.integers(0, 2**12, size=count, dtype=np.int64)
    bits = [(int(v) >> b) & 1 for v in values for b in range(width)]
    expected = np.packbits(np.array(bits, dtype=np.uint8), bitorder="little")
    assert np.array_equal(pack_bits(values, width), expected)
    data = rng.integers(0, 256, size=(count * width + 7) // 8, dtype=np.uint8)  # any bytes
    bits = np.unpackbits(data, bitorder="little")
    read = [sum(int(bits[i * width + b]) << b for b in range(width)) for i in range(count)]
    assert unpack_bits(data, width, count).tolist() == read


def test_varints_round_trip_and_report_their_length():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**40, 2**63 - 1], dtype=np.uint64)
    data = np.concatenate([varint_encode(values), np.array([7], np.uint8)])
    decoded, used = varint_decode(data, values.size)
    assert np.array_equal(decoded, values) and used == data.size - 1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_truncated_data_is_rejected(scheme):
    a = random_set(100_000, 1000, 1)
    data = torch.from_numpy(np.ascontiguousarray(_ENCODERS[scheme](a, np.diff(a, prepend=0),
                                                                   100_000)))
    for cut in (1, 2, data.numel() // 2, data.numel()):
        with pytest.raises(ProtocolError):
            decode_indices(scheme, data[:data.numel() - cut], 1000, 100_000)


@settings(max_examples=200, deadline=None, database=None)
@given(scheme=st.sampled_from(SCHEMES), blob=st.binary(max_size=64), k=st.integers(0, 40),
       n=st.integers(0, 2**20))
def test_garbage_decodes_to_a_valid_set_or_protocol_error(scheme, blob, k, n):
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(
        0, dtype=torch.uint8)
    try:
        idx = decode_indices(scheme, data, k, n)
    except ProtocolError:
        return
    assert idx.numel() == k and idx.dtype == torch.int64
    if k:
        assert 0 <= int(idx.min()) and int(idx.max()) < n
        assert bool((idx[1:] > idx[:-1]).all())


@pytest.mark.parametrize("scheme, data, k, n, words", [
    ("zip", b"", 0, 10, "unknown index scheme 'zip'; known: ef, bits"),
    ("raw", b"\x05\x00\x00\x00\x03\x00\x00\x00", 2, 10, "not sorted"),
    ("raw", b"\x05\x00\x00\x00\x05\x00\x00\x00", 2, 10, "duplicate index 5"),
    ("raw", b"\x0a\x00\x00\x00", 1, 10, "index 10 out of range"),
    ("bitmap", b"\x00\x04", 1, 10, "index 10 out of range"),
    ("bitmap", b"\x03\x00", 1, 10, "holds 2 indices, meta says k=1"),
    ("bits", b"\x40", 0, 10, "width 64 > 63"),
    ("bits", b"\x04\x00", 2, 10, "duplicate index 0"),
    ("varint", b"\x81\x82", 1, 10, "varint data truncated"),
    ("varint", b"\x01\x01", 1, 10, "trailing bytes"),
    ("block", b"\x02\x01\x00\x01\x00", 2, 10, "offset bytes|index"),
    ("ef", b"", 0, 10, "empty"),
    ("raw", b"", 11, 10, "k=11 not in \\[0, n=10\\]"),
])
def test_specific_faults_are_named(scheme, data, k, n, words):
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(
        0, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match=words):
        decode_indices(scheme, tensor, k, n)


def test_index_data_must_be_uint8():
    with pytest.raises(ProtocolError, match="uint8"):
        decode_indices("raw", torch.zeros(4, dtype=torch.int32), 4, 10)


def test_encoder_rejects_unsorted_input():
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_indices(torch.tensor([3, 1]), 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_indices(torch.tensor([3, 10]), 10)
