"""The crossover experiment file and its runner: points (a setting of the jobs), each run in
several arms (how the jobs share the devices), repeated and interleaved.

```yaml
name: crossover
peers: 4                     # every job's, on a ring
netns: {rate: 100mbit}       # the virtual cluster (root); null: plain local peers
repeats: 3
drop: 3                      # first rounds left out of the counts
slice_s: 0.01                # naive arm: the device's time slice
train: {task: digits-wide, rounds: 30, delays: {compute: 0.1}}
jobs: [a, b]                 # names; every job trains the same config and seed
points:
  - {name: dpsgd, train: {strategy: dpsgd}, arms: [sequential, naive, crossover, fifo]}
  - {name: dpsgd-m0, train: {strategy: dpsgd}, netns: {rate: 10gbit}, arms: [...]}
```

Arms: ``sequential`` (each job alone, one after the other), ``naive`` (at once, device time
sliced under a lock file), ``crossover`` (at once, turns), ``fifo`` (at once, first come
first served). Output: ``OUT/POINT/ARM/rep-K/`` as ``launch_jobs`` writes it; the sequential
arm's jobs in ``OUT/POINT/sequential/rep-K/alone-JOB/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gossip.cluster.rate import DEFAULT_RATE
from gossip.config import TrainConfig, load_yaml
from gossip.crossover.jobs import Job, launch_jobs
from gossip.errors import ConfigError, GossipError
from gossip.experiment.spec import check_fields  # the same check as experiment files
from gossip.launching.forkserver import Zygote
from gossip.launching.processes import LaunchFailed

ARMS = {"sequential": "crossover", "naive": "slices", "crossover": "crossover", "fifo": "fifo"}
_TOP = ("name", "description", "peers", "netns", "repeats", "drop", "slice_s", "train", "jobs",
        "points")
_POINT = ("name", "train", "netns", "arms")


@dataclass(frozen=True)
class Point:
    name: str
    config: TrainConfig
    rate: str | None
    arms: tuple[str, ...]


@dataclass(frozen=True)
class CrossoverExperiment:
    name: str
    peers: int
    jobs: tuple[str, ...]
    repeats: int
    drop: int
    slice_s: float
    points: tuple[Point, ...]
    source: Mapping[str, Any]


def load_crossover(path: str | Path) -> CrossoverExperiment:
    """Parse and check an experiment file; errors name the file and the field."""
    data, source = load_yaml(path), str(path)
    check_fields(data, _TOP, source)
    train = data.get("train") or {}
    peers = _positive(data.get("peers", 4), "peers", source)
    jobs = data.get("jobs", ["a", "b"])
    if not isinstance(jobs, list) or len(jobs) < 1 or len(set(map(str, jobs))) != len(jobs):
        raise ConfigError(f"{source}: jobs: expected a list of distinct names")
    points = []
    for index, item in enumerate(data.get("points") or []):
        where = f"{source}: points[{index}]"
        check_fields(item, _POINT, where)
        merged = {**train, **(item.get("train") or {})}
        if isinstance(train.get("delays"), Mapping) and "delays" in (item.get("train") or {}):
            merged["delays"] = {**train["delays"], **item["train"]["delays"]}
        netns = item.get("netns", data.get("netns"))
        arms = tuple(item.get("arms") or ARMS)
        for arm in arms:
            if arm not in ARMS:
                raise ConfigError(f"{where}: arms: {arm!r} is not one of {', '.join(ARMS)}")
        if "sequential" not in arms:
            raise ConfigError(f"{where}: arms: the sequential arm is the baseline; add it")
        points.append(Point(str(item.get("name", f"point{index}")),
                            TrainConfig.from_dict(merged, source=where),
                            None if netns is None else str(netns.get("rate", DEFAULT_RATE)), arms))
    if not points:
        raise ConfigError(f"{source}: points: expected a non-empty list")
    slice_s = data.get("slice_s", 0.01)
    if not isinstance(slice_s, (int, float)) or not slice_s > 0:
        raise ConfigError(f"{source}: slice_s: expected a positive number, got {slice_s!r}")
    return CrossoverExperiment(
        name=str(data.get("name") or Path(path).stem), peers=peers,
        jobs=tuple(map(str, jobs)), repeats=_positive(data.get("repeats", 3), "repeats", source),
        drop=_positive(data.get("drop", 3), "drop", source, zero=True),
        slice_s=float(slice_s), points=tuple(points), source=dict(data))


def run_crossover(spec: CrossoverExperiment, out: Path, *, echo: Callable[[str], None] = print,
                  zygote: Zygote | None = None) -> list[str]:
    """Every point in every arm, ``repeats`` times, arms interleaved; returns what failed.
    With ``zygote`` (30-40 launches) peers are forked from it, not each importing torch."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(yaml.safe_dump(dict(spec.source), sort_keys=False))
    failed = []
    for rep in range(spec.repeats):
        for point in spec.points:
            for arm in point.arms:
                where = out / point.name / arm / f"rep-{rep}"
                jobs = _jobs(spec, point)
                groups = ([([job], where / f"alone-{job.name}") for job in jobs]
                          if arm == "sequential" else [(jobs, where)])
                try:
                    seconds = sum(launch_jobs(group, run_dir, mode=ARMS[arm], rate=point.rate,
                                              slice_s=spec.slice_s, zygote=zygote)
                                  for group, run_dir in groups)
                except (LaunchFailed, GossipError) as exc:
                    echo(f"{point.name} {arm} rep {rep} failed: {exc}; logs in {where}")
                    failed.append(f"{point.name}/{arm}/rep-{rep}")
                else:
                    echo(f"{point.name} {arm} rep {rep}: {seconds:.1f} s")
    return failed


def _jobs(spec: CrossoverExperiment, point: Point) -> list[Job]:
    """The point's jobs on one ring each, on ports of their own."""
    from gossip.ports import free_ports
    from gossip.topology import Topology

    ring = Topology.generate("ring", spec.peers)
    ports = free_ports(spec.peers * len(spec.jobs))
    return [Job(name, point.config,
                ring.relocated(ports=ports[k * spec.peers:(k + 1) * spec.peers]))
            for k, name in enumerate(spec.jobs)]


def _positive(value: Any, name: str, source: str, *, zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ConfigError(f"{source}: {name}: expected a {'non-negative' if zero else 'positive'}"
                          f" integer, got {value!r}")
    return value

