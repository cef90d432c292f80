"""Compressors: exact k, round trips through the wire codec for every compressor, dtype and
length, unbiasedness of the stochastic quantizers (checked against their own variance),
rejection of malformed payloads, and configuration errors that list the alternatives."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossip import compress
from gossip.compress import Payload, create
from gossip.compress.randomk import random_subset
from gossip.compress.selection import topk_indices
from gossip.compress.sparse import k_for
from gossip.errors import ConfigError, ProtocolError
from gossip.transport import Message, codec

FAST = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
NAMES = ["none", "fp16", "bf16", "topk", "randomk", "threshold", "qsgd", "terngrad", "sign"]
DTYPES = [torch.float32, torch.float64]


def over_wire(p: Payload) -> Payload:
    """``p`` after codec.encode/decode, as a receiving strategy rebuilds it."""
    header, frames = codec.encode(Message("gossip", 7, meta=p.meta, buffers=p.buffers), 2)
    msg = codec.decode([header] + [bytearray(f.numpy().tobytes()) for f in frames])
    return Payload(msg.meta, msg.buffers)


def gaussian(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------- registry


def test_every_compressor_is_registered():
    assert set(NAMES) <= set(compress.COMPRESSORS.names())


def test_unknown_compressor_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown compressor 'topkk'.*qsgd.*topk"):
        create("topkk")


def test_unknown_option_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="no option 'densty'; options: density, method"):
        create("topk", densty=0.1)
    with pytest.raises(ConfigError, match="'sign' has no option 'levels'; options: none"):
        create("sign", levels=3)


@pytest.mark.parametrize("name, options, words", [
    ("topk", {"density": 0.0}, "density must be a number in \\(0, 1\\]"),
    ("topk", {"density": 1.5}, "density"),
    ("topk", {"density": "0.1"}, "density"),
    ("topk", {"method": "fast"}, "method must be one of 'sampled', 'exact'"),
    ("topk", {"values": "fp8"}, "values must be one of 'fp32', 'fp16', 'bf16', 'same'"),
    ("randomk", {"density": -1}, "density"),
    ("randomk", {"scale": "yes"}, "scale must be true or false"),
    ("randomk", {"seed": 1.5}, "seed must be an int"),
    ("threshold", {"threshold": -1.0}, "threshold must be a finite number >= 0"),
    ("qsgd", {"levels": 0}, "levels must be an int in \\[1, 32767\\]"),
    ("qsgd", {"levels": 2.5}, "levels"),
    ("qsgd", {"bucket": -1}, "bucket must be an int >= 1"),
    ("qsgd", {"bucket": 1.5}, "bucket must be an int >= 1"),
])
def test_invalid_option_values_are_named(name, options, words):
    with pytest.raises(ConfigError, match=words):
        create(name, **options)


def test_flags_and_quality():
    assert create("topk").sparse and create("randomk").sparse and create("threshold").sparse
    assert not create("qsgd").sparse
    assert create("qsgd").unbiased and create("terngrad").unbiased
    assert not create("topk").unbiased and not create("randomk").unbiased
    assert create("randomk", scale=True).unbiased
    assert create("topk", density=0.01).quality(1000) == pytest.approx(0.01)
    assert create("randomk", density=0.1).quality(1000) == pytest.approx(0.1)
    # choco.md: QSGD rescaled by 1/τ, τ = 1 + min(d/s², √d/s)
    # with d the bucket size (512 by default, at most the length)
    assert create("qsgd", levels=16, bucket=0).quality(2000) == pytest.approx(
        1 / (1 + min(2000 / 256, math.sqrt(2000) / 16)))
    assert create("qsgd", levels=16).quality(2000) == pytest.approx(
        1 / (1 + min(512 / 256, math.sqrt(512) / 16)))
    assert create("qsgd", levels=16).quality(100) == pytest.approx(
        1 / (1 + min(100 / 256, math.sqrt(100) / 16)))
    assert create("fp16").quality(10) == pytest.approx(1.0, abs=1e-6)
    for name in NAMES:
        omega = create(name).quality(1000)
        assert 0 < omega <= 1, name
        assert 0 < create(name).quality(0) <= 1


def test_sign_quality_is_a_lower_bound_of_the_measured_one():
    x = gaussian(1000, torch.float64)
    c = create("sign")
    err = (c.decompress(c.compress(x)) - x).square().sum() / x.square().sum()
    assert 1 - err >= c.quality(1000)


# ------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("density, n, k", [(0.01, 300, 3), (0.01, 100, 1), (0.01, 1, 1),
                                           (0.1, 7, 1), (0.5, 7, 4), (1.0, 5, 5), (1e-4, 10, 1),
                                           (0.3, 0, 0)])
def test_k_is_max_one_ceil_density_n(density, n, k):
    assert k_for(density, n) == k


@FAST
@given(n=st.integers(1, 20_000), density=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16),
       method=st.sampled_from(["exact", "sampled"]))
def test_topk_keeps_exactly_k_largest(n, density, seed, method):
    x = gaussian(n, seed=seed)
    c = create("topk", density=density, method=method)
    sparse = c.unpack(c.compress(x, key="w", round=seed))
    k = k_for(density, n)
    assert sparse.indices.numel() == k == sparse.values.numel()
    expected = torch.topk(x.abs(), k).indices
    assert set(sparse.indices.tolist()) == set(expected.tolist())
    assert torch.equal(sparse.values, x[sparse.indices])


@FAST
@given(n=st.integers(4_000, 60_000), density=st.floats(1e-3, 0.25), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_sampled_selection_is_the_exact_topk(n, density, seed, dtype):
    # A small sample forces the sampled path (threshold, candidates, exact among them).
    x = gaussian(n, seed=seed).to(dtype)
    k = k_for(density, n)
    got = topk_indices(x, k, method="sampled", sample_size=512,
                       generator=torch.Generator().manual_seed(seed))
    assert got.numel() == k
    assert bool((got[1:] > got[:-1]).all())
    kth = torch.topk(x.abs().float(), k).values[-1]
    chosen = x.abs().float()[got]
    # Ties at the k-th magnitude may be broken either way; nothing smaller may be chosen and
    # nothing larger left out.
    assert bool((chosen >= kth).all())
    assert int((x.abs().float() > kth).sum()) <= k


def test_sampled_selection_falls_back_when_the_sample_misleads(monkeypatch):
    from gossip.compress import selection

    monkeypatch.setattr(selection, "MARGIN_SIGMAS", -50.0)  # threshold far too high
    x = gaussian(50_000, seed=3)
    got = topk_indices(x, 500, sample_size=1024, generator=torch.Generator().manual_seed(0))
    assert set(got.tolist()) == set(torch.topk(x.abs(), 500).indices.tolist())


def test_topk_with_ties_still_sends_exactly_k():
    x = torch.ones(100_000)
    for method in ("exact", "sampled"):
        got = topk_indices(x, 1000, method=method, sample_size=1024)
        assert got.numel() == 1000 and got.unique().numel() == 1000


def lowest_index_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The selection rule spelled out: largest |x| first, equal magnitudes by index."""
    magnitude = x.abs().double().numpy()
    order = np.lexsort((np.arange(x.numel()), -magnitude))
    return torch.from_numpy(np.sort(order[:k]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 200, 4001, "n"])
@pytest.mark.parametrize("values", ["gaussian", "ties"])
@pytest.mark.parametrize("n", [20011, 200003])  # the latter: 20k+ candidates, partial keep-k
def test_sampled_and_exact_select_the_same_bits_ties_to_the_lowest_indices(dtype, k, values, n):
    from gossip.compress.selection import topk_select, topk_select_difference

    k = n if k == "n" else (k if n < 100_000 else 10 * k)
    gen = torch.Generator().manual_seed(k)
    if values == "ties":  # 41 magnitudes over 20k entries: every k-th has many equals
        x = (torch.randint(-20, 21, (n,), generator=gen) / 4).to(dtype)
    else:
        x = torch.randn(n, generator=gen).to(dtype)
    expected = lowest_index_topk(x, k)
    for method in ("exact", "sampled"):
        idx, chosen = topk_select(x, k, method=method, sample_size=512,
                                  generator=torch.Generator().manual_seed(1))
        assert torch.equal(idx, expected), method
        assert torch.equal(chosen, x[expected]), method
    if dtype in (torch.float32, torch.float64):  # the fused difference (x - 0 is x)
        idx, chosen = topk_select_difference(x, torch.zeros_like(x), torch.empty_like(x), k,
                                             sample_size=512)
        assert torch.equal(idx, expected) and torch.equal(chosen, x[expected])


def test_randomk_indices_are_distinct_sorted_and_seed_dependent():
    a = random_subset(1000, 100, seed=5)
    assert a.numel() == 100 and bool((a[1:] > a[:-1]).all()) and int(a.max()) < 1000
    assert torch.equal(a, random_subset(1000, 100, seed=5))
    assert not torch.equal(a, random_subset(1000, 100, seed=6))
    c = create("randomk", density=0.1, seed=1)
    p1, p2 = c.compress(gaussian(1000), key="a", round=1), c.compress(gaussian(1000), key="a",
                                                                      round=2)
    assert p1.meta["seed"] != p2.meta["seed"]
    assert len(p1.buffers) == 1  # no indices on the wire


def test_randomk_is_uniform_over_positions():
    counts = torch.zeros(50)
    trials = 2000
    for seed in range(trials):
        counts[random_subset(50, 5, seed)] += 1
    # Each position is kept with probability 0.1: binomial(2000, 0.1), sd ≈ 13.4.
    assert bool(((counts - 200).abs() < 5 * 13.4).all())


# ------------------------------------------------------------------------- round trips


def lengths():
    return st.one_of(st.sampled_from([0, 1, 2, 3, 17, 1001]), st.integers(0, 300_000))


@FAST
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), n=lengths(),
       seed=st.integers(0, 1000))
def test_round_trip_through_the_wire(name, dtype, n, seed):
    c = create(name, **({"threshold": 0.5} if name == "threshold" else {}))
    x = gaussian(n, dtype, seed)
    p = c.compress(x, key="layer", round=seed)
    assert msgpack.unpackb(msgpack.packb(dict(p.meta))) == {
        k: list(v) if isinstance(v, tuple) else v for k, v in p.meta.items()}
    assert all(b.is_contiguous() and b.device.type == "cpu" for b in p.buffers)
    local = c.decompress(p)
    received = over_wire(p)
    remote = c.decompress(received)
    assert remote.dtype == dtype and remote.shape == x.shape
    assert torch.equal(local, remote)
    out = gaussian(n, dtype, seed + 1)
    expected = out + 0.5 * remote
    assert torch.allclose(c.add_to(received, out, alpha=0.5), expected, rtol=1e-6, atol=1e-6)
    check_semantics(name, x, remote, p)


def check_semantics(name: str, x: torch.Tensor, y: torch.Tensor, p: Payload) -> None:
    """What each compressor's output must look like relative to its input."""
    if name == "none":
        assert torch.equal(x, y)
    elif name in ("fp16", "bf16"):
        cast = torch.float16 if name == "fp16" else torch.bfloat16
        assert torch.equal(y, x.to(cast).to(x.dtype))
    elif name in ("topk", "randomk", "threshold"):
        kept = y != 0
        assert torch.equal(y[kept], x[kept].float().to(x.dtype))
        if name == "threshold":
            assert bool((x[kept].abs() >= 0.5).all()) and bool((x[~kept].abs() < 0.5).all())
        else:
            assert int(p.meta["k"]) == k_for(0.01, x.numel())
    elif name == "qsgd":
        steps = (p.buffers[1].double() / p.meta["s"]).repeat_interleave(p.meta["bucket"])
        steps = steps[:y.numel()].view_as(y)
        grid = torch.where(steps > 0, y.double() / steps, y.double())
        assert torch.allclose(grid, grid.round(), atol=1e-3)
        assert bool((torch.sign(y) * torch.sign(x) >= 0).all())
    elif name == "terngrad":
        assert set(y.unique().tolist()) <= {-p.meta["scale"], 0.0, p.meta["scale"]}
    elif name == "sign":
        assert torch.allclose(y.abs(), torch.full_like(y, p.meta["scale"]))
        assert bool((torch.sign(y) == torch.where(x < 0, -1.0, 1.0).to(y.dtype)).all())


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_half_inputs_round_trip(name):
    for dtype in (torch.float16, torch.float32):
        x = gaussian(60, seed=1).to(dtype).reshape(3, 4, 5)
        c = create(name, **({"threshold": 0.5} if name == "threshold" else {}))
        y = c.decompress(over_wire(c.compress(x)))
        assert y.shape == (3, 4, 5) and y.dtype == dtype


def test_values_option_controls_the_wire_dtype():
    x = gaussian(1000, torch.float64)
    for values, dtype in [("fp32", torch.float32), ("fp16", torch.float16),
                          ("bf16", torch.bfloat16), ("same", torch.float64)]:
        p = create("topk", density=0.1, values=values).compress(x)
        assert p.buffers[0].dtype == dtype and p.meta["v"] == str(dtype).split(".")[1]


def test_randomk_scale_multiplies_by_d_over_k():
    x = gaussian(1000)
    s = create("randomk", density=0.1, scale=True).unpack(
        create("randomk", density=0.1, scale=True).compress(x, key="k"))
    assert torch.allclose(s.values, x[s.indices] * 10)


def test_compress_rejects_non_float_and_non_finite_input():
    with pytest.raises(ConfigError, match="float"):
        create("topk").compress(torch.arange(10))
    for name in ("qsgd", "terngrad", "sign"):
        with pytest.raises(ProtocolError, match="non-finite"):
            create(name).compress(torch.tensor([1.0, float("inf")]))


def test_randomness_is_reproducible_per_key_and_round():
    x = gaussian(5000)
    for name in ("qsgd", "terngrad", "randomk"):
        c = create(name, seed=3)
        a, b = c.compress(x, key="k", round=1), c.compress(x, key="k", round=1)
        assert all(torch.equal(u, v) for u, v in zip(a.buffers, b.buffers))
        other = c.compress(x, key="k", round=2)
        assert not torch.equal(c.decompress(a), c.decompress(other))


# ------------------------------------------------------------------------- unbiasedness


def assert_unbiased(samples: torch.Tensor, x: torch.Tensor, sigmas: float = 5.0) -> None:
    """Every coordinate's sample mean within ``sigmas`` standard errors of x (float64).

    The standard error comes from the samples' own variance; coordinates whose samples never
    vary must be exact.
    """
    n = samples.shape[0]
    mean, std = samples.mean(0), samples.std(0)
    stderr = std / math.sqrt(n)
    fixed = std == 0
    assert torch.allclose(mean[fixed], x[fixed], rtol=1e-6, atol=1e-9)
    z = (mean[~fixed] - x[~fixed]).abs() / stderr[~fixed]
    worst = float(z.max()) if z.numel() else 0.0
    assert worst < sigmas, f"max |z| = {worst:.2f}"


def draws(c, x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([c.decompress(c.compress(x, key="u", round=r)) for r in range(n)])


@pytest.mark.parametrize("name, options", [
    ("qsgd", {"levels": 4}),
    pytest.param("qsgd", {"levels": 1}, marks=pytest.mark.slow),
    pytest.param("terngrad", {}, marks=pytest.mark.slow),
    pytest.param("randomk", {"density": 0.25, "scale": True}, marks=pytest.mark.slow),
    ("randomk", {"density": 0.6, "scale": True}),
])
def test_stochastic_compressors_are_unbiased(name, options):
    x = gaussian(40, torch.float64, seed=11)
    samples = draws(create(name, **options), x, 1500)
    assert_unbiased(samples, x)


@pytest.mark.parametrize("name, options, bias", [
    pytest.param("qsgd", {"levels": 4}, 0.9, marks=pytest.mark.slow),
    pytest.param("terngrad", {}, 0.9, marks=pytest.mark.slow),
    ("randomk", {"density": 0.25, "scale": False}, 1.0),
])
def test_the_unbiasedness_check_can_fail(name, options, bias):
    # The same check must reject a biased estimator: a 10% shrink, or unscaled random-k.
    x = gaussian(40, torch.float64, seed=11)
    samples = draws(create(name, **options), x, 1500) * bias
    with pytest.raises(AssertionError):
        assert_unbiased(samples, x)


# -------------------------------------------------------------------- malformed payloads


def topk_payload(scheme_data: tuple[str, torch.Tensor] | None = None, **meta) -> Payload:
    """A valid top-k payload of 10 of 100 elements, optionally with other index data/meta."""
    c = create("topk", density=0.1)
    p = c.compress(gaussian(100))
    buffers = p.buffers
    new_meta = dict(p.meta)
    if scheme_data is not None:
        new_meta["ix"] = scheme_data[0]
        buffers = (buffers[0], scheme_data[1])
    new_meta.update(meta)
    return Payload({k: v for k, v in new_meta.items() if v is not None}, buffers)


def raw(indices: list[int]) -> tuple[str, torch.Tensor]:
    return "raw", torch.tensor(indices, dtype=torch.int32).view(torch.uint8)


def ten(*tail: int) -> list[int]:
    return list(range(10 - len(tail))) + list(tail)


@pytest.mark.parametrize("payload, words", [
    (lambda: topk_payload(raw(ten(100))), "index 100 out of range \\[0, 100\\)"),
    (lambda: topk_payload(raw(ten(-1))), "out of range"),
    (lambda: topk_payload(raw(ten(50, 20))), "not sorted"),
    (lambda: topk_payload(raw(ten(50, 50))), "duplicate index 50"),
    (lambda: topk_payload(raw(list(range(9)))), "raw index data has 36 bytes, k=10 needs 40"),
    (lambda: topk_payload(k=11), "values: 10 elements where 11 were expected"),
    (lambda: topk_payload(k=200), "meta 'k'=200 not in \\[0, 100\\]"),
    (lambda: topk_payload(n=5), "meta 'k'=10 not in \\[0, 5\\]"),
    (lambda: topk_payload(ix="zip"), "unknown index scheme 'zip'"),
    (lambda: topk_payload(ix=None), "missing meta key 'ix'"),
    (lambda: topk_payload(k=None), "missing meta key 'k'"),
    (lambda: topk_payload(n="100"), "meta 'n'='100' has the wrong type"),
    (lambda: topk_payload(c="topq"), "encoding 'topq' is not 'topk'"),
    (lambda: topk_payload(dt="int32"), "dtype 'int32' not one of"),
    (lambda: topk_payload(v="float8"), "values dtype 'float8'"),
    (lambda: topk_payload(v="float64"), "dtype torch.float32 where torch.float64"),
    (lambda: topk_payload(shape=[3, 7]), "shape \\[3, 7\\] does not hold n=100"),
    (lambda: Payload(topk_payload().meta, topk_payload().buffers[:1]), "expected 2 buffers"),
    (lambda: topk_payload(("bits", topk_payload().buffers[1][:-1])), "bits|bytes|width"),
])
def test_malformed_sparse_payloads_are_rejected(payload, words):
    p = payload()
    c = create("topk", density=0.1)
    for call in (c.decompress, lambda q: c.add_to(q, torch.zeros(100))):
        with pytest.raises(ProtocolError, match=words):
            call(p)


def test_truncated_index_data_of_every_scheme_is_rejected():
    from gossip.compress.indices import _ENCODERS, SCHEMES

    a = np.array([3, 17, 18, 40, 99])
    for scheme in SCHEMES:
        data = torch.from_numpy(_ENCODERS[scheme](a, np.diff(a, prepend=0), 100).copy())
        meta = dict(topk_payload().meta, k=5, ix=scheme)
        assert torch.equal(create("topk").unpack(Payload(meta, (torch.zeros(5), data))).indices,
                           torch.from_numpy(a))
        with pytest.raises(ProtocolError):
            create("topk").decompress(Payload(meta, (torch.zeros(5), data[:-1])))


def test_qsgd_scales_each_bucket_by_its_own_norm():
    """A bucket of small values next to one of large values keeps its own resolution: with
    one norm for the whole tensor the small ones would all round to 0 or to a huge step."""
    x = torch.cat([torch.full((512,), 1000.0), torch.linspace(-1e-3, 1e-3, 300)])
    q = create("qsgd", levels=16).compress(x)
    assert q.meta["bucket"] == 512 and q.buffers[1].shape == (2,)
    torch.testing.assert_close(q.buffers[1], torch.stack([x[:512].norm(), x[512:].norm()]))
    small = create("qsgd").decompress(q)[512:]
    step = float(x[512:].norm()) / 16
    assert float((small - x[512:]).abs().max()) <= step * 1.0001
    whole = create("qsgd", levels=16, bucket=0).compress(x)
    assert whole.buffers[1].shape == (1,)


def test_malformed_dense_payloads_are_rejected():
    x = gaussian(10)
    q = create("qsgd", levels=16).compress(x)
    codes, norms = q.buffers
    for bad in (17, -17, -128):
        with pytest.raises(ProtocolError, match="code exceeds the 16 levels"):
            create("qsgd").decompress(Payload(q.meta, (torch.full((10,), bad,
                                                                  dtype=torch.int8), norms)))
    nibbles = torch.full((5,), 0xFF, dtype=torch.uint8)  # code 15 - 7 = 8 > 4
    with pytest.raises(ProtocolError, match="code exceeds the 4 levels"):
        create("qsgd").decompress(Payload({**q.meta, "s": 4}, (nibbles, norms)))
    with pytest.raises(ProtocolError, match="qsgd codes"):
        create("qsgd").decompress(Payload({**q.meta, "s": 200}, q.buffers))
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ProtocolError, match="bucket norm is negative, NaN or Inf"):
            create("qsgd").decompress(Payload(q.meta, (codes, torch.tensor([bad]))))
    with pytest.raises(ProtocolError, match="qsgd norms"):  # 2 buckets of 5 need 2 norms
        create("qsgd").decompress(Payload({**q.meta, "bucket": 5}, q.buffers))
    with pytest.raises(ProtocolError, match="'bucket'"):
        create("qsgd").decompress(Payload({**q.meta, "bucket": 11}, q.buffers))
    t = create("terngrad").compress(x)
    with pytest.raises(ProtocolError, match="invalid ternary code"):
        create("terngrad").decompress(Payload(t.meta, (torch.full((3,), 255, dtype=torch.uint8),)))
    s = create("sign").compress(x)
    with pytest.raises(ProtocolError, match="2 bytes for 10 codes|for 10 codes"):
        create("sign").decompress(Payload(s.meta, (torch.zeros(1, dtype=torch.uint8),)))
    h = create("fp16").compress(x)
    with pytest.raises(ProtocolError, match="dtype torch.float32 where torch.float16"):
        create("fp16").decompress(Payload(h.meta, (x,)))
    with pytest.raises(ProtocolError, match="expected 1 buffer"):
        create("none").decompress(Payload(h.meta | {"c": "none"}, ()))
    r = create("randomk").compress(x)
    with pytest.raises(ProtocolError, match="'seed'"):
        create("randomk").decompress(Payload({**r.meta, "seed": -1}, r.buffers))
    with pytest.raises(ProtocolError, match="payload holds 10 elements but out has 11"):
        create("none").add_to(create("none").compress(x), torch.zeros(11))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1001])
def test_code_packing_round_trips(width, count):
    from gossip.compress.packing import pack_codes, packed_size, unpack_codes

    codes = torch.randint(0, 1 << width, (count,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(count))
    data = pack_codes(codes, width, fill=(1 << width) - 1)
    assert data.dtype == torch.uint8 and data.numel() == packed_size(count, width)
    assert torch.equal(unpack_codes(data, width, count), codes)
    with pytest.raises(ProtocolError, match="bytes for"):
        unpack_codes(torch.cat([data, torch.zeros(1, dtype=torch.uint8)]), width, count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("alpha", [1.0, 1 / 3, 0.1, 2.5e-3])
def test_scatter_add_rounds_as_index_add_does(dtype, alpha):
    """numpy takes float32/64 targets, index_add_ the rest: the same bits either way, with
    repeated indices added in order and values in another dtype than the target."""
    from gossip.compress.base import Header
    from gossip.compress.sparse import Sparse, scatter_add

    gen = torch.Generator().manual_seed(9)
    n = 5000
    target = (torch.randn(n, generator=gen) * torch.logspace(-3, 3, n)).to(dtype)
    idx = torch.cat([torch.randperm(n, generator=gen)[:700].sort().values,
                     torch.tensor([3, 3, 4999, 3])])  # repeated ones too
    values = (torch.randn(idx.numel(), generator=gen) * 1e3).to(torch.float16)
    expected = target.clone().index_add_(0, idx, values.to(dtype), alpha=alpha)
    got = scatter_add(Sparse(Header(n, dtype, (n,)), idx, values), target.clone(), alpha=alpha)
    assert got.numpy().tobytes() == expected.numpy().tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "wide", "descending", "zeros"])
def test_the_order_statistic_by_buckets_is_what_partition_puts_there(dtype, kind):
    from gossip.compress.selection import _order_statistic

    rng = np.random.default_rng(7)
    for size in (2, 17, 5000, 40000):
        v = rng.standard_normal(size)
        if kind == "ties":
            v = np.round(v * 4) / 4
        elif kind == "nan":
            v[rng.integers(0, size, 1 + size // 100)] = np.nan
        elif kind == "wide":
            v *= 10.0 ** rng.integers(-300, 300, size)
        elif kind == "descending":
            v = np.sort(v)[::-1].copy()
            v[0] = np.inf
        elif kind == "zeros":
            v = np.zeros(size)
            v[::3] = -0.0
        with np.errstate(over="ignore", under="ignore"):
            magnitude = np.abs(v.astype(dtype))
        for j in {0, 1, size // 2, size - size // 100 - 1, size - 1}:
            expected, got = np.partition(magnitude, j)[j], _order_statistic(magnitude, j)
            assert (np.isnan(expected) and np.isnan(got)) or (
                expected == got and got.dtype == magnitude.dtype), (size, j)
