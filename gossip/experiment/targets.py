"""Time and bytes to a target quality, per arm (runs that differ only by their seed), against
the baseline arm of the same setting (task, its options, peers and link rate).

```yaml
target: {metric: accuracy, fraction: 0.95}   # 95 % of the baseline's final value (median)
target: {metric: test_loss, margin: 0.05}    # the baseline's final value + 0.05
target: {metric: accuracy, value: 0.9}       # an absolute level
```

The experiment's ``target`` is every run's unless a run gives its own (e.g. an experiment of
two tasks: each task's runs their metric).

A run reaches the target at its first round whose metric (mean over the peers; ``loss`` is
the smoothed training loss) is at the level; its time is the training time until then,
evaluation excluded (``Curve.train_time``), its bytes the mean per peer sent by then, its
steps that round + 1. An arm's figures are medians over its seeds (a seed that never reached
it counts as later than any that did: None if half of them never did).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.errors import ConfigError
from gossip.experiment.analysis import RECORDED, Curve
from gossip.options import Options, in_unit_interval, option

#: Metrics where higher is better; every other (losses, perplexity) is lower-is-better.
HIGHER = ("accuracy", "avg_accuracy")
METRICS = ("loss", *RECORDED)


def finite(value: float) -> str | None:
    return None if math.isfinite(value) else "must be a finite number"


@dataclass(frozen=True)
class Target(Options):
    """One of ``value`` (absolute), ``fraction`` (of the baseline's final value) or
    ``margin`` (added to it: a lower-is-better metric) for ``metric``."""

    metric: str = option("accuracy", "a per-round metric of the peers' records (loss: the "
                         "smoothed training loss)", choices=METRICS)
    value: float | None = option(None, "an absolute level", check=finite)
    fraction: float | None = option(None, "of the baseline's final value (higher-is-better "
                                    "metrics)", check=in_unit_interval)
    margin: float | None = option(None, "added to the baseline's final value (lower-is-better "
                                  "metrics)", check=finite)

    def __post_init__(self):
        super().__post_init__()
        if sum(x is not None for x in (self.value, self.fraction, self.margin)) != 1:
            raise ConfigError("give exactly one of value, fraction, margin")
        if self.fraction is not None and not self.higher:
            raise ConfigError(f"fraction: {self.metric} is lower-is-better; use margin")

    @property
    def higher(self) -> bool:
        return self.metric in HIGHER

    def describe(self) -> str:
        if self.value is not None:
            return f"{self.metric} {'>=' if self.higher else '<='} {self.value:g}"
        if self.fraction is not None:
            return f"{self.metric} >= {self.fraction:g} x baseline's final"
        return f"{self.metric} <= baseline's final + {self.margin:g}"

    def level(self, final: float | None) -> float | None:
        """The level to reach, given the baseline's final value (None: unknown)."""
        if self.value is not None:
            return self.value
        if final is None or not math.isfinite(final):
            return None
        return final * self.fraction if self.fraction is not None else final + self.margin


def run_targets(data: Mapping[str, Any], where: str = "experiment") -> dict[str, Target]:
    """Each run's target in an experiment file's mapping: its own ``target``, else the
    file's; runs with neither are left out."""
    top = data.get("target")
    found = {}
    for item in data.get("runs") or ():
        if not isinstance(item, Mapping):
            continue
        own = item.get("target")
        if own is not None:
            found[item.get("name")] = Target.from_mapping(own, f"{where}: runs ({item.get('name')}): "
                                                        f"target")
        elif top is not None:
            found[item.get("name")] = Target.from_mapping(top, f"{where}: target")
    return found


@dataclass(frozen=True)
class Reached:
    """Where one run first met the level (all None: never)."""

    steps: int | None
    time: float | None  # training seconds, evaluation excluded
    bytes: float | None  # mean per peer


def reach(curve: Curve, target: Target, level: float | None) -> Reached:
    values = series(curve, target.metric)
    if level is None or values is None:
        return Reached(None, None, None)
    with np.errstate(invalid="ignore"):
        hit = np.nonzero(values >= level if target.higher else values <= level)[0]
    if not hit.size:
        return Reached(None, None, None)
    i = int(hit[0])
    return Reached(i + 1, float(curve.train_time[i]), float(curve.bytes_sent[i]))


def series(curve: Curve, metric: str) -> np.ndarray | None:
    return curve.values.get(metric)


def final(curve: Curve, metric: str) -> float | None:
    """The metric's last measured value (None: never measured)."""
    values = series(curve, metric)
    if values is None:
        return None
    known = values[np.isfinite(values)]
    return float(known[-1]) if known.size else None


def setting(curve: Curve) -> str:
    """What a baseline must share with the arms compared to it: task, its options, peers,
    link rate."""
    train, netns = curve.config.get("train", {}), curve.config.get("netns") or {}
    return json.dumps([train.get("task"), train.get("task_options"),
                       len(curve.config.get("ranks") or ()), netns.get("rate")],
                      sort_keys=True)


def arm_of(curve: Curve) -> str:
    """Runs of one arm differ by their seed only."""
    config = dict(curve.config)
    config.pop("run", None)
    config["train"] = {k: v for k, v in config.get("train", {}).items() if k != "seed"}
    topology = config.get("topology") or {}
    config["topology"] = topology.get("edges") if isinstance(topology, Mapping) else topology
    return json.dumps(config, sort_keys=True, default=str) + setting(curve)


def arms(curves: Sequence[Curve]) -> list[list[Curve]]:
    """The curves grouped by arm, in order of first appearance."""
    groups: dict[str, list[Curve]] = {}
    for c in curves:
        groups.setdefault(arm_of(c), []).append(c)
    return list(groups.values())


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median where a None (never) is later than any number; None if half are None."""
    ordered = sorted(values, key=lambda v: (v is None, v if v is not None else 0.0))
    if not ordered:
        return None
    n = len(ordered)
    middle = ordered[(n - 1) // 2], ordered[n // 2]
    if middle[1] is None:
        return None
    return float(np.mean(middle))


def target_rows(curves: Sequence[Curve], target: Target,
                baselines: Sequence[str]) -> list[dict[str, Any]]:
    """One row per arm: seeds, steps, time and bytes to the target, final value, and the
    baseline's (same setting) time / this arm's time, likewise bytes, final difference."""
    groups = arms(curves)
    base_arms = {setting(group[0]): group for group in groups
                 if any(c.name in baselines for c in group)}
    figures = {}
    for group in groups:
        base = base_arms.get(setting(group[0]))
        base_final = (median_or_none([final(c, target.metric) for c in base])
                      if base is not None else None)
        level = target.level(base_final)
        hits = [reach(c, target, level) for c in group]
        figures[id(group[0])] = {
            "level": level,
            "steps": median_or_none([h.steps for h in hits]),
            "time": median_or_none([h.time for h in hits]),
            "bytes": median_or_none([h.bytes for h in hits]),
            "final": median_or_none([final(c, target.metric) for c in group]),
            "base": base,
        }
    rows = []
    for group in groups:
        mine = figures[id(group[0])]
        base = mine["base"]
        theirs = figures[id(base[0])] if base is not None else None
        rows.append({
            "arm": group[0].name if len(group) == 1 else "+".join(c.name for c in group),
            "seeds": len(group),
            "level": mine["level"],
            "steps": mine["steps"],
            "time s": mine["time"],
            "MB": mine["bytes"] / 1e6 if mine["bytes"] is not None else None,
            f"final {target.metric}": mine["final"],
            "time x": _ratio(theirs and theirs["time"], mine["time"]),
            "bytes x": _ratio(theirs and theirs["bytes"], mine["bytes"]),
            "final diff": (mine["final"] - theirs["final"]
                           if theirs and mine["final"] is not None
                           and theirs["final"] is not None else None),
        })
    return rows


def _ratio(baseline: float | None, mine: float | None) -> float | None:
    """How many times less than the baseline's (speed-up; > 1: this arm is better)."""
    return baseline / mine if baseline and mine else None
