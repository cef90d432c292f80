"""The time model beside the measurement (shared/specs/workloads.md section 4):

    T = steps x (C + V/B + n alpha)

C: measured compute seconds per step (the median peer's, mean over the steps), V: bytes on
the busiest link per step (measured byte counters: the most any peer sent or received in a
round, mean over the rounds; in the netns cluster each peer's link is capped at B both
ways), B: the run's link rate, n: serial messages per step (the strategy's traffic plan,
where it has one), alpha: a per-message latency (the experiment's ``time_model: {alpha:
SECONDS}``, 0 unless given). Steps and measured time are those to the target where the arm
reached it, else the whole run's.

Compression pays below the break-even rate (the spec's, with each arm's own C):

    B* = (V_d - s V_c) / (s C_c - C_d),   s = steps_c / steps_d

(C including n alpha where both arms' n are known); with C_c = C_d it is the spec's (V_d - s V_c) / ((s - 1) C). And the
baseline's rate where communication is 2/3 of its round (V/B + n alpha = 2 C):
B_2/3 = V / (2 C - n alpha): the communication-bound rate an experiment should run at; and
the alpha its measured step would need, (step - C - V/B) / n ("alpha fit": on a fast link,
where V/B is small, a per-message cost to put in ``time_model``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.errors import ConfigError
from gossip.experiment.analysis import Curve
from gossip.experiment.targets import Target, arms, median_or_none, reach, setting, target_rows
from gossip.options import Options, at_least, option


@dataclass(frozen=True)
class TimeModel(Options):
    """An experiment file's ``time_model`` section."""

    alpha: float = option(0.0, "per-message latency of the time model, seconds",
                          check=at_least(0))


def time_model_alpha(data: Any, where: str = "time_model") -> float:
    """The per-message latency of ``time_model: {alpha: SECONDS}`` (0 when absent)."""
    return 0.0 if data is None else TimeModel.from_mapping(data, where).alpha


def step_seconds(compute: float, link_bytes: float, rate_bytes: float | None,
                 messages: int | None, alpha: float) -> float:
    """C + V/B + n alpha (B None: an uncapped link, V/B = 0; n None: unknown, 0)."""
    wire = link_bytes / rate_bytes if rate_bytes else 0.0
    return compute + wire + (messages or 0) * alpha


def break_even(v_dense: float, c_dense: float, v_comp: float, c_comp: float,
               s: float) -> tuple[float, str]:
    """``(B*, where)``: the link rate (bytes/s) where the compressed arm (V_c, C_c, s times
    the dense arm's steps) takes as long as the dense one (V_d, C_d); ``where`` says on
    which side it is faster: ``below`` B*, ``above`` it, ``always`` or ``never``."""
    numerator, denominator = v_dense - s * v_comp, s * c_comp - c_dense
    if denominator > 0:
        return (numerator / denominator, "below") if numerator > 0 else (0.0, "never")
    if denominator < 0:
        return (math.inf, "always") if numerator >= 0 else (numerator / denominator, "above")
    return (math.inf, "always") if numerator > 0 else (0.0, "never")


def comm_bound_rate(link_bytes: float, compute: float, messages: int | None,
                    alpha: float, share: float = 2 / 3) -> float:
    """The link rate (bytes/s) at which communication takes ``share`` of the step:
    V/B + n alpha = share/(1 - share) C (inf: latency alone takes that much)."""
    budget = share / (1 - share) * compute - (messages or 0) * alpha
    return link_bytes / budget if budget > 0 else math.inf


def model_rows(curves: Sequence[Curve], *, baselines: Sequence[str] = (),
               target: Target | None = None, alpha: float = 0.0) -> list[dict[str, Any]]:
    """One row per arm (medians over its seeds): C, V, n, B, steps, modelled and measured
    seconds and their error, the measured share of the step spent communicating; against
    the baseline arm of its setting B* (Mbit/s, and on which side compression pays), and for
    the baselines B_2/3."""
    groups = arms(curves)
    levels = {}
    if target is not None:  # the level each arm's setting aims at, as target_rows has it
        for group, row in zip(groups, target_rows(curves, target, baselines)):
            levels[id(group[0])] = row["level"]
    measured = {id(g[0]): _measure(g, target, levels.get(id(g[0])), alpha) for g in groups}
    base_of = {setting(g[0]): measured[id(g[0])] for g in groups
               if any(c.name in baselines for c in g)}
    rows = []
    for group in groups:
        m = measured[id(group[0])]
        base = base_of.get(setting(group[0]))
        row = {
            "arm": group[0].name if len(group) == 1 else "+".join(c.name for c in group),
            "C s": m["C"], "V MB": m["V"] / 1e6, "n": m["n"],
            "B Mbit/s": m["B"] * 8 / 1e6 if m["B"] else None,
            "to": m["to"], "steps": m["steps"],
            "model s": m["model"], "measured s": m["measured"],
            "error %": (100 * (m["model"] / m["measured"] - 1)
                        if m["model"] is not None and m["measured"] else None),
            "comm %": m["comm"],
            "B* Mbit/s": None, "pays": None, "B_2/3 Mbit/s": None, "alpha fit s": None,
        }
        # Steps compare where both reached the target, or neither was asked to.
        if base is not None and base is not m and m["to"] == base["to"] \
                and (target is None or m["to"] == "target"):
            # alpha where both arms' n are known, else for neither
            key = "C'" if m["n"] is not None and base["n"] is not None else "C"
            rate, where = break_even(base["V"], base[key], m["V"], m[key],
                                     m["steps"] / base["steps"])
            row["B* Mbit/s"], row["pays"] = rate * 8 / 1e6, where
        if base is m:
            row["B_2/3 Mbit/s"] = comm_bound_rate(m["V"], m["C"], m["n"], alpha) * 8 / 1e6
            if m["n"]:
                row["alpha fit s"] = (m["step_s"] - step_seconds(m["C"], m["V"], m["B"], 0,
                                                                 0.0)) / m["n"]
        rows.append(row)
    return rows


def _measure(group: Sequence[Curve], target: Target | None, level: float | None,
             alpha: float) -> dict[str, Any]:
    """One arm's figures, medians over its runs."""
    per_run = []
    for c in group:
        hit = reach(c, target, level) if target is not None else None
        to_target = hit is not None and hit.steps is not None
        steps = hit.steps if to_target else int(c.rounds.size)
        per_run.append({
            "C": _mean_after_first(c.compute[:steps]),
            "V": _mean_after_first(c.link_bytes[:steps]),
            "steps": steps, "to": "target" if to_target else "end",
            "measured": hit.time if to_target else float(c.train_time[-1]),
            "step_s": float(c.train_time[steps - 1]) / steps,
        })
    first = group[0]
    rate = _rate_bytes(first)
    n = serial_messages(first)
    out = {key: median_or_none([r[key] for r in per_run])
           for key in ("C", "V", "steps", "measured", "step_s")}
    out["to"] = "target" if all(r["to"] == "target" for r in per_run) else "end"
    out["n"], out["B"] = n, rate
    out["C'"] = out["C"] + (n or 0) * alpha
    out["model"] = out["steps"] * step_seconds(out["C"], out["V"], rate, n, alpha)
    out["comm"] = 100 * (1 - out["C"] / out["step_s"]) if out["step_s"] else None
    return out


def _mean_after_first(values: np.ndarray) -> float:
    """The first round also builds what later rounds reuse: left out when there are more."""
    values = values[1:] if values.size > 1 else values
    known = values[np.isfinite(values)]
    return float(known.mean()) if known.size else 0.0


def _rate_bytes(curve: Curve) -> float | None:
    from gossip.cluster import parse_rate

    netns = curve.config.get("netns") or {}
    return parse_rate(str(netns["rate"])).bytes_per_s if netns.get("rate") else None


def serial_messages(curve: Curve) -> int | None:
    """Messages a step waits for one after the other: the steps of rank 0's traffic plan
    that wait (None: the strategy has no plan, its pattern depends on the values)."""
    from gossip.config import TrainConfig
    from gossip.sim.sizes import model_size

    size = len(curve.config.get("ranks") or ())
    try:
        config = TrainConfig.from_dict(curve.config.get("train", {}), source=curve.name)
        numel, dtype = model_size(config)
        plan = config.spec.cls.traffic(0, size, numel, dtype, config.spec.options)
    except (ConfigError, KeyError, TypeError, ValueError):
        return None
    return None if plan is None else sum(1 for step in plan if step.recvs)
