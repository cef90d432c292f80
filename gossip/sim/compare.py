"""A simulated run against a real one of the same settings (`gossip sim-compare`): are the
numerics and bytes identical round by round, and how far off are the per-round times?
Runs of different settings (a seed, a strategy option, the graph) are refused: their
differences would say nothing about the simulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gossip.config import TrainConfig, load_yaml
from gossip.errors import ConfigError
from gossip.metrics import read_jsonl
from gossip.topology import Topology

NUMERICS = ("loss", "accuracy", "consensus", "avg_accuracy", "test_loss")
COMPARED = (*NUMERICS, "bytes_sent")
# Settings that change nothing compared in a run that went to its end.
UNCOMPARED = ("timeout", "dead_after", "checkpoint_every")


@dataclass(frozen=True)
class Comparison:
    """Rounds compared over every peer, and how many matched exactly."""

    peers: int
    rounds: int
    numerics_equal: int  # rounds whose NUMERICS (loss, accuracy, ...) are bitwise equal
    bytes_equal: int  # rounds whose bytes sent are equal (received: see compare_runs)
    totals_equal: int  # peers whose bytes received by the last round are equal
    first_difference: str | None  # where the first mismatch is, in words
    time_error_median: float  # |simulated - real| / real per-round time
    time_error_p90: float

    @property
    def identical(self) -> bool:
        """Numerics and bytes sent equal in every round, bytes received on every peer."""
        return self.rounds > 0 and self.numerics_equal == self.bytes_equal == self.rounds \
            and self.totals_equal == self.peers

    def describe(self) -> str:
        lines = [f"{self.rounds} peer-rounds: numerics bitwise equal in {self.numerics_equal}, "
                 f"bytes sent equal in {self.bytes_equal}; bytes received by the last round "
                 f"equal on {self.totals_equal} peers",
                 f"per-round time error: median {self.time_error_median:.1%}, "
                 f"p90 {self.time_error_p90:.1%}"]
        if self.first_difference:
            lines.append(f"first difference: {self.first_difference}")
        lines.append("identical numerics and bytes" if self.identical else
                     "the runs differ")
        return "\n".join(lines)


def round_seconds(records: list[dict]) -> np.ndarray:
    """Each round's duration: the records' ``time`` is cumulative."""
    times = np.array([r["time"] for r in records], dtype=float)
    return np.diff(times, prepend=0.0)


def settings(run_dir: Path) -> tuple[dict, list[tuple[int, int]], int]:
    """A run directory's training settings (defaults filled in), graph edges and size."""
    data = load_yaml(run_dir / "config.yaml")
    if not isinstance(data.get("train"), dict) or not isinstance(data.get("topology"), dict):
        raise ConfigError(f"{run_dir / 'config.yaml'}: no train and topology sections (not a "
                          f"run directory)")
    train = TrainConfig.from_dict(data["train"], source=str(run_dir)).to_dict()
    topology = Topology.from_dict(data["topology"], source=str(run_dir / "config.yaml"))
    edges = sorted(tuple(sorted(edge)) for edge in topology.graph.edges())
    return train, edges, topology.size


def check_same_settings(real_dir: Path, sim_dir: Path) -> None:
    """ConfigError naming every setting the two runs differ in (UNCOMPARED aside)."""
    (real, real_edges, real_size), (sim, sim_edges, sim_size) = (settings(real_dir),
                                                                 settings(sim_dir))
    differ = [f"{key} {real.get(key)!r} vs {sim.get(key)!r}"
              for key in sorted(set(real) | set(sim))
              if key not in UNCOMPARED and real.get(key) != sim.get(key)]
    if real_size != sim_size:
        differ.append(f"peers {real_size} vs {sim_size}")
    elif real_edges != sim_edges:
        differ.append("the graph's edges")
    if differ:
        raise ConfigError(f"{sim_dir} is not a run of {real_dir}'s settings: "
                          f"{'; '.join(differ)}")


def compare_runs(real_dir: str | Path, sim_dir: str | Path) -> Comparison:
    """Compare every peer's records in two run directories (ConfigError if they do not
    have the same settings, graph, peers and rounds).

    Bytes received are compared at the last round only: a real peer counts a message when
    it reads it, and one of the next round that arrived early is read while it waits for
    another, so where a round's count ends depends on timing; the total does not."""
    real_dir, sim_dir = Path(real_dir), Path(sim_dir)
    check_same_settings(real_dir, sim_dir)
    files = sorted(real_dir.glob("peer-*.jsonl"))
    if not files:
        raise ConfigError(f"{real_dir}: no peer-*.jsonl")
    extra = sorted({p.name for p in sim_dir.glob("peer-*.jsonl")} - {p.name for p in files})
    if extra:
        raise ConfigError(f"{real_dir}: no {extra[0]} (the runs have different peers)")
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
    return Comparison(len(files), rounds, numerics, same_bytes, totals, first, float(np.median(errors)),
                      float(np.percentile(errors, 90)))


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)  # NaN (a round with no mini-batch) equals NaN
