"""Wrappers: error-feedback mass conservation, DGC momentum correction and masking against a
float64 oracle, clipping, the warm-up schedule, and build()'s composition and its errors."""

from __future__ import annotations

import pytest
import torch

from gossip.compress import (
    Clip,
    DensityWarmup,
    ErrorFeedback,
    MomentumCorrection,
    Payload,
    build,
    create,
)
from gossip.compress.sparse import k_for
from gossip.errors import ConfigError
from gossip.transport import Message, codec

INNER = [("topk", {"density": 0.05}), ("randomk", {"density": 0.05}), ("qsgd", {"levels": 4}),
         ("sign", {}), ("terngrad", {}), ("fp16", {}), ("none", {}),
         ("threshold", {"threshold": 1.0})]


def gaussian(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("name, options", INNER)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_feedback_conserves_mass(name, options, dtype):
    ef = ErrorFeedback(create(name, **options))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    sent_total = torch.zeros(500, dtype=torch.float64)
    input_total = torch.zeros(500, dtype=torch.float64)
    for round in range(6):
        x = gaussian(500, round, dtype).reshape(20, 25)
        before = ef.residual("w")
        corrected = x.reshape(-1) + (before if before is not None else 0)
        p = ef.compress(x, key="w", round=round)
        sent = ef.decompress(p)
        assert sent.shape == (20, 25)
        # c == decompress(sent) + new residual, every round
        assert torch.allclose(sent.reshape(-1) + ef.residual("w"), corrected, **tol)
        sent_total += sent.reshape(-1).double()
        input_total += x.reshape(-1).double()
    # Nothing lost over rounds: all sent + what is still owed == all given.
    assert torch.allclose(sent_total + ef.residual("w").double(), input_total,
                          rtol=1e-4, atol=1e-4)


def test_error_feedback_keeps_residuals_per_key_and_checkpoints_them():
    ef = ErrorFeedback(create("topk", density=0.1))
    ef.compress(gaussian(100, 1), key="a")
    ef.compress(gaussian(50, 2), key="b")
    assert ef.residual("a").numel() == 100 and ef.residual("b").numel() == 50
    assert ef.residual("c") is None
    state = ef.state_dict()
    other = ErrorFeedback(create("topk", density=0.1))
    other.load_state_dict(state)
    x = gaussian(100, 3)
    assert torch.equal(ef.decompress(ef.compress(x, key="a")),
                       other.decompress(other.compress(x, key="a")))
    with pytest.raises(ConfigError, match="key 'a' was compressed before as 100"):
        ef.compress(gaussian(99, 4), key="a")


def test_error_feedback_over_identity_does_not_corrupt_the_aliased_payload():
    ef = ErrorFeedback(create("none"))
    x = gaussian(10, 0)
    p = ef.compress(x)
    assert torch.equal(ef.decompress(p), x)
    assert torch.equal(ef.residual(), torch.zeros(10, dtype=torch.float64))


def test_error_feedback_with_topk_converges_on_a_constant_input():
    ef = ErrorFeedback(create("topk", density=0.01))
    x = gaussian(1000, 5)
    sent = torch.zeros(1000, dtype=torch.float64)
    errors = {}
    for round in range(400):
        sent += ef.decompress(ef.compress(x, key="g", round=round))
        errors[round + 1] = float((sent / (round + 1) - x).abs().max())
    # The residual stays bounded (by d/k · max|x|), so the time-average of what was sent
    # approaches x like 1/T.
    assert float(ef.residual("g").abs().max()) <= 100 * float(x.abs().max())
    assert errors[400] < 0.5 * errors[100]


def dgc_oracle(grads: list[torch.Tensor], momentum: float, density: float):
    """Float64 re-implementation of DGC (momentum correction + factor masking), top-k."""
    u = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        u = momentum * u + g
        v = v + u
        k = k_for(density, v.numel())
        idx = torch.topk(v.abs(), k).indices
        out = torch.zeros_like(v)
        out[idx] = v[idx]
        sent.append(out)
        u[idx] = 0
        v[idx] = 0
    return sent, u, v


def test_momentum_correction_matches_the_dgc_oracle():
    grads = [gaussian(400, seed) for seed in range(8)]
    mc = MomentumCorrection(create("topk", density=0.05, values="same"), momentum=0.9)
    expected, u, v = dgc_oracle(grads, 0.9, 0.05)
    for round, (g, want) in enumerate(zip(grads, expected)):
        got = mc.decompress(mc.compress(g, key="p", round=round))
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(mc.momentum_buffer("p"), u) and torch.allclose(mc.velocity("p"), v)


def test_momentum_correction_masks_sent_coordinates():
    mc = MomentumCorrection(create("topk", density=0.1), momentum=0.5)
    for round in range(3):
        p = mc.compress(gaussian(200, round), key="w", round=round)
        idx = mc.unpack(p).indices
        assert bool((mc.momentum_buffer("w")[idx] == 0).all())
        assert bool((mc.velocity("w")[idx] == 0).all())
        rest = torch.ones(200, dtype=torch.bool)
        rest[idx] = False
        assert bool((mc.velocity("w")[rest] != 0).all())


def test_momentum_correction_with_a_dense_compressor():
    mc = MomentumCorrection(create("qsgd", levels=2), momentum=0.9)
    g0, g1 = gaussian(300, 0), gaussian(300, 1)
    sent0 = mc.decompress(mc.compress(g0, key="w", round=0))
    assert torch.allclose(mc.velocity("w"), g0 - sent0)
    assert bool((mc.momentum_buffer("w")[sent0 != 0] == 0).all())
    u_expected = torch.where(sent0 != 0, 0.0, g0) * 0.9 + g1
    v_expected = g0 - sent0 + u_expected
    sent1 = mc.decompress(mc.compress(g1, key="w", round=1))
    assert torch.allclose(mc.velocity("w"), v_expected - sent1)
    assert torch.allclose(mc.momentum_buffer("w"), torch.where(sent1 != 0, 0.0, u_expected))


def test_momentum_state_round_trips():
    mc = MomentumCorrection(create("topk", density=0.1))
    mc.compress(gaussian(100, 0), key="a")
    other = MomentumCorrection(create("topk", density=0.1))
    other.load_state_dict(mc.state_dict())
    x = gaussian(100, 1)
    assert torch.equal(mc.decompress(mc.compress(x, key="a")),
                       other.decompress(other.compress(x, key="a")))


def test_clip_scales_down_only_above_max_norm():
    clip = Clip(create("none"), max_norm=2.0)
    big = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert torch.allclose(clip.decompress(clip.compress(big)),
                          torch.tensor([1.2, 1.6], dtype=torch.float64))
    small = torch.tensor([0.3, 0.4], dtype=torch.float64)
    assert torch.equal(clip.decompress(clip.compress(small)), small)


def test_density_warmup_follows_the_dgc_schedule():
    target = 0.25**5  # DGC: 0.25, 0.0625, 0.015625, 0.0039 then 0.001
    warm = DensityWarmup(create("topk", density=target), rounds=4, start=0.25)
    want = [0.25, 0.0625, 0.015625, 0.00390625, target, target]
    assert [warm.density_at(r) for r in range(6)] == pytest.approx(want)
    x = gaussian(100_000, 0, torch.float32)
    for round, density in enumerate(want):
        p = warm.compress(x, key="w", round=round)
        assert p.meta["k"] == k_for(density, 100_000)
        # Receivers decode with the plain, un-warmed compressor.
        assert torch.equal(create("topk").decompress(p), warm.decompress(p))


def test_build_composes_in_order_and_payloads_need_only_the_inner_compressor():
    c = build("topk", density=0.01, error_feedback=True, clip_norm=10.0, warmup_rounds=3)
    assert isinstance(c, Clip) and isinstance(c.inner, ErrorFeedback)
    assert isinstance(c.inner.inner, DensityWarmup) and c.inner.inner.inner.density == 0.01
    assert c.sparse and c.name == "topk"
    x = gaussian(10_000, 0, torch.float32)
    p = c.compress(x, key="g", round=0)
    header, frames = codec.encode(Message("gossip", 0, meta=p.meta, buffers=p.buffers), 0)
    msg = codec.decode([header] + [bytearray(f.numpy().tobytes()) for f in frames])
    assert torch.equal(create("topk").decompress(Payload(msg.meta, msg.buffers)),
                       c.decompress(p))
    mc = build("topk", momentum=0.9)
    assert isinstance(mc, MomentumCorrection) and mc.momentum == 0.9
    assert type(build("qsgd", levels=8)).__name__ == "QSGD"


@pytest.mark.parametrize("kwargs, words", [
    ({"name": "qsgd", "warmup_rounds": 3}, "density warm-up needs a compressor with a density"),
    ({"name": "topk", "momentum": 0.9, "error_feedback": True}, "do not combine it with error_feedback"),
    ({"name": "topk", "warmup_start": 0.5}, "warmup_start needs warmup_rounds > 0"),
    ({"name": "topk", "density": 0.5, "warmup_rounds": 2, "warmup_start": 0.1}, "below the target"),
    ({"name": "topk", "warmup_rounds": -1}, "warm-up rounds must be an int >= 0"),
    ({"name": "topk", "momentum": 1.0}, "momentum must be a number in \\[0, 1\\)"),
    ({"name": "topk", "clip_norm": 0}, "clip max_norm must be a finite number > 0"),
    ({"name": "topk", "error_feedback": "yes"}, "error_feedback must be true or false"),
    ({"name": "topk", "densty": 0.1}, "no option 'densty'"),
    ({"name": "nope"}, "unknown compressor 'nope'; available: bf16, fp16, none"),
])
def test_build_rejects_nonsense(kwargs, words):
    name = kwargs.pop("name")
    with pytest.raises(ConfigError, match=words):
        build(name, **kwargs)


def test_wrappers_need_a_compressor():
    with pytest.raises(ConfigError, match="wraps a Compressor"):
        ErrorFeedback("topk")
