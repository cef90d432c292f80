"""Fit the network model's per-message and per-byte costs on real runs, then predict others
(`gossip sim-fit`): the timing half of the simulator's validation.

A real run in the netns cluster spends time the link model alone does not explain: the
sender's CPU per message (encoding, the socket, the kernel) and per byte (copies). The
network model charges them as ``message_s + bytes * byte_s`` before a message leaves
(gossip/sim/network.py). Near the truth the median round time is linear in the two, so
three simulations of each fitting run, at zero cost and at one probe value of each, give
its slopes; a least-squares fit (costs kept >= 0) on two or more fitting runs with
different message sizes separates them. Every other run is then simulated with the fitted
costs and compared with its real twin round by round (``compare_runs``): the prediction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.metrics import read_jsonl
from gossip.sim.clock import parse_compute
from gossip.sim.compare import Comparison, compare_runs, round_seconds
from gossip.sim.network import NetworkModel
from gossip.sim.runner import Simulation, simulate_run
from gossip.topology import Topology

PROBE_MESSAGE_S = 0.005  # large enough that the slope stands out of measured-CPU noise
PROBE_BYTE_S = 1e-8  # 100 MB/s of copying


@dataclass(frozen=True)
class RealRun:
    """A real run directory read back as what its simulation needs."""

    name: str
    path: Path
    config: TrainConfig
    topology: Topology
    rate: str

    @classmethod
    def read(cls, path: str | Path) -> RealRun:
        path = Path(path)
        config_file = path / "config.yaml"
        if not config_file.exists():
            raise ConfigError(f"{path}: no config.yaml (not a run directory)")
        data = yaml.safe_load(config_file.read_text()) or {}
        if data.get("simulate"):
            raise ConfigError(f"{path}: a simulated run; fit on real ones")
        rate = (data.get("netns") or {}).get("rate")
        if rate is None:
            raise ConfigError(f"{path}: not run in the virtual cluster (no netns rate): its "
                              f"links were not capped, so no network model describes them")
        topology = Topology.from_dict(data["topology"], source=str(config_file))
        return cls(path.name, path, TrainConfig.from_dict(data["train"], source=str(path)),
                   topology, str(rate))

    def median_round_s(self) -> float:
        return _median_round_s(self.path)

    def simulate(self, out: Path, network: NetworkModel, compute: str) -> Path:
        run_dir = out / self.name
        result = simulate_run(self.config, self.topology, run_dir,
                              Simulation(network=network, compute=parse_compute(compute)))
        if result.failed:
            raise ConfigError(f"{self.name}: simulated peers failed: {result.failed}")
        return run_dir


@dataclass(frozen=True)
class Fit:
    message_s: float
    byte_s: float
    fitted_on: list[str]


def fit_costs(runs: Sequence[RealRun], work: Path, *, base: NetworkModel,
              compute: str) -> Fit:
    """Least-squares ``message_s``, ``byte_s`` (>= 0) matching the runs' median round times."""
    rows, targets = [], []
    for run in runs:
        def median(message_s: float, byte_s: float, tag: str) -> float:
            network = replace(base, rate=run.rate, message_s=message_s, byte_s=byte_s)
            return _median_round_s(run.simulate(work / tag, network, compute))

        zero = median(0.0, 0.0, "probe-zero")
        rows.append([(median(PROBE_MESSAGE_S, 0.0, "probe-message") - zero) / PROBE_MESSAGE_S,
                     (median(0.0, PROBE_BYTE_S, "probe-byte") - zero) / PROBE_BYTE_S])
        targets.append(run.median_round_s() - zero)
    a, y = np.array(rows), np.array(targets)
    best = min((_lstsq(a[:, keep], y, keep) for keep in ([0, 1], [0], [1])),
               key=lambda fit: np.sum((a @ fit - y) ** 2))
    return Fit(float(best[0]), float(best[1]), [run.name for run in runs])


def _lstsq(a: np.ndarray, y: np.ndarray, keep: list[int]) -> np.ndarray:
    """Least squares on the columns ``keep`` (the others 0), negative solutions clipped."""
    solution = np.zeros(2)
    solution[keep] = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None)
    return solution


def predict(runs: Sequence[RealRun], fit: Fit, out: Path, *, base: NetworkModel,
            compute: str) -> list[dict[str, Any]]:
    """Simulate every run with the fitted costs; one row of errors per run."""
    rows = []
    for run in runs:
        network = replace(base, rate=run.rate, message_s=fit.message_s, byte_s=fit.byte_s)
        comparison: Comparison = compare_runs(run.path, run.simulate(out, network, compute))
        rows.append({"run": run.name, "rate": run.rate, "role": (
            "fit" if run.name in fit.fitted_on else "predicted"),
            "real round s": run.median_round_s(),
            "sim round s": _median_round_s(out / run.name),
            "median error": comparison.time_error_median, "p90 error": comparison.time_error_p90,
            "bytes equal": comparison.bytes_equal == comparison.rounds})
    return rows


def write_report(out: Path, fit: Fit, rows: list[dict[str, Any]]) -> Path:
    path = out / "fit.json"
    path.write_text(json.dumps({"message_s": fit.message_s, "byte_s": fit.byte_s,
                                "fitted_on": fit.fitted_on, "runs": rows}, indent=1))
    return path


def _median_round_s(run_dir: Path) -> float:
    """Median over a run's peers and rounds of a round's seconds (the first round left out:
    start-up and the first connections)."""
    seconds = [round_seconds(read_jsonl(path))[1:] for path in run_dir.glob("peer-*.jsonl")]
    return float(np.median(np.concatenate(seconds)))
