"""The attack kinds against numpy oracles, their seeded draws, and how a run names its
attackers (``Attacks``: TrainConfig's ``attack``, the ``--attack`` flag)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gossip.attacks import ATTACKS, Attack, Attacks, View
from gossip.attacks.kinds import FlippedLabels, baruch_z
from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.matrix import check_run
from gossip.topology import Topology

RNG = np.random.default_rng(0)
X = {j: RNG.standard_normal(11) for j in range(6)}  # models of ranks 0..5


def view(dst=0, *, honest=(2, 3), weights=None, attackers=(4, 5), round=3, seed=9, old=None):
    """Rank 4 attacks ``dst``; it received ``dst``'s model and those of ``honest``."""
    t = {j: torch.from_numpy(X[j]) for j in X}
    return View(rank=4, dst=dst, round=round, seed=seed, own=t[4], target=t[dst],
                honest={j: t[j] for j in honest},
                weights=weights or {2: 0.2, 3: 0.1, 4: 0.15, 5: 0.05},
                attackers=frozenset(attackers), old=None if old is None else t[old])


def payload(kind: str, v: View, **params) -> np.ndarray:
    return ATTACKS.create(kind, **params).payload(v).numpy()


def test_sign_flip():
    np.testing.assert_array_equal(payload("signflip", view()), -X[4])


def test_gaussian_draws_per_seed_rank_round_and_destination():
    v = view()
    want = X[4] + 0.3 * np.random.default_rng([9, 4, 3, 0]).standard_normal(11)
    np.testing.assert_allclose(payload("gaussian", v, sigma=0.3), want, rtol=0, atol=1e-15)
    again = payload("gaussian", view(), sigma=0.3)
    assert again.tobytes() == payload("gaussian", v, sigma=0.3).tobytes()  # bitwise
    for other in (view(dst=1), view(round=4), view(seed=10)):
        assert not np.allclose(payload("gaussian", other, sigma=0.3), again)


@pytest.mark.parametrize("honest", [(2,), (2, 3), (1, 2, 3)])
def test_alie_hides_z_deviations_below_the_mean(honest):
    models = np.stack([X[0]] + [X[j] for j in sorted(honest)])
    want = models.mean(0) - 1.7 * models.std(0, ddof=1)
    np.testing.assert_allclose(payload("alie", view(honest=honest), z=1.7), want, rtol=1e-12)


def test_alie_with_the_target_alone_sends_it():
    np.testing.assert_allclose(payload("alie", view(honest=()), z=1.0), X[0])


def test_baruch_z():
    assert baruch_z(25, 5) == pytest.approx(0.2533, abs=1e-4)  # the spec's n=25, f=5
    assert baruch_z(12, 1) == pytest.approx(-0.114, abs=1e-3)  # negative: pass z
    assert math.isnan(baruch_z(4, 2))  # f >= n/2


def test_alie_default_z_is_baruchs_or_refused():
    attack = Attack.named("alie", attackers=range(5)).resolved(0, 25)
    assert attack.kind.z == pytest.approx(baruch_z(25, 5))
    with pytest.raises(ConfigError, match="give z"):
        Attack.named("alie").resolved(1, 5)


def test_ipm():
    models = np.stack([X[0], X[2], X[3]])
    np.testing.assert_allclose(payload("ipm", view(), epsilon=0.4), -0.4 * models.mean(0),
                               rtol=1e-12)


def test_dissensus():
    w = {2: 0.2, 3: 0.1, 4: 0.15, 5: 0.05}
    pull = 0.2 * (X[2] - X[0]) + 0.1 * (X[3] - X[0])
    want = X[0] - 1.5 * pull / (0.15 + 0.05)
    np.testing.assert_allclose(payload("dissensus", view(weights=w)), want, rtol=1e-12)


def test_dissensus_at_one_cancels_the_honest_pull():
    w = {2: 0.2, 3: 0.1, 4: 0.15, 5: 0.05}
    sent = payload("dissensus", view(weights=w), epsilon=1.0)
    mixed = (1 - sum(w.values())) * X[0] + 0.2 * X[2] + 0.1 * X[3] + 0.2 * sent
    np.testing.assert_allclose(mixed, X[0], rtol=1e-12, atol=1e-12)


def test_stale_replays_the_old_model():
    v = view(old=1)
    np.testing.assert_array_equal(payload("stale", v, k=3), X[1])
    assert payload("stale", v, k=3) is not v.old.numpy()


def test_label_flip_sends_its_model_and_flips_its_labels():
    v = view()
    np.testing.assert_array_equal(payload("labelflip", v), X[4])

    class Stream:
        epoch = 2

        def next(self):
            return torch.zeros(3, 2), torch.tensor([0, 3, 9])

    flipped = ATTACKS.create("labelflip").data(Stream(), 10)
    assert isinstance(flipped, FlippedLabels) and flipped.epoch == 2
    assert flipped.next()[1].tolist() == [9, 6, 0]
    stream = Stream()
    assert ATTACKS.create("signflip").data(stream, 10) is stream


@pytest.mark.parametrize("kind, params", [("gaussian", {"sigma": 0}), ("gaussian",
                                                                        {"sigma": math.nan}),
                                          ("ipm", {"epsilon": -1}), ("stale", {"k": 0}),
                                          ("alie", {"z": 0}), ("dissensus", {"epsilon": "x"})])
def test_bad_parameters_are_refused(kind, params):
    with pytest.raises(ConfigError, match=next(iter(params))):
        Attack.named(kind, **params)


# -- a run's attackers --------------------------------------------------------------------

def test_the_forms_of_a_runs_attackers():
    flags = Attacks.parse(["1:gaussian,sigma=0.5", "3:stale,k=2,seed=4"])
    mapping = Attacks.parse({1: {"kind": "gaussian", "sigma": 0.5},
                             "3": {"kind": "stale", "k": 2, "seed": 4}})
    assert flags == mapping and Attacks.parse(flags.to_dict()) == flags
    assert Attacks.parse("2:signflip") == Attacks.parse({2: "signflip"})
    assert not Attacks.parse(None) and not Attacks.parse({})
    one = flags.for_rank(1, seed=7)
    assert one.seed == 7 and one.attackers == {1, 3} and one.kind.sigma == 0.5
    assert flags.for_rank(3, seed=7).seed == 4
    assert flags.for_rank(0, seed=7) is None


@pytest.mark.parametrize("value, message", [
    ("signflip", "RANK:KIND"), ("x:signflip", "not a rank"), ("1:nope", "unknown attack"),
    ("1:gaussian,sigma", "KEY=VALUE"), ("1:gaussian,rate=2", "no parameter 'rate'"),
    (["1:signflip", "1:ipm"], "two attacks"), ({1: {"sigma": 1}}, "a kind"),
    ({1: {"kind": "ipm", "seed": 1.5}}, "seed"), (3, "expected")])
def test_bad_attackers_are_refused_naming_the_fault(value, message):
    with pytest.raises(ConfigError, match=message):
        Attacks.parse(value)


def test_train_config_carries_the_attack():
    config = TrainConfig(attack=Attacks.parse(["1:alie,z=2"]))  # from_dict parses strings
    assert config.attack.for_rank(1, seed=0).kind.z == 2.0
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig().to_dict()["attack"] == {}
    with pytest.raises(ConfigError, match="attack"):
        TrainConfig.from_dict({"attack": "1:nope"})


@pytest.mark.parametrize("attack, strategy, message", [
    ("7:signflip", "dpsgd", "rank 7 is not in the run"),
    ("1:signflip", "ring-allreduce", "does not send its model"),
    ("1:ipm", "adpsgd", "symmetric gossip in rounds"), ("1:alie,z=1", "sgp", "symmetric gossip"),
    ("1:alie", "dpsgd", "give z")])
def test_runs_an_attack_cannot_fit_are_refused_before_they_start(attack, strategy, message):
    with pytest.raises(ConfigError, match=message):
        check_run(TrainConfig(strategy=strategy, attack=Attacks.parse(attack)), Topology.ring(5))


def test_runs_it_fits_pass():
    check_run(TrainConfig(attack=Attacks.parse(["1:alie,z=1", "2:labelflip"])), Topology.ring(5))


@pytest.mark.parametrize("options", [{"robust": "median"}, {"robust": "trimmed-mean", "trim": 1},
                                     {"robust": "clip", "tau_rule": "second"}])
def test_rushing_attacks_fit_robust_mixing(options):
    """Robust mixing changes how a peer mixes (its average is no longer kept), not what it
    sends: the round's models still come back, so the rushing attacks can aim at it."""
    check_run(TrainConfig(options=options, attack=Attacks.parse(["1:alie,z=1", "3:dissensus"])),
              Topology.generate("complete", 5))
