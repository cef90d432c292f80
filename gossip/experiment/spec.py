"""The experiment file: shared settings plus a list of runs, each a TrainConfig override.

```yaml
name: stragglers
peers: 8                      # or topology: FILE (a topology YAML)
graph: ring                   # or {kind: torus, rows: 2, cols: 4}
netns: {rate: 100mbit}        # optional: bandwidth-capped virtual cluster (root)
simulate: true                # optional: simulated in virtual time (gossip simulate), or
                              # {rate, latency, sharing, compute, probe, kills, ...}
target_loss: 0.3              # for the time-to-target table
target: {metric: accuracy, fraction: 0.95}   # optional: time and bytes to a quality, per
                              # arm (seeds alike), vs the baseline of its setting; a run may
                              # give its own (targets.py)
time_model: {alpha: 0.0001}   # optional: per-message latency of the time model (timemodel.py)
baseline: dpsgd               # run name(s) the speed-ups are relative to
smooth: 10                    # rounds in the loss moving average
train: {rounds: 200, batch_size: 64, minibatches: 8, delays: {...}}
runs:
  - {name: dpsgd, strategy: dpsgd}
  - {name: nb-dpsgd, strategy: nonblocking, options: {inner: dpsgd}, delays: {compute: 0.01}}
```

A run may set any ``train`` key, ``target`` (``delays`` is merged key by key, everything else replaced)
and ``peers``, ``graph``, ``topology``, ``netns`` (``netns: null`` runs it uncapped) or
``simulate`` (``simulate: false`` runs it for real).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossip.cluster.rate import DEFAULT_RATE
from gossip.config import TrainConfig, load_yaml
from gossip.errors import ConfigError
from gossip.experiment.analysis import SMOOTH
from gossip.experiment.targets import Target, run_targets
from gossip.experiment.timemodel import time_model_alpha

_TOP = ("name", "description", "peers", "graph", "topology", "netns", "simulate",
        "target_loss", "target", "time_model", "baseline", "smooth", "train", "runs")
_PLACEMENT = ("peers", "graph", "topology", "netns", "simulate")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Run:
    """One run of an experiment: where its peers are and what they train."""

    name: str
    config: TrainConfig
    peers: int
    graph: Mapping[str, Any]  # {"kind": ..., **generator parameters}
    topology: Path | None  # a topology file instead of peers + graph
    rate: str | None  # link cap of the netns virtual cluster, None: plain local peers
    simulation: Any = None  # a gossip.sim.Simulation: run in virtual time instead


@dataclass(frozen=True)
class Experiment:
    """A parsed experiment file."""

    name: str
    runs: tuple[Run, ...]
    target_loss: float | None
    baselines: tuple[str, ...]
    smooth: int
    source: Mapping[str, Any]  # the file's mapping, copied into the output directory
    targets: Mapping[str, Target] = field(default_factory=dict)  # per run (targets.py)
    alpha: float = 0.0  # the time model's per-message latency (timemodel.py)

    def run(self, name: str) -> Run:
        for run in self.runs:
            if run.name == name:
                return run
        raise ConfigError(f"no run {name!r}; runs: {', '.join(r.name for r in self.runs)}")


def load_experiment(path: str | Path) -> Experiment:
    """Parse and validate an experiment file; errors name the file and the field."""
    return parse_experiment(load_yaml(path), source=str(path), base_dir=Path(path).parent)


def parse_experiment(data: Mapping[str, Any], *, source: str = "experiment",
                     base_dir: Path = Path(".")) -> Experiment:
    check_fields(data, _TOP, source)
    runs_data = data.get("runs")
    if not isinstance(runs_data, list) or not runs_data:
        raise ConfigError(f"{source}: runs: expected a non-empty list of runs")
    train = data.get("train") or {}
    if not isinstance(train, Mapping):
        raise ConfigError(f"{source}: train: expected a mapping")
    runs, names = [], set()
    for index, item in enumerate(runs_data):
        where = f"{source}: runs[{index}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where}: expected a mapping with a name")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}: name: {name!r} is not a name of letters, digits, "
                              f"'.', '_' or '-'")
        if name in names:
            raise ConfigError(f"{where}: name: duplicate run {name!r}")
        names.add(name)
        runs.append(_run(name, data, train, item, f"{source}: runs[{index}] ({name})", base_dir))
    baselines = data.get("baseline") or ()
    baselines = (baselines,) if isinstance(baselines, str) else tuple(baselines)
    for baseline in baselines:
        if baseline not in names:
            raise ConfigError(f"{source}: baseline: no run {baseline!r}; runs: "
                              f"{', '.join(names)}")
    target = data.get("target_loss")
    if target is not None and (not isinstance(target, (int, float)) or isinstance(target, bool)
                               or target <= 0):
        raise ConfigError(f"{source}: target_loss: expected a positive number, got {target!r}")
    smooth = data.get("smooth", SMOOTH)
    if not isinstance(smooth, int) or isinstance(smooth, bool) or smooth < 1:
        raise ConfigError(f"{source}: smooth: expected a positive integer, got {smooth!r}")
    name = data.get("name") or Path(source).stem
    return Experiment(name=str(name), runs=tuple(runs),
                      target_loss=None if target is None else float(target),
                      baselines=baselines, smooth=smooth, source=dict(data),
                      targets=run_targets(data, source),
                      alpha=time_model_alpha(data.get("time_model"), f"{source}: time_model"))


def _run(name: str, top: Mapping[str, Any], train: Mapping[str, Any], item: Mapping[str, Any],
         where: str, base_dir: Path) -> Run:
    fields = list(TrainConfig.__dataclass_fields__)
    check_fields(item, ("name", "target", *_PLACEMENT, *fields), where)
    merged = dict(train)
    for key, value in item.items():
        if key in fields:
            merged[key] = value
    if "delays" in item and isinstance(train.get("delays"), Mapping) \
            and isinstance(item["delays"], Mapping):
        merged["delays"] = {**train["delays"], **item["delays"]}
    config = TrainConfig.from_dict(merged, source=where)
    place = {key: item.get(key, top.get(key)) for key in _PLACEMENT}
    topology = None
    if place["topology"] is not None:
        topology = Path(place["topology"])
        topology = topology if topology.is_absolute() else base_dir / topology
    peers = place["peers"] if place["peers"] is not None else 4
    if not isinstance(peers, int) or isinstance(peers, bool) or peers < 1:
        raise ConfigError(f"{where}: peers: expected a positive integer, got {peers!r}")
    graph = place["graph"] if place["graph"] is not None else "ring"
    graph = {"kind": graph} if isinstance(graph, str) else graph
    if not isinstance(graph, Mapping) or not isinstance(graph.get("kind"), str):
        raise ConfigError(f"{where}: graph: expected a kind (ring, torus, ...) or a mapping "
                          f"with one, got {graph!r}")
    netns = place["netns"]
    rate = None
    if netns is not None:
        if not isinstance(netns, Mapping) or set(netns) - {"rate"}:
            raise ConfigError(f"{where}: netns: expected {{rate: 100mbit}} or null, got {netns!r}")
        rate = str(netns.get("rate", DEFAULT_RATE))
    simulation = None
    if place["simulate"] not in (None, False):
        from gossip.sim import Simulation

        try:
            simulation = Simulation.from_dict(place["simulate"], rate=rate)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return Run(name=name, config=config, peers=peers, graph=dict(graph), topology=topology,
               rate=rate, simulation=simulation)


def check_fields(data: Any, allowed, where: str) -> None:
    """``data`` is a mapping of ``allowed`` fields only (ConfigError at ``where`` naming the
    field, else): experiment files' check, and crossover experiment files'."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown field {key!r}; fields: {', '.join(allowed)}")
