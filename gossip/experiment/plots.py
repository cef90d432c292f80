"""PNG figures of an experiment: loss vs time and bytes, accuracy vs round and bytes,
consensus vs round, and for a run whose membership changed (churn) peers vs round.

Runs of one family (e.g. ``dpsgd`` and ``nonblocking(dpsgd)``) share a colour; non-blocking
runs are dashed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from gossip.experiment.analysis import Curve

FIGURES = {  # file -> (x attribute, x label, y attribute, y label, log y)
    "loss_vs_time.png": ("time", "wall-clock time (s)", "loss", "training loss", True),
    "loss_vs_bytes.png": ("bytes_sent", "MB sent per peer", "loss", "training loss", True),
    "accuracy_vs_round.png": ("rounds", "round", "accuracy", "test accuracy", False),
    "accuracy_vs_bytes.png": ("bytes_sent", "MB sent per peer", "accuracy", "test accuracy",
                              False),
    "consensus_vs_round.png": ("rounds", "round", "consensus",
                               "consensus distance (mean squared)", True),
}
#: Drawn only when some run's peers changed over its rounds (``gossip launch --churn``).
MEMBERSHIP = {"peers_vs_round.png": ("rounds", "round", "peers", "peers running", False)}


def plot_curves(curves: Sequence[Curve], out: Path, *, target: float | None = None,
                title: str = "", smooth: int = 1) -> list[Path]:
    """Write the FIGURES for ``curves`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    colours = plt.get_cmap("tab10").colors
    families = list(dict.fromkeys(c.family for c in curves))
    paths = []
    churned = any(len(set(c.peers.tolist())) > 1 for c in curves)
    for name, (x_attr, x_label, y_attr, y_label, log_y) in (
            {**FIGURES, **MEMBERSHIP} if churned else FIGURES).items():
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
        for c in curves:
            x = getattr(c, x_attr) / (1e6 if x_attr == "bytes_sent" else 1)
            y = getattr(c, y_attr)
            if y_attr == "consensus":  # measured every eval_every rounds; 0 has no log
                x, y = x[y > 0], y[y > 0]
            ax.plot(x, y, label=c.name,
                    color=colours[families.index(c.family) % len(colours)],
                    linestyle="--" if c.nonblocking else "-", linewidth=1.6)
        if y_attr == "loss" and target is not None:
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"target {target:g}", (0.99, target), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", fontsize=8, color="grey")
        if x_attr == "bytes_sent" and _spread([c.bytes_sent[-1] for c in curves]) > 10:
            # compressed runs send 10-100x less: on a linear axis they hug x = 0
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(_plain))
            ax.yaxis.set_minor_formatter(FuncFormatter(_sparse))
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label + (f" (moving average of {smooth} rounds)"
                                 if y_attr == "loss" and smooth > 1 else ""))
        ax.set_title(f"{title}: {y_label} vs {x_label}" if title else f"{y_label} vs {x_label}",
                     fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out) / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


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
