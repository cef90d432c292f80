"""PNG figures of an experiment: loss vs time and bytes, accuracy vs round and bytes,
consensus vs round, for a run whose membership changed (churn) peers vs round; with a
target, its metric vs training time and bytes per setting.

Runs of one family (e.g. ``dpsgd`` and ``nonblocking(dpsgd)``) share a colour; non-blocking
runs are dashed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from gossip.experiment.analysis import Curve

FIGURES = {  # file -> (x attribute, x label, y attribute, y label, log y)
    "loss_vs_time.png": ("time", "wall-clock time (s)", "loss", "training loss", True),
    "loss_vs_bytes.png": ("bytes_sent", "MB sent per peer", "loss", "training loss", True),
    "accuracy_vs_round.png": ("rounds", "round", "accuracy", "test accuracy", False),
    "accuracy_vs_bytes.png": ("bytes_sent", "MB sent per peer", "accuracy", "test accuracy",
                              False),
    "accuracy_vs_time.png": ("train_time", "training time (s, evaluation excluded)",
                             "accuracy", "test accuracy", False),
    "consensus_vs_round.png": ("rounds", "round", "consensus",
                               "consensus distance (mean squared)", True),
}
#: Drawn only when some run's peers changed over its rounds (``gossip launch --churn``).
MEMBERSHIP = {"peers_vs_round.png": ("rounds", "round", "peers", "peers running", False)}


def plot_curves(curves: Sequence[Curve], out: Path, *, target: float | None = None,
                title: str = "", smooth: int = 1) -> list[Path]:
    """Write the FIGURES for ``curves`` into ``out``; returns their paths."""
    paths = []
    churned = any(len(set(c.peers.tolist())) > 1 for c in curves)
    for name, (x_attr, x_label, y_attr, y_label, log_y) in (
            {**FIGURES, **MEMBERSHIP} if churned else FIGURES).items():
        def x_of(c, x_attr=x_attr):
            return getattr(c, x_attr) / (1e6 if x_attr == "bytes_sent" else 1)

        def y_of(c, y_attr=y_attr):
            return getattr(c, y_attr)

        label = y_label + (f" (moving average of {smooth} rounds)"
                           if y_attr == "loss" and smooth > 1 else "")
        paths.append(_figure(curves, Path(out) / name, x_of, y_of, x_label, label,
                             log_y=log_y, log_x=x_attr == "bytes_sent"
                             and _spread([c.bytes_sent[-1] for c in curves]) > 10,
                             positive=y_attr == "consensus",
                             target=target if y_attr == "loss" else None,
                             title=f"{title}: {y_label} vs {x_label}" if title
                             else f"{y_label} vs {x_label}"))
    return paths


def plot_quality(curves: Sequence[Curve], out: Path, metrics: Mapping[str, str], *,
                 levels: Mapping[str, float | None] | None = None,
                 title: str = "") -> list[Path]:
    """Each setting's (task, peers, link rate) target metric (``metrics``: run name ->
    metric, a key of ``Curve.values``) vs training time (evaluation excluded) and vs bytes,
    ``METRIC_vs_time-N-TASK-RATE.png``, with its target level (``levels``: run name ->
    level) as a line; returns their paths. None where FIGURES has drawn them (accuracy,
    one setting)."""
    from gossip.experiment.targets import setting

    groups: dict[str, list[Curve]] = {}
    for c in curves:
        if metrics.get(c.name) in c.values:
            groups.setdefault(setting(c), []).append(c)
    if len(groups) == 1 and {metrics[c.name] for c in curves if c.name in metrics} \
            == {"accuracy"}:
        return []
    paths = []
    for index, group in enumerate(groups.values()):
        metric = metrics[group[0].name]
        train, rate = group[0].config.get("train", {}), (group[0].config.get("netns") or {})
        what = "-".join(str(x) for x in (train.get("task"), rate.get("rate")) if x)
        heading = f"{title} {what}".strip()
        for x_name, x_of, x_label in (
                ("time", lambda c: c.train_time, "training time (s, evaluation excluded)"),
                ("bytes", lambda c: c.bytes_sent / 1e6, "MB sent per peer")):
            paths.append(_figure(
                group, Path(out) / f"{metric}_vs_{x_name}-{index}-{what}.png", x_of,
                lambda c, metric=metric: c.values[metric], x_label, metric, log_y=False,
                log_x=x_name == "bytes" and _spread([c.bytes_sent[-1] for c in group]) > 10,
                target=(levels or {}).get(group[0].name),
                title=f"{heading}: {metric} vs {x_label}"))
    return paths


def _figure(curves: Sequence[Curve], path: Path, x_of, y_of, x_label: str, y_label: str, *,
            log_y: bool, log_x: bool, positive: bool = False, target: float | None = None,
            title: str) -> Path:
    """One figure: a line per curve, its family's colour (non-blocking dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    colours = plt.get_cmap("tab10").colors
    families = list(dict.fromkeys(c.family for c in curves))
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for c in curves:
        x, y = x_of(c), y_of(c)
        measured = np.isfinite(y)  # scores every test_every rounds, consensus eval_every
        if positive:  # 0 has no log
            measured &= y > 0
        x, y = x[measured], y[measured]
        ax.plot(x, y, label=c.name, color=colours[families.index(c.family) % len(colours)],
                linestyle="--" if c.nonblocking else "-", linewidth=1.6)
    if target is not None:
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.annotate(f"target {target:g}", (0.99, target), xycoords=("axes fraction", "data"),
                    ha="right", va="bottom", fontsize=8, color="grey")
    if log_x:  # compressed runs send 10-100x less: on a linear axis they hug x = 0
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(_sparse))
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _spread(totals: Sequence[float]) -> float:
    """Largest over smallest positive total (1 if there are none)."""
    positive = [float(t) for t in totals if t > 0]
    return max(positive) / min(positive) if positive else 1.0


def _plain(value: float, _position=None) -> str:
    """0.05, not 5x10^-2."""
    return f"{value:g}"


def _sparse(value: float, _position=None) -> str:
    """Label the minor ticks 2 and 5 of a decade only, so they do not overlap."""
    if value <= 0:
        return ""
    leading = round(value / 10 ** math.floor(math.log10(value)), 6)
    return f"{value:g}" if leading in (2, 5) else ""
