"""Robust aggregates of whole vectors (CenteredClip, coordinate trimmed mean and median) for
the strategies that hold every peer's vector (ps sync, topk-allgather): oracles, bounds and
the options that select them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip.errors import ConfigError
from gossip.strategies import STRATEGIES
from gossip.strategies.robust import CenteredClip, CoordinateTrim
from gossip.topology import Topology
from gossip.transport import LoopbackHub


def vectors(n: int, numel: int = 9, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(n)]


def centered_clip_oracle(xs: list[np.ndarray], tau: float, passes: int, v: np.ndarray):
    for _ in range(passes):
        steps = []
        for x in xs:
            d = x - v
            norm = np.linalg.norm(d)
            steps.append(d * min(1.0, tau / norm) if norm > 0 else d)
        v = v + np.mean(steps, axis=0)
    return v


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("tau,passes", [(0.5, 1), (1.0, 3), (0.1, 20)])
def test_centered_clip_matches_the_oracle_from_the_last_aggregate(n, tau, passes):
    xs, last = vectors(n, seed=n), vectors(1, seed=99)[0]
    got, flagged = CenteredClip(tau, passes, "last").aggregate(xs, last)
    want = centered_clip_oracle([x.numpy() for x in xs], tau, passes, last.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    assert flagged == 0
    assert torch.equal(last, vectors(1, seed=99)[0])  # a pure function: inputs untouched


@pytest.mark.parametrize("n", [3, 5])
def test_centered_clip_starts_from_the_median_at_first_or_when_told(n):
    xs = vectors(n, seed=3)
    median = np.median(np.stack([x.numpy() for x in xs]), axis=0)
    for last, start in ((None, "last"), (vectors(1, seed=5)[0], "median")):
        got, _ = CenteredClip(0.3, 2, start).aggregate(xs, last)
        want = centered_clip_oracle([x.numpy() for x in xs], 0.3, 2, median)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_an_infinite_radius_gives_the_mean_in_one_pass(n):
    xs = vectors(n, seed=n)
    got, _ = CenteredClip(math.inf, 1, "last").aggregate(xs, vectors(1, seed=1)[0] * 100)
    torch.testing.assert_close(got, torch.stack(xs).mean(dim=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("passes", [1, 4])
def test_one_wild_vector_moves_the_aggregate_at_most_tau_over_n_per_pass(n, passes):
    """Honest vectors all at the start (no difference): only the wild one pulls, by at
    most tau / n per pass, straight toward it."""
    tau, start = 0.7, torch.ones(9, dtype=torch.float64)
    wild = torch.full((9,), 1e30, dtype=torch.float64)
    got, _ = CenteredClip(tau, passes, "last").aggregate([start.clone()] * (n - 1) + [wild],
                                                          start)
    moved = float(torch.linalg.vector_norm(got - start))
    assert moved <= passes * tau / n * (1 + 1e-12)
    assert moved >= tau / n * (1 - 1e-12)  # it did move, toward the wild one
    assert bool((got >= start).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_vectors_are_flagged_and_left_out(bad):
    xs = vectors(5, seed=2)
    poisoned = xs[:4] + [torch.full((9,), bad, dtype=torch.float64)]
    for rule in (CenteredClip(math.inf, 1, "last"), CoordinateTrim(1), CoordinateTrim(None)):
        got, flagged = rule.aggregate(poisoned, None)
        want, _ = rule.aggregate(xs[:4], None)
        assert flagged == 1 and torch.equal(got, want)


def test_a_difference_that_overflows_counts_as_zero():
    start = torch.zeros(3)
    got, flagged = CenteredClip(1.0, 1, "last").aggregate(
        [start.clone(), torch.full((3,), -3e38), torch.full((3,), 3e38)], start)
    assert flagged == 0 and bool(torch.isfinite(got).all())


def test_nothing_finite_keeps_the_last_aggregate_or_zeros():
    nan = [torch.full((4,), math.nan)] * 3
    last = torch.arange(4.0)
    assert torch.equal(CenteredClip(1.0, 1, "last").aggregate(nan, last)[0], last)
    assert torch.equal(CoordinateTrim(None).aggregate(nan, None)[0], torch.zeros(4))


@pytest.mark.parametrize("n,trim", [(3, 1), (5, 1), (5, 2), (7, 2)])
def test_coordinate_trimmed_mean_and_median_match_numpy(n, trim):
    xs = vectors(n, seed=n + trim)
    stack = np.sort(np.stack([x.numpy() for x in xs]), axis=0)
    got, _ = CoordinateTrim(trim).aggregate(xs, None)
    np.testing.assert_allclose(got.numpy(), stack[trim:n - trim].mean(axis=0), rtol=1e-12)
    got, _ = CoordinateTrim(None).aggregate(xs, None)
    np.testing.assert_allclose(got.numpy(), np.median(stack, axis=0), rtol=1e-12)


def capabilities(name: str, options: dict) -> dict:
    parsed = STRATEGIES.options(name, options)
    return STRATEGIES.strategy_class(name, parsed).capabilities_for(parsed)


@pytest.mark.parametrize("name,options", [("ps", {}), ("ps", {"backup": 1}),
                                          ("topk-allgather", {"density": 0.5})])
def test_a_robust_aggregate_is_not_the_exact_mean_and_takes_non_finite_input(name, options):
    plain = capabilities(name, options)
    assert STRATEGIES.options(name, options).gathered() is None
    for rule in ({"robust": "centered-clip", "tau": 1.0}, {"robust": "median"},
                 {"robust": "trimmed-mean", "trim": 1}):
        robust = capabilities(name, {**options, **rule})
        # nor survives a death (elastic): its next round starts from the last aggregate
        assert robust == {**plain, "exact_mean": False, "preserves_mean": False,
                          "checks_own_result": True, "survives_death": False}


@pytest.mark.parametrize("options,fault", [
    ({"robust": "centered-clip"}, "^robust=centered-clip needs tau"),
    ({"robust": "trimmed-mean"}, "^robust=trimmed-mean needs trim"),
    ({"robust": "median", "tau": 1.0}, "^tau is an option of robust=centered-clip, not of "
                                       "robust=median$"),
    ({"passes": 2}, "^passes is an option of robust=centered-clip, not of robust=none$"),
    ({"robust": "clip", "tau": 1.0}, "^robust must be one of centered-clip, trimmed-mean, "
                                     "median"),
    ({"robust": "centered-clip", "tau": 0.0}, "^tau must be positive"),
    ({"robust": "centered-clip", "tau": 1.0, "start": "mean"}, "^start must be one of"),
])
@pytest.mark.parametrize("name", ["ps", "topk-allgather"])
def test_what_cannot_work_is_one_line_naming_it(name, options, fault):
    with pytest.raises(ConfigError, match=fault):
        STRATEGIES.options(name, options)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_ps_has_no_step_to_aggregate(mode):
    with pytest.raises(ConfigError, match=f"^robust=median: .* not mode {mode}$"):
        STRATEGIES.options("ps", {"mode": mode, "robust": "median"})


@pytest.mark.parametrize("name,options", [
    ("ps", {"robust": "centered-clip", "tau": 1.0}),
    ("topk-allgather", {"robust": "centered-clip", "tau": 1.0, "density": 1.0})])
def test_the_last_aggregate_is_checkpointed(name, options):
    """Centered-clip's start survives a restart: state_dict carries it, load_state_dict
    puts it back (on a ps server, per shard)."""
    topology = Topology.generate("complete", 2, host="127.0.0.1")
    hub = LoopbackHub(2)

    def make():
        transport = hub.transport(0)
        return STRATEGIES.create(name, rank=0, topology=topology, transport=transport,
                                 options=options)

    first = make()
    aggregate = torch.arange(5.0)
    if name == "ps":
        first.server.last_aggregate = aggregate
    else:
        first.last_aggregate = aggregate
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    got = second.server.last_aggregate if name == "ps" else second.last_aggregate
    assert torch.equal(got, aggregate)
