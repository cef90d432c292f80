"""What a crossover experiment measured: per point and arm, aggregate samples/s, speed-up
over the sequential arm, each job's slowdown against running alone, fairness, device
utilization; whether every job's losses are those of its solo run; the table and
summary.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from gossip.errors import ConfigError
from gossip.metrics import read_jsonl


def job_records(job_dir: Path, drop: int) -> list[dict[str, Any]]:
    """The counted records (round >= ``drop``) of every peer of one job."""
    return [r for path in sorted(job_dir.glob("peer-*.jsonl")) for r in read_jsonl(path)
            if r["round"] >= drop]


def span(records: list[dict[str, Any]]) -> float:
    """From the first counted round's start to the last counted round's end."""
    return max(r["wall"] for r in records) - min(r["round_start_wall"] for r in records)


def measure(launch_dirs: list[Path], jobs: list[str], drop: int) -> dict[str, Any]:
    """One repeat of one arm: its launches (the sequential arm has one per job, their spans
    added) and per job: samples, span, losses."""
    per_job, makespan, holds, devices = {}, 0.0, 0.0, 0
    for launch_dir in launch_dirs:
        present = [j for j in jobs if (launch_dir / j).is_dir()]
        records = {j: job_records(launch_dir / j, drop) for j in present}
        makespan += span([r for rs in records.values() for r in rs])
        for job, rs in records.items():
            per_job[job] = {"samples": sum(r["samples"] for r in rs), "span_s": span(rs),
                            "losses": sorted((r["round"], r["loss"]) for r in rs),
                            "hold_s": statistics.median(r["device_hold_s"] for r in rs),
                            "comm_s": statistics.median(r["comm_s"] for r in rs)}
            holds += sum(r["device_hold_s"] for r in rs)
            devices = max(devices, len({p.name for p in (launch_dir / job).glob("peer-*.jsonl")}))
    samples = sum(j["samples"] for j in per_job.values())
    return {"samples": samples, "makespan_s": makespan, "throughput": samples / makespan,
            "utilization": holds / (makespan * devices), "jobs": per_job}


def summarize(out: Path, spec) -> dict[str, Any]:
    """summary.json's content: per point and arm, medians over the repeats."""
    summary: dict[str, Any] = {}
    for point in spec.points:
        reps = {}
        for arm in point.arms:
            for rep_dir in sorted((out / point.name / arm).glob("rep-*")):
                dirs = sorted(rep_dir.glob("alone-*")) if arm == "sequential" else [rep_dir]
                try:
                    reps.setdefault(arm, {})[rep_dir.name] = measure(dirs, list(spec.jobs),
                                                                     spec.drop)
                except (ConfigError, ValueError, KeyError, FileNotFoundError):
                    continue  # a failed repeat: left out
        alone = reps.get("sequential", {})
        rows = {}
        for arm, by_rep in reps.items():
            common = [rep for rep in by_rep if rep in alone]
            slowdown = {job: _median([by_rep[rep]["jobs"][job]["span_s"]
                                      / alone[rep]["jobs"][job]["span_s"] for rep in common])
                        for job in spec.jobs}
            fairness = _median([_jain([alone[rep]["jobs"][j]["span_s"]
                                       / by_rep[rep]["jobs"][j]["span_s"] for j in spec.jobs])
                                for rep in common])
            rows[arm] = {
                "throughput": _median([m["throughput"] for m in by_rep.values()]),
                "speedup": _median([by_rep[rep]["throughput"] / alone[rep]["throughput"]
                                    for rep in common]),
                "slowdown": slowdown, "fairness": fairness,
                "utilization": _median([m["utilization"] for m in by_rep.values()]),
                "same_losses_as_alone": all(by_rep[rep]["jobs"][j]["losses"]
                                            == alone[rep]["jobs"][j]["losses"]
                                            for rep in common for j in spec.jobs),
                "repeats": len(by_rep),
                "per_repeat": {rep: {k: v for k, v in m.items() if k != "jobs"}
                               for rep, m in by_rep.items()}}
        c = _median([m["jobs"][j]["hold_s"] for m in alone.values() for j in spec.jobs])
        m_ = _median([m["jobs"][j]["comm_s"] for m in alone.values() for j in spec.jobs])
        summary[point.name] = {"compute_s": c, "comm_s": m_,
                               "law": (c + m_) / max(c, m_) if c and m_ else None,
                               "arms": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def table(summary: dict[str, Any]) -> str:
    """One line per point and arm."""
    lines = [f"{'point':<16} {'arm':<11} {'samples/s':>9} {'speedup':>7} {'slowdown':>13} "
             f"{'fair':>5} {'util':>5} {'law':>5} {'C s':>5} {'M s':>5} same"]
    for name, point in summary.items():
        for arm, row in point["arms"].items():
            slow = "/".join(_fmt(v) for v in row["slowdown"].values())
            lines.append(f"{name:<16} {arm:<11} {_fmt(row['throughput'], 1):>9} "
                         f"{_fmt(row['speedup']):>7} {slow:>13} {_fmt(row['fairness']):>5} "
                         f"{_fmt(row['utilization']):>5} {_fmt(point['law']):>5} "
                         f"{_fmt(point['compute_s'], 3):>5} {_fmt(point['comm_s'], 3):>5} "
                         f"{'yes' if row['same_losses_as_alone'] else 'NO'}")
    return "\n".join(lines)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _jain(x: list[float]) -> float:
    """Jain's fairness index: 1 when every job is slowed down alike."""
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
