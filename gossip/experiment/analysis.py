"""Per-run curves from the peers' metrics, time to a target loss, and the summary table.

A run's round ``r`` counts once every peer has finished it: its time is the latest peer's
wall clock then, measured from the moment the last peer started training (process start-up
is not part of the algorithm). An asynchronous run has no rounds: its row r is the
(r + 1)-th P records in wall-clock order (P peers), whoever wrote them. Its loss is the sample-weighted mean over the peers of the
round's mini-batch losses, smoothed by a trailing moving average; bytes are the mean
per peer; accuracy the mean over peers of each local model's test accuracy.

A run with attackers (its config's ``attack``) is the honest peers': the attackers' records
are left out of every figure, and its consensus probe already measured the honest peers
alone (gossip/training/consensus.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gossip.errors import ConfigError
from gossip.metrics import read_jsonl


@dataclass
class Curve:
    """One run, aggregated over its peers, one entry per round finished by all."""

    name: str
    label: str  # strategy as a reader knows it, e.g. "nonblocking(dpsgd)"
    # A wrapper (it has an inner strategy): drawn dashed in its inner strategy's colour.
    family: str  # runs of one family differ only by blocking vs non-blocking (same colour)
    nonblocking: bool
    rounds: np.ndarray
    time: np.ndarray  # seconds
    loss: np.ndarray  # smoothed
    raw_loss: np.ndarray
    accuracy: np.ndarray
    bytes_sent: np.ndarray  # mean per peer, cumulative
    avg_accuracy: float | None  # test accuracy of the peers' average model, last measured
    minibatch_share: float  # finished / planned mini-batches over the run
    consensus: np.ndarray = field(default_factory=lambda: np.empty(0))  # nan: not measured
    attackers: tuple[int, ...] = ()  # ranks left out: the run's attackers
    # Cumulative training seconds, evaluation excluded: per round, the least any peer spent
    # computing and in its step (the others' steps also waited for its evaluation).
    train_time: np.ndarray = field(default_factory=lambda: np.empty(0))
    compute: np.ndarray = field(default_factory=lambda: np.empty(0))  # median peer's, per round
    # Per round, the busiest link's bytes: the most any peer sent or received in it (in the
    # netns cluster each peer's link is capped both ways).
    link_bytes: np.ndarray = field(default_factory=lambda: np.empty(0))
    values: dict[str, np.ndarray] = field(default_factory=dict)  # metric -> per round, mean
    config: dict[str, Any] = field(default_factory=dict)  # the run's config.yaml
    peers: np.ndarray = field(default_factory=lambda: np.empty(0))  # recording each round

    def time_to(self, target: float) -> float | None:
        """Seconds until the smoothed loss first reached ``target`` (None: never)."""
        hit = np.nonzero(self.loss <= target)[0]
        return float(self.time[hit[0]]) if hit.size else None

    def bytes_to(self, target: float) -> float | None:
        """Bytes sent per peer until the smoothed loss first reached ``target`` (None:
        never)."""
        hit = np.nonzero(self.loss <= target)[0]
        return float(self.bytes_sent[hit[0]]) if hit.size else None


#: Rounds in the loss moving average unless an experiment (``smooth:``) or `gossip plot
#: --smooth` says otherwise.
SMOOTH = 10


def load_curve(run_dir: Path, *, smooth: int = SMOOTH) -> Curve:
    """Aggregate one run directory's ``peer-R.jsonl`` files."""
    from gossip.attacks import Attacks  # torch: not at the CLI's start
    from gossip.strategies.wrapping import wrapped

    config = _config(run_dir)
    train = config.get("train", {})
    attackers = tuple(sorted(Attacks.parse(train.get("attack"), source=f"{run_dir}: attack")
                             .by_rank))
    files = sorted(run_dir.glob("peer-*.jsonl"), key=_rank)
    peers = [read_jsonl(f) for f in files if _rank(f) not in attackers]
    peers = [records for records in peers if records]
    if not peers:
        raise ConfigError(f"{run_dir}: no metrics recorded")
    if _asynchronous(train.get("strategy"), train.get("options") or {}):
        rows = _rows_in_time_order(peers)
    elif (run_dir / "membership.jsonl").exists():  # a churn run: members come and go
        rows = _rows_by_round(peers)
    else:
        n = min(len(records) for records in peers)
        rows = [[records[i] for records in peers] for i in range(n)]
    n = len(rows)
    firsts = [records[0] for records in peers if records[0]["round"] == 0] or [
        records[0] for records in peers]  # joiners' clocks start later
    trained, sent, recv = _per_record(peers)
    if all("wall" in r for r in firsts):
        origin = max(r["wall"] - r["time"] for r in firsts)
        time = np.array([max(r["wall"] for r in row) - origin for row in rows])
    else:  # older runs without wall clock: per-peer clocks, the slowest peer counts
        time = np.array([max(r["time"] for r in row) for row in rows])
    raw = np.array([_weighted_loss(row) for row in rows])
    planned = train.get("minibatches", 1) * sum(len(row) for row in rows)
    finished = sum(r.get("minibatches", train.get("minibatches", 1)) for row in rows for r in row)
    strategy = train.get("strategy", "?")
    options = train.get("options") or {}
    wrapper = wrapped(strategy, options)
    inner, family_options, own = wrapper or (strategy, options, {})
    family = inner + (json.dumps(family_options, sort_keys=True) if family_options else "")
    family += json.dumps(own, sort_keys=True) if own else ""  # local's period
    family += f"@{config['netns']['rate']}" if config.get("netns") else ""
    family += json.dumps(train.get("delays"), sort_keys=True)  # other stragglers: another run
    avg = [r["avg_accuracy"] for row in rows for r in row[:1] if r.get("avg_accuracy") is not None]
    loss = _moving_average(raw, smooth)
    return Curve(
        name=run_dir.name,
        label=f"{strategy}({inner})" if wrapper else strategy,
        family=family,
        nonblocking=wrapper is not None,
        rounds=np.arange(n),
        time=time,
        loss=loss,
        raw_loss=raw,
        accuracy=np.array([_mean_known([r["accuracy"] for r in row]) for row in rows]),
        bytes_sent=np.array([np.mean([r["bytes_sent"] for r in row]) for row in rows]),
        avg_accuracy=avg[-1] if avg else None,
        minibatch_share=finished / planned if planned else 1.0,
        consensus=np.array([_first_known(row, "consensus") for row in rows]),
        attackers=attackers,
        train_time=np.cumsum([min(trained[id(r)] for r in row) for row in rows]),
        compute=np.array([_median_known([r.get("compute_s") for r in row]) for row in rows]),
        link_bytes=np.array([max(max(sent[id(r)], recv[id(r)]) for r in row) for row in rows]),
        values={"loss": loss, **{key: np.array([_mean_known([r.get(key) for r in row])
                                                for row in rows])
                                 for key in RECORDED if any(key in r for r in firsts)}},
        config=config,
        peers=np.array([len(row) for row in rows]),
    )


#: Per-round metrics a target may name besides the smoothed training ``loss``: the mean over
#: the peers of that record field (a task's own evaluation metrics, where it records them).
RECORDED = ("accuracy", "avg_accuracy", "test_loss", "perplexity")


def _per_record(peers: list[list[dict]]) -> tuple[dict, dict, dict]:
    """Per record (by id): this peer's training seconds in its round (compute and
    synchronized step; evaluation and the consensus probe excluded; a record without
    timings counts its ``time`` since the last), and the bytes it sent and received."""
    trained, sent, recv = {}, {}, {}
    for records in peers:
        last = {"time": 0.0, "bytes_sent": 0, "bytes_recv": 0}
        for r in records:
            if r.get("compute_s") is not None and r.get("comm_s") is not None:
                trained[id(r)] = r["compute_s"] + r["comm_s"]
            else:
                trained[id(r)] = r["time"] - last["time"]
            sent[id(r)] = r.get("bytes_sent", 0) - last.get("bytes_sent", 0)
            recv[id(r)] = r.get("bytes_recv", 0) - last.get("bytes_recv", 0)
            last = r
    return trained, sent, recv


def _median_known(values) -> float:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else float("nan")


def _rank(path: Path) -> int:
    """``peer-R.jsonl`` -> R."""
    return int(path.stem.split("-")[1])


def _first_known(row: Sequence[dict], key: str) -> float:
    """A value every peer of the row recorded alike (the probe's), nan if none did."""
    values = [r[key] for r in row if r.get(key) is not None]
    return float(values[0]) if values else math.nan


def _asynchronous(strategy: str | None, options: dict) -> bool:
    """Whether the run's strategy has no rounds (``synchronous = False``)."""
    from gossip.strategies import STRATEGIES

    if strategy not in STRATEGIES:
        return False
    return not STRATEGIES.strategy_class(strategy, options).synchronous


def _rows_in_time_order(peers: list[list[dict]]) -> list[list[dict]]:
    """An asynchronous run's "rounds": its records in wall-clock order, P at a time (P
    peers), so row r is reached when the peers together took (r + 1) P steps, however they
    were spread over the peers (a fast peer takes more of them than a slow one)."""
    size = len(peers)
    ordered = sorted((r for records in peers for r in records),
                     key=lambda r: (r.get("wall", r["time"]), r["round"]))
    return [ordered[i:i + size] for i in range(0, len(ordered) - size + 1, size)]


def _rows_by_round(peers: list[list[dict]]) -> list[list[dict]]:
    """A churn run's rounds: each round's records, from the peers that ran it (a joiner from
    the round it joined at, a leaver up to its last)."""
    by_round: dict[int, list[dict]] = {}
    for records in peers:
        for record in records:
            by_round.setdefault(record["round"], []).append(record)
    return [by_round[r] for r in sorted(by_round)]


def _mean_known(values) -> float:
    """Mean of the values that are not None (a ``lost_work`` line has no accuracy)."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else float("nan")


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def _weighted_loss(row: Sequence[dict]) -> float:
    """Mean loss over the samples all peers finished in one round (nan if none)."""
    total = weight = 0.0
    for r in row:
        w = r.get("samples", 1)
        if r.get("loss") is not None and w:
            total += r["loss"] * w
            weight += w
    return total / weight if weight else math.nan


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` finite values (nan ignored)."""
    out = np.empty_like(values)
    for i in range(values.size):
        chunk = values[max(0, i - window + 1):i + 1]
        chunk = chunk[np.isfinite(chunk)]
        out[i] = chunk.mean() if chunk.size else math.nan
    return out


def summarize(curves: Sequence[Curve], *, target: float | None,
              baselines: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per run: final figures, time and bytes to ``target`` and speed-ups (in time)
    vs ``baselines``."""
    reached = {c.name: c.time_to(target) if target is not None else None for c in curves}
    rows = []
    for c in curves:
        row = {
            "run": c.name,
            "strategy": c.label,
            "rounds": int(c.rounds.size),
            "loss": float(c.loss[-1]),
            "accuracy": float(c.accuracy[-1]),
            "MB sent": float(c.bytes_sent[-1]) / 1e6,
            "minibatches %": 100.0 * c.minibatch_share,
            "time s": float(c.time[-1]),
            "consensus": _last_known(c.consensus),
        }
        if any(other.attackers for other in curves):
            row["attackers"] = ",".join(map(str, c.attackers)) or None
        if target is not None:
            row[f"time to {target:g} s"] = reached[c.name]
            sent = c.bytes_to(target)
            row[f"MB to {target:g}"] = sent / 1e6 if sent is not None else None
            for base in baselines:
                mine, theirs = reached[c.name], reached.get(base)
                row[f"speed-up vs {base}"] = (theirs / mine if mine and theirs else None)
        rows.append(row)
    return rows


def _last_known(values: np.ndarray) -> float | None:
    known = values[np.isfinite(values)]
    return float(known[-1]) if known.size else None


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table; missing values (never reached) show as '-'."""
    if not rows:
        return "(no runs)"
    columns = list(rows[0])
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(line[i]) for line in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        if 0 < abs(value) < 0.001 or abs(value) >= 1e9:  # e.g. consensus distances
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
