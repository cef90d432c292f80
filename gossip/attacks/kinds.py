"""The attack kinds: pure, seeded functions of what an attacker knows -> what it sends.

Each kind is an ``Options`` dataclass (its parameters, declared once, with defaults and
checks) with one method, ``payload(view)``: the tensor the attacker sends to one neighbour in
one round instead of its model. ``needs`` says what the view must hold (docs/ARCHITECTURE.md,
Attacks): ``own`` its own model, ``history`` its model of an earlier round, ``neighbours``
the round's models of the destination and of the destination's honest neighbours (a rushing
attacker: gossip/attacks/sender.py). Every payload is a pure function of the view and the
seed, so an attacked run replays bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from gossip.errors import ConfigError
from gossip.options import Options, option, positive
from gossip.registry import Registry

ATTACKS: Registry[type[AttackKind]] = Registry("attack")


@dataclass(frozen=True)
class View:
    """What an attacker knows when it sends to neighbour ``dst`` in ``round``.

    Attributes:
        rank: The attacker's rank.
        dst: The neighbour the payload goes to.
        round: The round.
        seed: The attack's seed.
        own: The model it would send were it honest.
        old: Its model of an earlier round (kinds that need ``history``).
        target: ``dst``'s model of this round (kinds that need ``neighbours``).
        honest: ``{j: model}``: the round's models of ``dst``'s honest neighbours the attacker
            received (kinds that need ``neighbours``).
        weights: Row ``dst`` of the mixing matrix, ``{j: W_dst,j}`` over ``dst``'s neighbours.
        attackers: Every attacking rank of the run.
    """

    rank: int
    dst: int
    round: int
    seed: int
    own: torch.Tensor
    old: torch.Tensor | None = None
    target: torch.Tensor | None = None
    honest: Mapping[int, torch.Tensor] = field(default_factory=dict)
    weights: Mapping[int, float] = field(default_factory=dict)
    attackers: frozenset[int] = frozenset()

    def neighbourhood(self) -> torch.Tensor:
        """``[target, honest neighbours...]`` stacked (neighbours in rank order)."""
        return torch.stack([self.target] + [self.honest[j] for j in sorted(self.honest)])


@dataclass(frozen=True)
class AttackKind(Options):
    """Base of the attack kinds: parameters as options, and the payload they send."""

    #: What ``payload`` reads: ``own``, ``history`` or ``neighbours`` (see the module doc).
    needs: ClassVar[Literal["own", "history", "neighbours"]] = "own"
    #: Whether it changes its training data's class labels (a task without them refuses it).
    needs_labels: ClassVar[bool] = False
    #: Its name in ``ATTACKS`` (set as it registers).
    registered: ClassVar[str] = ""

    def payload(self, view: View) -> torch.Tensor:
        """What the attacker sends to ``view.dst`` in ``view.round`` (a new tensor)."""
        raise NotImplementedError

    def data(self, batches, classes: int):
        """The attacker's batch stream (``next() -> (x, y)``): its own, except for label
        flipping."""
        return batches

    def resolved(self, size: int, attackers: int) -> AttackKind:
        """These parameters for a run of ``size`` peers with ``attackers`` of them attacking
        (defaults that depend on the run are computed here)."""
        return self

    @property
    def name(self) -> str:
        return self.registered


def _kind(name: str):
    def register(cls):
        cls.registered = name
        return ATTACKS.register(name)(cls)
    return register


@_kind("signflip")
@dataclass(frozen=True)
class SignFlip(AttackKind):
    """Sends its model negated: -x_b."""

    def payload(self, view: View) -> torch.Tensor:
        return torch.neg(view.own)


def noise(seed: int, rank: int, round: int, dst: int, n: int) -> np.ndarray:
    """The standard normal draws of ``gaussian`` for one message: float64, a pure function
    of ``(seed, rank, round, dst)``."""
    return np.random.default_rng([seed, rank, round, dst]).standard_normal(n)


@_kind("gaussian")
@dataclass(frozen=True)
class Gaussian(AttackKind):
    """Sends its model plus scaled noise, drawn afresh per neighbour and round:
    x_b + sigma * N(0, I)."""

    sigma: float = option(1.0, "standard deviation of the noise added to each coordinate",
                          check=positive)

    def payload(self, view: View) -> torch.Tensor:
        draws = noise(view.seed, view.rank, view.round, view.dst, view.own.numel())
        drawn = torch.from_numpy(draws).to(view.own.dtype).view_as(view.own)
        return view.own + self.sigma * drawn


def baruch_z(n: int, f: int) -> float:
    """ALIE's z for ``f`` attackers among ``n`` peers (Baruch et al. 2019):
    s = floor(n/2 + 1) - f, z = Phi^-1((n - f - s) / (n - f))."""
    s = math.floor(n / 2 + 1) - f
    if not 0 <= f < n / 2 or not 0 < n - f - s < n - f:  # the formula's domain
        return math.nan
    return NormalDist().inv_cdf((n - f - s) / (n - f))


@_kind("alie")
@dataclass(frozen=True)
class ALIE(AttackKind):
    """A Little Is Enough: per coordinate, the mean of the destination's and its honest
    neighbours' models minus z of their (sample) standard deviations."""

    needs = "neighbours"
    z: float | None = option(None, "standard deviations below the mean (default: Baruch's z "
                                   "from the run's peers and attackers)",
                             check=lambda z: None if 0 < z < math.inf
                             else "must be a positive finite number")

    def resolved(self, size: int, attackers: int) -> AttackKind:
        if self.z is not None:
            return self
        z = baruch_z(size, attackers)
        if not z > 0:
            raise ConfigError(f"attack alie: Baruch's z for {attackers} attacker(s) among {size} "
                              f"peers is {z:.3g}, not positive; give z (e.g. alie,z=1)")
        return type(self)(z=z)

    def payload(self, view: View) -> torch.Tensor:
        models = view.neighbourhood()
        mean = models.mean(dim=0)
        if len(models) < 2:  # one model: no spread to hide in
            return mean
        return mean - self.z * models.std(dim=0)


@_kind("ipm")
@dataclass(frozen=True)
class IPM(AttackKind):
    """Inner-product manipulation (Xie et al. 2020): -epsilon times the mean of the
    destination's and its honest neighbours' models."""

    needs = "neighbours"
    epsilon: float = option(0.1, "scale of the negated mean", check=positive)

    def payload(self, view: View) -> torch.Tensor:
        return view.neighbourhood().mean(dim=0).mul_(-self.epsilon)


@_kind("dissensus")
@dataclass(frozen=True)
class Dissensus(AttackKind):
    """The dissensus attack on gossip (He et al. 2022): x_t - epsilon * sum_{honest j}
    W_tj (x_j - x_t) / sum_{attackers b in N_t} W_tb, aimed at destination t; epsilon = 1
    cancels the pull of t's honest neighbours on t under plain gossip."""

    needs = "neighbours"
    epsilon: float = option(1.5, "multiple of the destination's honest pull to cancel "
                                 "(1: all of it)", check=positive)

    def payload(self, view: View) -> torch.Tensor:
        target = view.target
        pull = torch.zeros_like(target)
        for j in sorted(view.honest):
            pull.add_(view.honest[j] - target, alpha=view.weights[j])
        byzantine = sum(w for j, w in view.weights.items() if j in view.attackers)
        return target - (self.epsilon / byzantine) * pull


@_kind("labelflip")
@dataclass(frozen=True)
class LabelFlip(AttackKind):
    """Trains honestly on flipped labels, y' = C - 1 - y, and sends its model as it is."""

    needs_labels: ClassVar[bool] = True

    def payload(self, view: View) -> torch.Tensor:
        return view.own

    def data(self, batches, classes: int):
        return FlippedLabels(batches, classes)


class FlippedLabels:
    """A batch stream whose labels are flipped: y -> classes - 1 - y."""

    def __init__(self, batches, classes: int):
        self.batches, self.classes = batches, classes

    def next(self) -> tuple[Any, torch.Tensor]:
        x, y = self.batches.next()
        return x, self.classes - 1 - y

    def __getattr__(self, name: str) -> Any:  # epoch, ...: the stream's own
        return getattr(self.batches, name)


@_kind("stale")
@dataclass(frozen=True)
class StaleReplay(AttackKind):
    """Replays its own model of round r - k, tagged round r (before round k: its first
    model)."""

    needs = "history"
    k: int = option(5, "how many rounds old the replayed model is",
                    check=lambda k: None if k >= 1 else "must be >= 1")

    def payload(self, view: View) -> torch.Tensor:
        return view.old.clone()
