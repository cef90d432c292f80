"""The scaling table of a simulated experiment (`gossip sim-scaling`): time per iteration and
scaling efficiency per strategy and P, each point marked validated or extrapolated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from gossip.errors import ConfigError
from gossip.metrics import read_jsonl, run_dirs
from gossip.sim.compare import round_seconds

# Simulated runs of this many peers or fewer were checked against real runs (bitwise
# numerics and bytes: tests/integration/test_simulation.py, experiments/sim-validation.yaml).
VALIDATED_UP_TO = 8


def scaling_rows(path: str | Path) -> list[dict]:
    """One row per run: strategy, P, median seconds per iteration (over peers and rounds,
    the first round left out), median compute seconds, efficiency = compute / iteration
    (the gTop-k paper's: throughput on P peers over P times one peer's), and whether P was
    validated against real runs."""
    rows = []
    for run_dir in _scaling_dirs(Path(path)):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        if (run_dir / "sizes.json").exists():
            rows.append(_sizes_row(run_dir, config))
            continue
        records = [read_jsonl(p) for p in sorted(run_dir.glob("peer-*.jsonl"))]
        records = [r for r in records if r]
        if not records:
            continue
        # The first round also builds what later rounds reuse: left out when there are more.
        per_round = np.concatenate([_after_first(round_seconds(r)) for r in records])
        compute = np.median([line["compute_s"] for r in records for line in _after_first(r)])
        iteration = float(np.median(per_round))
        size = len(config["ranks"])
        rows.append({"run": config.get("run", run_dir.name),
                     "strategy": config["train"]["strategy"], "peers": size,
                     "iteration_s": iteration, "compute_s": float(compute),
                     "efficiency": float(compute) / iteration if iteration > 0 else float("nan"),
                     "point": ("real run" if "simulate" not in config else "validated"
                               if size <= VALIDATED_UP_TO else "extrapolation")})
    if not rows:
        raise ConfigError(f"{path}: no run has recorded a round yet")
    return sorted(rows, key=lambda row: (row["strategy"], row["peers"]))


def _scaling_dirs(path: Path) -> list[Path]:
    """Run directories with peer records (``run_dirs``), then those of sizes-only runs."""
    if (path / "sizes.json").exists():
        return [path]
    sizes = sorted(d for d in path.iterdir() if (d / "sizes.json").exists()) \
        if path.is_dir() else []
    try:
        return run_dirs(path) + sizes
    except ConfigError:
        if not sizes:
            raise
        return sizes


def _sizes_row(run_dir: Path, config: dict) -> dict:
    """The row of a sizes-only run (gossip/sim/sizes.py): its summary, every round."""
    summary = json.loads((run_dir / "sizes.json").read_text())
    iteration, compute = summary["median_round_s"], summary["median_compute_s"]
    return {"run": config.get("run", run_dir.name), "strategy": config["train"]["strategy"],
            "peers": summary["peers"], "iteration_s": iteration, "compute_s": compute,
            "efficiency": compute / iteration if iteration > 0 else float("nan"),
            "point": ("validated" if summary["peers"] <= VALIDATED_UP_TO else "extrapolation")
                      + " (sizes only)"}


def _after_first(items):
    return items[1:] if len(items) > 1 else items


def format_scaling(rows: list[dict]) -> str:
    lines = ["| run | strategy | P | s / iteration | compute s | efficiency | point |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['run']} | {row['strategy']} | {row['peers']} | "
                     f"{row['iteration_s']:.4g} | {row['compute_s']:.4g} | "
                     f"{row['efficiency']:.3f} | {row['point']} |")
    return "\n".join(lines)


def plot_scaling(rows: list[dict], out: Path) -> Path:
    """Time per iteration and efficiency vs P, one line per strategy (log-2 P axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in sorted({row["strategy"] for row in rows}):
        mine = [row for row in rows if row["strategy"] == strategy]
        sizes = [row["peers"] for row in mine]
        left.plot(sizes, [row["iteration_s"] for row in mine], marker="o", label=strategy)
        right.plot(sizes, [row["efficiency"] for row in mine], marker="o", label=strategy)
    for axis, label in ((left, "seconds per iteration"), (right, "scaling efficiency")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("peers P (simulated; > 8: extrapolation)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    left.legend()
    fig.tight_layout()
    path = out / "scaling.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
