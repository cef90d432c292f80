"""The robust aggregators (gossip/strategies/robust.py) against numpy oracles, at odd
neighbourhood sizes, and the invariants of shared/specs/robust.md section 4."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip.errors import ConfigError
from gossip.strategies import STRATEGIES
from gossip.strategies.robust import Clip, TrimmedMean


def neighbourhood(degree: int, numel: int = 7, seed: int = 0):
    """Own model, the neighbours' (float64) and Metropolis-like weights summing to one."""
    rng = np.random.default_rng(seed)
    own = rng.normal(size=numel)
    others = [own + rng.normal(scale=1 + j, size=numel) for j in range(degree)]
    weights = list(rng.uniform(0.5, 1.0, size=degree) / (degree + 1))
    return own, others, weights, 1.0 - sum(weights)


def run(aggregator, own, others, weights, self_weight):
    out = torch.empty(len(own), dtype=torch.float64)
    mixed = aggregator.mix(torch.tensor(own), [torch.tensor(x) for x in others], weights,
                           self_weight, out=out)
    return out.numpy(), mixed


def clip_oracle(own, others, weights, tau):
    step = np.zeros_like(own)
    for x, w in zip(others, weights):
        d = x - own
        step += w * d * min(1.0, tau / np.linalg.norm(d))
    return own + step


@pytest.mark.parametrize("degree", [1, 3, 5, 7])
@pytest.mark.parametrize("tau", [0.3, 2.0, 5.0])
def test_clip_fixed_radius_matches_the_oracle(degree, tau):
    own, others, weights, self_weight = neighbourhood(degree, seed=degree)
    got, mixed = run(Clip(tau=tau), own, others, weights, self_weight)
    np.testing.assert_allclose(got, clip_oracle(own, others, weights, tau), rtol=1e-12,
                               atol=1e-12)
    clipped = sum(np.linalg.norm(x - own) > tau for x in others)
    assert mixed.share == clipped / degree and mixed.flagged == 0


@pytest.mark.parametrize("degree", [3, 5, 7])
def test_second_largest_rule_clips_only_the_farthest(degree):
    own, others, weights, self_weight = neighbourhood(degree, seed=10 + degree)
    distances = sorted(np.linalg.norm(x - own) for x in others)
    got, mixed = run(Clip(rule="second"), own, others, weights, self_weight)
    np.testing.assert_allclose(got, clip_oracle(own, others, weights, distances[-2]),
                               rtol=1e-12, atol=1e-12)
    assert mixed.share == 1 / degree


@pytest.mark.parametrize("degree", [3, 5, 7])
def test_delta_rule_clips_the_farthest_holding_that_weight(degree):
    own, others, weights, self_weight = neighbourhood(degree, seed=20 + degree)
    order = sorted(range(degree), key=lambda j: -np.linalg.norm(others[j] - own))
    delta = weights[order[0]] + weights[order[1]] + 1e-9  # the two farthest
    tau = np.linalg.norm(others[order[2]] - own)
    got, mixed = run(Clip(rule="delta", delta=delta), own, others, weights, self_weight)
    np.testing.assert_allclose(got, clip_oracle(own, others, weights, tau), rtol=1e-12,
                               atol=1e-12)
    assert mixed.share == 2 / degree


# Odd neighbourhoods, with and without the peer itself, each with a value left after trimming.
@pytest.mark.parametrize("degree, trim", [(2, 1), (3, 1), (4, 1), (4, 2), (5, 2), (6, 1),
                                          (6, 2), (6, 3)])
def test_trimmed_mean_matches_the_oracle(degree, trim):
    own, others, weights, self_weight = neighbourhood(degree, seed=30 + degree)
    got, mixed = run(TrimmedMean(trim), own, others, weights, self_weight)
    values = np.sort(np.stack([own, *others]), axis=0)
    np.testing.assert_allclose(got, values[trim:degree + 1 - trim].mean(axis=0), rtol=1e-12)
    # The share of neighbours' values dropped: 2 trim per coordinate, less our own.
    ranks = np.argsort(np.stack([own, *others]), axis=0, kind="stable")
    dropped = np.concatenate([ranks[:trim], ranks[degree + 1 - trim:]])
    assert mixed.share == pytest.approx((dropped != 0).sum() / (degree * len(own)))


@pytest.mark.parametrize("degree", [1, 2, 3, 4, 6])
def test_median_matches_numpy(degree):
    own, others, weights, self_weight = neighbourhood(degree, seed=40 + degree)
    got, _ = run(TrimmedMean(None), own, others, weights, self_weight)
    np.testing.assert_allclose(got, np.median(np.stack([own, *others]), axis=0), rtol=1e-12)


@pytest.mark.parametrize("degree", [1, 3, 5])
def test_a_large_radius_is_the_weighted_mean_bit_for_bit(degree):
    own, others, weights, self_weight = neighbourhood(degree, seed=50 + degree)
    got, mixed = run(Clip(tau=math.inf), own, others, weights, self_weight)
    plain = torch.tensor(own) * self_weight
    for x, w in zip(others, weights):
        plain.add_(torch.tensor(x), alpha=w)
    assert np.array_equal(got, plain.numpy()) and mixed.share == 0


@pytest.mark.parametrize("payload", [math.nan, math.inf, -math.inf, 1e38, -1e38])
@pytest.mark.parametrize("rule", [{"tau": 0.5}, {"rule": "second"}])
def test_any_payload_moves_the_model_at_most_the_clipped_weight_times_tau(payload, rule):
    """Every neighbour lies (float32, as models are sent): ||dx|| <= (1 - w_ii) tau."""
    degree = 5
    own, others, weights, self_weight = neighbourhood(degree, seed=60)
    own32 = torch.tensor(own, dtype=torch.float32)
    lies = [torch.full_like(own32, payload) for _ in range(degree - 1)]
    lies.append(torch.tensor(others[0], dtype=torch.float32))  # one honest among them
    aggregator = Clip(**rule)
    out = torch.empty_like(own32)
    mixed = aggregator.mix(own32, lies, weights, self_weight, out=out)
    assert torch.isfinite(out).all()
    finite = [float(torch.linalg.vector_norm(x.double() - own32.double())) for x in lies]
    tau = aggregator.radius([d if math.isfinite(d) else math.inf for d in finite], weights)
    moved = float(torch.linalg.vector_norm(out.double() - own32.double()))
    assert moved <= (1 - self_weight) * tau * (1 + 1e-5) + 1e-6
    assert mixed.flagged == (0 if math.isfinite(payload) else degree - 1)


@pytest.mark.parametrize("trim", [1, 2])
def test_trimmed_mean_with_enough_trim_stays_in_the_honest_range(trim):
    degree = 6
    own, others, weights, self_weight = neighbourhood(degree, seed=70)
    liars = trim
    honest = np.stack([own, *others[liars:]])
    for payload in (1e30, -1e30, math.nan, math.inf):
        attacked = [np.full_like(own, payload)] * liars + others[liars:]
        got, mixed = run(TrimmedMean(trim), own, attacked, weights, self_weight)
        assert (honest.min(axis=0) <= got).all() and (got <= honest.max(axis=0)).all()
        assert mixed.flagged == (0 if math.isfinite(payload) else liars)


def test_a_common_radius_on_a_symmetric_mix_keeps_the_mean():
    """Five peers on a ring, Metropolis weights 1/3: each clips pair differences alike."""
    rng = np.random.default_rng(80)
    xs = [rng.normal(scale=3, size=9) for _ in range(5)]
    outs = []
    for i in range(5):
        left, right = xs[(i - 1) % 5], xs[(i + 1) % 5]
        got, _ = run(Clip(tau=1.0), xs[i], [left, right], [1 / 3, 1 / 3], 1 / 3)
        outs.append(got)
    np.testing.assert_allclose(np.mean(outs, axis=0), np.mean(xs, axis=0), atol=1e-12)


def test_too_small_a_neighbourhood_to_trim_names_the_rank():
    with pytest.raises(ConfigError, match="rank 2 mixes 3 models"):
        TrimmedMean(2).check([(0, 4), (1, 4), (2, 2)])
    TrimmedMean(2).check([(0, 4)])
    TrimmedMean(None).check([(0, 0)])  # the median of one is itself


@pytest.mark.parametrize("options, capability", [
    ({}, True), ({"robust": "clip", "tau": 1.0}, True),
    ({"robust": "clip", "tau_rule": "second"}, False),
    ({"robust": "clip", "tau_rule": "delta", "delta": 0.2}, False),
    ({"robust": "trimmed-mean", "trim": 1}, False), ({"robust": "median"}, False)])
@pytest.mark.parametrize("name", ["dpsgd", "matcha"])
def test_capabilities_follow_the_rule(name, options, capability):
    if name == "matcha" and options.get("robust", "clip") != "clip":
        with pytest.raises(ConfigError, match="use robust=clip"):
            STRATEGIES.options(name, options)
        return
    parsed = STRATEGIES.options(name, options)
    held = STRATEGIES.strategy_class(name, parsed).capabilities_for(parsed)
    assert held["preserves_mean"] is capability
    assert held["checks_own_result"] is bool(options)  # it leaves non-finite models out


@pytest.mark.parametrize("options, fault", [
    ({"tau": 1.0}, "tau"), ({"robust": "clip"}, "either tau"),
    ({"robust": "clip", "tau": 1.0, "tau_rule": "second"}, "either tau"),
    ({"robust": "median", "trim": 1}, "trim"), ({"robust": "trimmed-mean"}, "needs trim"),
    ({"robust": "clip", "tau_rule": "delta"}, "delta"),
    ({"robust": "clip", "tau": 1.0, "staleness": 1}, "staleness"),
    ({"robust": "krum"}, "robust must be one of"), ({"robust": "clip", "tau": 0}, "tau")])
def test_what_cannot_work_is_one_line_naming_it(options, fault):
    with pytest.raises(ConfigError, match=fault) as info:
        STRATEGIES.options("dpsgd", options)
    assert "\n" not in str(info.value)


def test_matcha_with_a_compressor_is_not_mixed_robustly():
    with pytest.raises(ConfigError, match="robust=clip: with a compressor"):
        STRATEGIES.options("matcha", {"robust": "clip", "tau": 1.0, "compressor": "topk"})
