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
from gossip.experiment.targets import arms, run_targets, target_rows
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
    if spec.get("target") is not None or spec.get("time_model") is not None \
            or run_targets(spec):
        text, extra, figures_more = quality_tables(curves, spec, baselines, path, title)
        table += text
        summary.update(extra)
        figures += figures_more
    (path / "table.txt").write_text(table + "\n")
    (path / "summary.json").write_text(json.dumps(summary, indent=1))
    echo(table)
    echo("figures: " + ", ".join(str(f) for f in figures))
    return rows


def quality_tables(curves: Sequence, spec: dict, baselines: Sequence[str], path: Path,
                   title: str) -> tuple[str, dict, list[Path]]:
    """The time-to-target tables (one per target the runs name), the time model's table and
    the target metrics' figures: (text, summary.json entries, figure paths)."""
    targets = run_targets(spec, str(path / "experiment.yaml"))
    alpha = time_model_alpha(spec.get("time_model"))
    by_target: dict = {}
    for c in curves:
        by_target.setdefault(targets.get(c.name), []).append(c)
    text, extra, model, levels = "", {"to_target": {}}, [], {}
    for target, group in by_target.items():
        model += model_rows(group, baselines=baselines, target=target, alpha=alpha)
        if target is None:
            continue
        rows = target_rows(group, target, baselines)
        for arm, row in zip(arms(group), rows):  # rows come in arms' order
            levels.update({c.name: row["level"] for c in arm})
        extra["to_target"][target.describe()] = rows
        text += (f"\n\nto the target {target.describe()} (per arm, medians over seeds; time: "
                 f"training, evaluation excluded; x: the baseline's / this arm's)\n")
        text += format_rows(rows)
    extra["time_model"] = model
    figures = plot_quality(curves, path, {name: t.metric for name, t in targets.items()},
                           levels=levels, title=title)
    text += (f"\n\ntime model T = steps x (C + V/B + n alpha), alpha {alpha:g} s "
             f"(gossip/experiment/timemodel.py)\n")
    return text + format_rows(model), extra, figures


def _experiment_settings(path: Path) -> dict:
    spec = path / "experiment.yaml"
    return (yaml.safe_load(spec.read_text()) or {}) if spec.exists() else {}
