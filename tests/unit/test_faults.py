"""Injected delays: reproducible from the seed, the configured distribution, validation."""

from __future__ import annotations

import math

import pytest
import yaml

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.faults import DelayConfig, DelayModel
from gossip.transport import Message

STRAGGLERS = DelayConfig(compute=0.01, slowdown={1: 4.0}, straggler_prob=0.2,
                         straggler_mean=0.05, send_delay={2: 0.003})


def draws(model: DelayModel, n: int = 3000) -> list[float]:
    return [model.straggler(k) for k in range(n)]


def test_delays_are_reproducible_from_the_seed():
    first = draws(STRAGGLERS.for_rank(1, seed=7))
    assert first == draws(STRAGGLERS.for_rank(1, seed=7))
    assert first != draws(STRAGGLERS.for_rank(1, seed=8))
    assert first != draws(STRAGGLERS.for_rank(0, seed=7))  # every rank has its own stream
    # A pure function of the index: asking out of order (as a non-blocking run, which stops
    # rounds early, may) gives the same delay for the same mini-batch.
    model = STRAGGLERS.for_rank(1, seed=7)
    assert [model.straggler(k) for k in reversed(range(3000))] == first[::-1]
    # The config's own seed overrides the run's.
    pinned = DelayConfig(straggler_prob=0.2, straggler_mean=0.05, seed=3)
    assert draws(pinned.for_rank(1, seed=7)) == draws(pinned.for_rank(1, seed=99))


def test_straggler_delays_follow_the_configured_distribution():
    values = draws(STRAGGLERS.for_rank(0, seed=0), 20_000)
    hits = [v for v in values if v > 0]
    assert len(hits) / len(values) == pytest.approx(0.2, abs=0.015)
    assert sum(hits) / len(hits) == pytest.approx(0.05, rel=0.06)


def test_minibatch_delay_scales_measured_and_emulated_compute():
    slow = DelayConfig(compute=0.01, slowdown={1: 4.0}).for_rank(1, seed=0)
    assert slow.minibatch_delay(0, measured=0.002) == pytest.approx(3 * 0.002 + 4 * 0.01)
    fast = DelayConfig(compute=0.01, slowdown={1: 4.0}).for_rank(0, seed=0)
    assert fast.minibatch_delay(5, measured=0.002) == pytest.approx(0.01)
    assert DelayConfig().for_rank(0, seed=0).minibatch_delay(0, measured=1.0) == 0.0
    assert not DelayConfig().active and STRAGGLERS.active


def test_send_delay_for_all_or_per_rank():
    assert DelayConfig(send_delay=0.01).for_rank(3, seed=0).send_delay == 0.01
    assert STRAGGLERS.for_rank(2, seed=0).send_delay == 0.003
    assert STRAGGLERS.for_rank(0, seed=0).send_delay == 0.0


def test_delays_are_recorded_in_the_run_config_and_round_trip(tmp_path):
    config = TrainConfig(batch_size=64, minibatches=8, delays=STRAGGLERS)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"train": config.to_dict()}))
    assert yaml.safe_load(path.read_text())["train"]["delays"]["slowdown"] == {1: 4.0}
    assert TrainConfig.from_yaml(path) == config


@pytest.mark.parametrize("delays, culprit", [
    ({"slowdown": {1: 0.5}}, "delays.slowdown: {1: 0.5} gives rank 1 0.5, which must be a "
                             "finite number >= 1"),
    ({"slowdown": {"x": 2}}, "delays.slowdown: {'x': 2} names 'x', which is not a rank"),
    ({"straggler_prob": 1.5}, "delays.straggler_prob"),
    ({"straggler_prob": 0.1}, "delays.straggler_mean: must be > 0"),
    ({"compute": -1}, "delays.compute"),
    ({"send_delay": "fast"}, "delays.send_delay: 'fast' must be a number or a mapping"),
    ({"send_delay": {0: -1}}, "delays.send_delay: {0: -1} gives rank 0 -1, which must be a "
                              "finite number >= 0"),
    ({"compute": float("nan")}, "delays.compute: nan must be a finite number >= 0"),
    ({"seed": 1.5}, "delays.seed: 1.5 must be an integer"),
    ({"bogus": 1}, "unknown field 'bogus'"),
])
def test_invalid_delays_name_the_field(delays, culprit):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"delays": delays}, source="run.yaml")
    assert culprit in str(info.value) and str(info.value).startswith("run.yaml: ")


def test_ranks_outside_the_run_are_rejected():
    STRAGGLERS.check_ranks(3)
    with pytest.raises(ConfigError, match=r"delays.slowdown: rank 1 is not in the run"):
        STRAGGLERS.check_ranks(1)


def test_minibatches_must_divide_the_batch():
    with pytest.raises(ConfigError, match="batch_size: 30 must be a multiple of minibatches"):
        TrainConfig(batch_size=30, minibatches=4)


def test_send_delay_sleeps_on_the_transport_clock_before_the_strategy_messages_only():
    from gossip.clock import ManualClock
    from gossip.transport import LoopbackHub

    clock = ManualClock()
    hub = LoopbackHub(2)
    t0, t1 = hub.transport(0, clock=clock), hub.transport(1)
    t0.delay_sends(0.25, kinds=("gossip",))
    t0.send(1, Message(kind="gossip", round=0))
    assert clock.monotonic() == 0.25
    t0.send(1, Message(kind="probe.rs", round=0))  # not the algorithm's: at once
    assert clock.monotonic() == 0.25
    assert [t1.recv(timeout=1).kind for _ in range(2)] == ["gossip", "probe.rs"]


def test_exponential_inverse_cdf_is_finite():
    model = DelayModel(rank=0, seed=0, straggler_prob=1.0, straggler_mean=0.01)
    assert all(math.isfinite(v) and v >= 0 for v in draws(model, 5000))
