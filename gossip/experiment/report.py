"""The plot step: figures, summary.json and the time-to-target table of a run directory."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from gossip.errors import ConfigError
from gossip.experiment.analysis import SMOOTH, format_rows, load_curve, summarize
from gossip.experiment.overlap import overlap_rows
from gossip.experiment.plots import plot_curves, plot_quality
from gossip.experiment.targets import Target, target_rows
from gossip.experiment.timemodel import model_rows, time_model_alpha
from gossip.metrics import run_dirs


def report(path: str | Path, *, target: float | None = None,
           baselines: Sequence[str] | None = None, smooth: int | None = None,
           echo: Callable[[str], None] = print) -> list[dict]:
    """Plot every run under ``path`` and print its table; returns the table's rows.

    ``target``, ``baselines`` and ``smooth`` default to the experiment file's
    (``path/experiment.yaml``) ``target_loss``, ``baseline`` and ``smooth``; baselines of
    the file that have not run (a partial run) are left out, named ones must exist.
    """
    path = Path(path)
    spec = _experiment_settings(path)
    target = target if target is not None else spec.get("target_loss")
    smooth = smooth or spec.get("smooth") or SMOOTH
    curves = []
    for run_dir in run_dirs(path):
        try:
            curves.append(load_curve(run_dir, smooth=smooth))
        except ConfigError as exc:  # e.g. a run that failed before its first round
            echo(f"skipped: {exc}")
    if not curves:
        raise ConfigError(f"{path}: no run has recorded a round yet")
    names = [c.name for c in curves]
    if baselines:
        for base in baselines:
            if base not in names:
                raise ConfigError(f"--baseline: no run {base!r}; runs: {', '.join(names)}")
    else:
        listed = spec.get("baseline") or ()
        baselines = [b for b in ((listed,) if isinstance(listed, str) else listed)
                     if b in names]
    rows = summarize(curves, target=target, baselines=baselines)
    title = spec.get("name") or path.name
    figures = plot_curves(curves, path, target=target, title=title, smooth=smooth)
    table = format_rows(rows)
    summary = {"target_loss": target, "baselines": list(baselines), "smooth": smooth,
               "runs": rows}
    arms = overlap_rows(run_dirs(path))  # sync vs overlap pairs, if the runs have them
    if arms:
        summary["overlap"] = arms
        table += "\n\nsync vs overlap (medians; time model: gossip/experiment/overlap.py)\n"
        table += format_rows(arms)
    quality = spec.get("target")
    if quality is not None or spec.get("time_model") is not None:
        quality = Target.parse(quality) if quality is not None else None
        alpha = time_model_alpha(spec.get("time_model"))
        if quality is not None:
            summary["target"] = quality.describe()
            summary["to_target"] = target_rows(curves, quality, baselines)
            table += (f"\n\nto the target {quality.describe()} (per arm, medians over seeds; "
                      f"time: training, evaluation excluded; x: the baseline's / this arm's)\n")
            table += format_rows(summary["to_target"])
        summary["time_model"] = model_rows(curves, baselines=baselines, target=quality,
                                           alpha=alpha)
        table += (f"\n\ntime model T = steps x (C + V/B + n alpha), alpha {alpha:g} s "
                  f"(gossip/experiment/timemodel.py)\n")
        table += format_rows(summary["time_model"])
        figures += plot_quality(curves, path, metric=quality.metric if quality else "accuracy",
                                title=title)
    (path / "table.txt").write_text(table + "\n")
    (path / "summary.json").write_text(json.dumps(summary, indent=1))
    echo(table)
    echo("figures: " + ", ".join(str(f) for f in figures))
    return rows


def _experiment_settings(path: Path) -> dict:
    spec = path / "experiment.yaml"
    return (yaml.safe_load(spec.read_text()) or {}) if spec.exists() else {}
