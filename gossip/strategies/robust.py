"""Robust mixing: what a gossip peer makes of its own model and its neighbours' when some
neighbours may be faulty or malicious (shared/specs/robust.md).

An aggregator is a pure function of (own x_i, neighbours' x_j, weights w_ij, w_ii) -> new
x_i; the gossip strategies (dpsgd, matcha) call it instead of their weighted sum when their
``robust`` option names one:

* ``clip`` (ClippedGossip, He, Karimireddy & Jaggi 2022): x_i + sum_j w_ij CLIP(x_j - x_i,
  tau), each difference shortened to the radius tau. A round moves x_i by at most
  (1 - w_ii) tau whatever the neighbours send; tau = inf is plain gossip, bit for bit. The
  radius is fixed (``tau``) or chosen each round from the distances (``tau_rule``: ``second``,
  the reference code's default, clips only the farthest neighbour to the second-largest
  distance; ``delta`` clips the farthest neighbours holding weight ``delta`` to the distance
  of the nearest one left). A common fixed tau on a symmetric W keeps the peers' mean (CLIP
  is odd, so the pair (i, j) cancels); a per-peer radius does not.
* ``trimmed-mean`` (Yin et al. 2018): per coordinate, over the peer and its neighbours, drop
  the ``trim`` highest and lowest values and average the rest, ignoring W; it stays inside
  the honest values' range when at most ``trim`` neighbours lie. ``median``: the same with
  all but the middle one or two dropped.

A neighbour's model with a non-finite value (NaN, inf, or a difference that overflows) is
flagged and left out: clipping gives it a zero difference (its weight stays on x_i), trimming
leaves it out of the sort (and trims fewer if too few are left). So the strategy takes them
from the transport unchecked (capability ``checks_own_result``): a NaN neighbour is skipped,
not waited for. The round's share of neighbours clipped or trimmed and the count flagged are
what ``Mixed`` reports.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gossip.errors import ConfigError
from gossip.options import Options, at_least, option

#: The ``robust`` option's values.
RULES = ("clip", "trimmed-mean", "median")
#: The adaptive radius rules of ``clip`` (``tau_rule``).
TAU_RULES = ("second", "delta")


@dataclass(frozen=True)
class Mixed:
    """What one robust mixing did: ``share`` of the neighbours' inputs clipped or trimmed (of
    their coordinates, for trimming), and how many neighbours were ``flagged`` non-finite."""

    share: float
    flagged: int

    def fields(self) -> dict[str, float | int]:
        """The ``Record`` fields of the round (training/records.py)."""
        return {"robust_share": self.share, "robust_flagged": self.flagged}


class Aggregator(ABC):
    """A robust replacement for the weighted sum x_i <- w_ii x_i + sum_j w_ij x_j."""

    #: Mixing keeps the peers' average (on a symmetric W, with no one attacking).
    preserves_mean: ClassVar[bool] = False

    @abstractmethod
    def mix(self, own: torch.Tensor, neighbours: Sequence[torch.Tensor],
            weights: Sequence[float], self_weight: float, *, out: torch.Tensor) -> Mixed:
        """Write the new x_i into ``out`` (not ``own`` or a neighbour's tensor), from the
        flat tensors ``own`` and ``neighbours`` and their weights (summing to one)."""

    def check(self, inputs: Iterable[tuple[int, int]]) -> None:
        """Refuse a graph on which the rule cannot work: ``inputs`` gives (rank, how many
        neighbours it mixes with). Raises ConfigError naming a rank."""


def _finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


class Clip(Aggregator):
    """Self-centred clipping to a fixed radius ``tau`` or one chosen by ``rule``."""

    def __init__(self, *, tau: float | None = None, rule: str | None = None,
                 delta: float | None = None):
        if (tau is None) == (rule is None):
            raise ConfigError("robust=clip: give either tau (a fixed radius) or tau_rule "
                              f"({' or '.join(TAU_RULES)})")
        self.tau, self.rule, self.delta = tau, rule, delta
        self.preserves_mean = rule is None  # one radius for every peer: pairs cancel

    def radius(self, distances: Sequence[float], weights: Sequence[float]) -> float:
        """tau_i for this round from the neighbours' distances (inf: flagged)."""
        if self.rule is None:
            return self.tau
        ranked = sorted(((d, w) for d, w in zip(distances, weights) if math.isfinite(d)),
                        reverse=True)
        if self.rule == "second":  # with a single neighbour nothing is clipped
            return ranked[1][0] if len(ranked) > 1 else math.inf
        # delta: the farthest holding weight delta (flagged ones count) go to the next one's.
        budget = self.delta - sum(w for d, w in zip(distances, weights) if not math.isfinite(d))
        for distance, weight in ranked:
            if weight > budget:
                return distance
            budget -= weight
        return 0.0

    def mix(self, own, neighbours, weights, self_weight, *, out):
        gap = torch.empty_like(own)
        distances = []
        for x in neighbours:
            torch.sub(x, own, out=gap)
            distance = float(torch.linalg.vector_norm(gap, dtype=torch.float64))
            distances.append(distance if math.isfinite(distance) else math.inf)
        tau = self.radius(distances, weights)
        # x_i + sum w_j c_j, as plain gossip sums it where c_j = x_j - x_i: bitwise dpsgd then.
        clipped = [not math.isfinite(d) or d > tau for d in distances]
        keep = self_weight + sum(w for w, c in zip(weights, clipped) if c)
        torch.mul(own, keep, out=out)
        for x, w, d, c in zip(neighbours, weights, distances, clipped):
            if not c:
                out.add_(x, alpha=w)
            elif math.isfinite(d) and tau > 0:
                # Scaled to [-1, 1] first: tau / d may be below the dtype's normal range.
                torch.sub(x, own, out=gap)
                gap.div_(gap.abs().max())
                gap.mul_(tau / float(torch.linalg.vector_norm(gap, dtype=torch.float64)))
                out.add_(gap, alpha=w)
        flagged = sum(not math.isfinite(d) for d in distances)
        return Mixed(sum(clipped) / len(neighbours) if neighbours else 0.0, flagged)


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean of the peer and its neighbours: ``trim`` values dropped
    at each end (``trim=None``: the median)."""

    def __init__(self, trim: int | None):
        self.trim = trim

    def _trim(self, count: int) -> int:
        return trim_count(self.trim, count)

    def check(self, inputs):
        if self.trim is None:
            return
        for rank, neighbours in inputs:
            if neighbours + 1 - 2 * self.trim < 1:
                raise ConfigError(
                    f"trim={self.trim}: rank {rank} mixes {neighbours + 1} models (itself and "
                    f"{neighbours} neighbours), none left after dropping {self.trim} high and "
                    f"{self.trim} low per coordinate; lower trim or use robust=median")

    def mix(self, own, neighbours, weights, self_weight, *, out):
        valid = [x for x in neighbours if _finite(x)]
        ordered = sorted_rows(torch.stack([own, *valid]))
        count, trim = len(ordered), self._trim(len(ordered))
        torch.mean(ordered[trim:count - trim], dim=0, out=out)
        # 2 trim values dropped per coordinate, less our own when it was among them
        own_dropped = int(((own < ordered[trim]) | (own > ordered[count - 1 - trim])).sum())
        trimmed = (2 * trim * own.numel() - own_dropped
                   + (len(neighbours) - len(valid)) * own.numel())
        total = len(neighbours) * own.numel()
        return Mixed(trimmed / total if total else 0.0, len(neighbours) - len(valid))


def trim_count(trim: int | None, count: int) -> int:
    """How many to drop at each end of ``count`` values (``trim=None``: all but the middle
    one or two; fewer when flagged inputs left too few: those were surely faulty, so fewer
    liars remain)."""
    most = (count - 1) // 2
    return most if trim is None else min(trim, most)


def sorted_rows(stack: torch.Tensor) -> torch.Tensor:
    """``stack`` (a few rows of many values) sorted along its rows, per column: an odd-even
    transposition network of whole-row minima and maxima, n passes for n rows. The values
    are torch.sort's, but a few times faster on a short first dimension (torch.sort costs
    about as much as a training step of a small model there, which no-attack runs pay)."""
    rows = stack.clone()
    n = len(rows)
    for start in (i % 2 for i in range(n)):
        pairs = (n - start) // 2
        low, high = rows[start:start + 2 * pairs:2], rows[start + 1:start + 2 * pairs:2]
        least = torch.minimum(low, high)
        torch.maximum(low, high, out=high)
        low.copy_(least)
    return rows


@dataclass(frozen=True)
class RuleOptions(Options):
    """What the ``robust`` options of gossip mixing and of whole-vector aggregates share:
    ``trim``, and which options belong to which rule."""

    #: rule -> the options that belong to it (given with another rule: refused).
    rule_options: ClassVar[dict[str, tuple[str, ...]]] = {}

    # Declared here to come first; each subclass declares it again with its rules.
    robust: str | None = option(None, "the robust rule (none: the plain combination)")
    trim: int | None = option(
        None, "robust=trimmed-mean: values dropped at each end, per coordinate",
        check=at_least(1))

    def check_rule_options(self) -> None:
        """Refuse an option of another rule than ``robust`` and a trimmed mean without
        ``trim``."""
        rule = self.robust
        given = {name for names in self.rule_options.values() for name in names
                 if getattr(self, name) is not None}
        for name in sorted(given - set(self.rule_options.get(rule, ()))):
            owner = next(r for r, names in self.rule_options.items() if name in names)
            raise ConfigError(f"{name} is an option of robust={owner}, not of "
                              f"robust={rule or 'none'}")
        if rule == "trimmed-mean" and self.trim is None:
            raise ConfigError("robust=trimmed-mean needs trim (values dropped at each end)")

    def check_conflict(self) -> None:
        why = self.robust_conflict() if self.robust is not None else None
        if why:
            raise ConfigError(f"robust={self.robust}: {why}")

    def robust_conflict(self) -> str | None:
        """Why these options cannot be robust (None: they can)."""
        return None


@dataclass(frozen=True)
class RobustOptions(RuleOptions):
    """The options of a gossip strategy that can mix robustly (dpsgd, matcha)."""

    rule_options = {"clip": ("tau", "tau_rule", "delta"), "trimmed-mean": ("trim",)}

    #: The rules this strategy's rounds allow (matcha's rounds may have a single partner).
    robust_rules: ClassVar[tuple[str, ...]] = RULES

    robust: str | None = option(
        None, f"robust mixing against faulty or malicious neighbours: {', '.join(RULES)} "
              f"(none: the weighted sum)",
        check=lambda r: None if r in RULES else f"must be one of {', '.join(RULES)}")
    tau: float | None = option(
        None, "robust=clip: the fixed radius each neighbour's difference is clipped to "
              "(.inf, YAML's infinity: plain gossip)",
        check=lambda t: None if t > 0 else "must be positive (inf allowed)")
    tau_rule: str | None = option(
        None, "robust=clip: choose the radius each round: second (the second-largest "
              "distance) or delta (clip the farthest neighbours holding weight delta)",
        check=lambda r: None if r in TAU_RULES else f"must be one of {', '.join(TAU_RULES)}")
    delta: float | None = option(
        None, "tau_rule=delta: the neighbours' weight that may be Byzantine, in (0, 1)",
        check=lambda d: None if 0 < d < 1 else "must be in (0, 1)")

    def __post_init__(self):
        super().__post_init__()
        rule = self.robust
        if rule is not None and rule not in self.robust_rules:
            raise ConfigError(f"robust={rule}: {self.robust_refusal(rule)}")
        self.check_rule_options()
        self.aggregator()  # refuses a clip without exactly one radius
        if (self.tau_rule == "delta") != (self.delta is not None):
            raise ConfigError("delta goes with tau_rule=delta, and tau_rule=delta needs it")
        self.check_conflict()

    def robust_refusal(self, rule: str) -> str:
        """Why this strategy does not allow ``rule`` (one not in ``robust_rules``)."""
        return f"this strategy allows robust={' or '.join(self.robust_rules)}"

    def aggregator(self) -> Aggregator | None:
        """The aggregator these options name (None: the plain weighted sum)."""
        if self.robust == "clip":
            return Clip(tau=self.tau, rule=self.tau_rule, delta=self.delta)
        if self.robust is not None:
            return TrimmedMean(self.trim)
        return None

    def aggregator_for(self, topology) -> Aggregator | None:
        """``aggregator()``, checked against every rank's neighbourhood in ``topology``."""
        robust = self.aggregator()
        if robust is not None:
            robust.check((r, len(topology.neighbors(r))) for r in range(topology.size))
        return robust

    def robust_capabilities(self, held: dict[str, Any]) -> dict[str, Any]:
        """A gossip strategy's capabilities ``held`` with these options' robust mixing: the
        average is kept only with a common radius, and non-finite models are left out by the
        aggregator, so the transport need not reject them (a neighbour sending NaN would
        otherwise stall the round until it is declared timed out)."""
        robust = self.aggregator()
        if robust is None:
            return dict(held)
        # its rule is checked against the graph's degrees, which a view may change
        return {**held, "preserves_mean": held["preserves_mean"] and robust.preserves_mean,
                "checks_own_result": True, "mixes_on_views": False}


# -- robust aggregates of whole vectors ----------------------------------------------------

#: The ``robust`` option's values where one peer holds every peer's whole vector (the ps
#: server's pushes of a shard, topk-allgather's P sets).
GATHERED_RULES = ("centered-clip", "trimmed-mean", "median")
#: Where centered-clip starts each aggregate.
STARTS = ("last", "median")


class Gathered(ABC):
    """A robust replacement for the mean of n whole vectors, a pure function of them (and,
    for centered-clip, of the last aggregate). A vector holding NaN/Inf is flagged and left
    out."""

    @abstractmethod
    def aggregate(self, vectors: Sequence[torch.Tensor],
                  last: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """A new tensor, the aggregate of the flat ``vectors`` given the previous one
        (``last``; None at the first), and how many vectors were flagged non-finite. With
        none finite: ``last``, or zeros at the first (nothing moves)."""

    @staticmethod
    def finite(vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [x for x in vectors if _finite(x)]


class CoordinateTrim(Gathered):
    """Per coordinate, the mean of the n values less the ``trim`` highest and lowest
    (``trim=None``: the median)."""

    def __init__(self, trim: int | None):
        self.trim = trim

    def aggregate(self, vectors, last):
        valid = self.finite(vectors)
        if not valid:
            return nothing(vectors[0], last), len(vectors)
        ordered = sorted_rows(torch.stack(valid))
        trim = trim_count(self.trim, len(ordered))
        return ordered[trim:len(ordered) - trim].mean(dim=0), len(vectors) - len(valid)


class CenteredClip(Gathered):
    """CenteredClip (Karimireddy, He & Jaggi 2021): ``passes`` times
    v <- v + (1/n) sum_k CLIP(x_k - v, tau), from the last aggregate (``start="last"``; the
    coordinate median at the first) or from the coordinate median each time (BTARD). A pass
    moves v by at most tau, toward a single vector by at most tau / n; tau = inf: one pass
    gives the mean. A difference that overflows flags its vector, as a non-finite one."""

    def __init__(self, tau: float, passes: int, start: str):
        self.tau, self.passes, self.start = tau, passes, start

    def aggregate(self, vectors, last):
        valid = self.finite(vectors)
        if not valid:
            return nothing(vectors[0], last), len(vectors)
        if last is None or self.start == "median":
            v = CoordinateTrim(None).aggregate(valid, None)[0]
        else:
            v = last.to(valid[0].dtype, copy=True)
        step, gap = torch.empty_like(v), torch.empty_like(v)
        for _ in range(self.passes):
            step.zero_()
            for x in valid:
                torch.sub(x, v, out=gap)
                norm = float(torch.linalg.vector_norm(gap, dtype=torch.float64))
                if not math.isfinite(norm):
                    continue  # overflowed: its difference counts as zero
                if norm > self.tau:
                    gap.mul_(self.tau / norm)
                step.add_(gap)
            v.add_(step, alpha=1.0 / len(valid))
        return v, len(vectors) - len(valid)


def nothing(like: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """The aggregate when every vector was flagged: the last one, or zeros."""
    return torch.zeros_like(like) if last is None else last.to(like.dtype, copy=True)


@dataclass(frozen=True)
class GatheredRobustOptions(RuleOptions):
    """The options of a strategy that holds every peer's whole vector where it averages and
    can aggregate them robustly (``ps`` sync on each shard, ``topk-allgather``)."""

    rule_options = {"centered-clip": ("tau", "passes", "start"), "trimmed-mean": ("trim",)}

    robust: str | None = option(
        None, f"robust aggregate of the peers' vectors: {', '.join(GATHERED_RULES)} (none: "
              f"the mean)",
        check=lambda r: None if r in GATHERED_RULES else
        f"must be one of {', '.join(GATHERED_RULES)}")
    tau: float | None = option(
        None, "robust=centered-clip: the radius each vector's difference to the aggregate is "
              "clipped to per pass", check=lambda t: None if t > 0 else "must be positive")
    passes: int | None = option(
        None, "robust=centered-clip: clipping passes per aggregate (default 1)",
        check=at_least(1))
    start: str | None = option(
        None, "robust=centered-clip: start each aggregate from the last one (last, the "
              "default) or from the coordinate median (median)",
        check=lambda s: None if s in STARTS else f"must be one of {', '.join(STARTS)}")

    def __post_init__(self):
        super().__post_init__()
        self.check_rule_options()
        if self.robust == "centered-clip" and self.tau is None:
            raise ConfigError("robust=centered-clip needs tau (the clipping radius)")
        self.check_conflict()

    def gathered(self) -> Gathered | None:
        """The aggregate these options name (None: the plain mean)."""
        if self.robust == "centered-clip":
            return CenteredClip(self.tau, self.passes or 1, self.start or "last")
        if self.robust is not None:
            return CoordinateTrim(self.trim)
        return None

    def gathered_capabilities(self, held: dict[str, Any]) -> dict[str, Any]:
        """The capabilities ``held`` with a robust aggregate: not the exact mean nor keeping
        it, and taking non-finite vectors from the transport (they are flagged and left out,
        not waited for until the round times out)."""
        if self.robust is None:
            return dict(held)
        return {**held, "exact_mean": False, "preserves_mean": False,
                "checks_own_result": True}
