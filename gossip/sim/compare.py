"""A simulated run against a real one of the same settings (`gossip sim-compare`): are the
numerics and bytes identical round by round, and how far off are the per-round times?"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gossip.errors import ConfigError
from gossip.metrics import read_jsonl

NUMERICS = ("loss", "accuracy", "consensus", "avg_accuracy")
COMPARED = (*NUMERICS, "bytes_sent")


@dataclass(frozen=True)
class Comparison:
    """Rounds compared over every peer, and how many matched exactly."""

    rounds: int
    numerics_equal: int  # rounds whose loss, accuracy, consensus, avg accuracy are bitwise equal
    bytes_equal: int  # rounds whose bytes sent are equal (received: see compare_runs)
    totals_equal: int  # peers whose bytes received by the last round are equal
    first_difference: str | None  # where the first mismatch is, in words
    time_error_median: float  # |simulated - real| / real per-round time
    time_error_p90: float

    def describe(self) -> str:
        lines = [f"{self.rounds} peer-rounds: numerics bitwise equal in {self.numerics_equal}, "
                 f"bytes sent equal in {self.bytes_equal}; bytes received by the last round "
                 f"equal on {self.totals_equal} peers",
                 f"per-round time error: median {self.time_error_median:.1%}, "
                 f"p90 {self.time_error_p90:.1%}"]
        if self.first_difference:
            lines.append(f"first difference: {self.first_difference}")
        return "\n".join(lines)


def round_seconds(records: list[dict]) -> np.ndarray:
    """Each round's duration: the records' ``time`` is cumulative."""
    times = np.array([r["time"] for r in records], dtype=float)
    return np.diff(times, prepend=0.0)


def compare_runs(real_dir: str | Path, sim_dir: str | Path) -> Comparison:
    """Compare every peer's records in two run directories (ConfigError if they do not
    have the same peers and rounds).

    Bytes received are compared at the last round only: a real peer counts a message when
    it reads it, and one of the next round that arrived early is read while it waits for
    another, so where a round's count ends depends on timing; the total does not."""
    real_dir, sim_dir = Path(real_dir), Path(sim_dir)
    files = sorted(real_dir.glob("peer-*.jsonl"))
    if not files:
        raise ConfigError(f"{real_dir}: no peer-*.jsonl")
    rounds = numerics = same_bytes = totals = 0
    first, errors = None, []
    for path in files:
        other = sim_dir / path.name
        if not other.exists():
            raise ConfigError(f"{sim_dir}: no {path.name} (the runs have different peers)")
        real, sim = read_jsonl(path), read_jsonl(other)
        if [r["round"] for r in real] != [r["round"] for r in sim]:
            raise ConfigError(f"{path.name}: the runs have different rounds")
        for a, b in zip(real, sim):
            rounds += 1
            numerics += all(_same(a.get(k), b.get(k)) for k in NUMERICS)
            same_bytes += a["bytes_sent"] == b["bytes_sent"]
            if first is None and not all(_same(a.get(k), b.get(k)) for k in COMPARED):
                first = f"{path.name} round {a['round']}: " + ", ".join(
                    f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in COMPARED
                    if not _same(a.get(k), b.get(k)))
        totals += bool(real) and real[-1]["bytes_recv"] == sim[-1]["bytes_recv"]
        real_s, sim_s = round_seconds(real), round_seconds(sim)
        keep = real_s > 0
        errors.extend(np.abs(sim_s[keep] - real_s[keep]) / real_s[keep])
    errors = np.array(errors) if errors else np.array([np.nan])
    return Comparison(rounds, numerics, same_bytes, totals, first, float(np.median(errors)),
                      float(np.percentile(errors, 90)))


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)  # NaN (a round with no mini-batch) equals NaN
