"""The timeline plot: who held each device when, one panel per arm of a point, a few
rounds in steady state: the crossover is seen, not only read."""

from __future__ import annotations

from pathlib import Path

from gossip.crossover.grants import read_grants

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def plot_timeline(out: Path, point: str, arms: list[str], *, rep: str = "rep-0",
                  first_round: int = 10, rounds: int = 4) -> Path | None:
    """``OUT/POINT-timeline.png`` from the grant logs of ``arms`` (the sequential arm has
    one per job; it is left out); None when there is no log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(arm, out / point / arm / rep / "grants.jsonl") for arm in arms
              if arm != "sequential"]
    panels = [(arm, path) for arm, path in panels if path.exists()]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 1.3 * len(panels)),
                             squeeze=False)
    for ax, (arm, path) in zip(axes[:, 0], panels):
        grants = [g for g in read_grants(path) if g["t_release"] is not None]
        first = min(first_round, max(max((g["round"] for g in grants), default=0) - rounds, 0))
        window = [g for g in grants if first <= g["round"] < first + rounds]
        if not window:
            continue
        t0 = min(g["t_grant"] for g in window)
        t1 = max(g["t_release"] for g in window)
        devices = sorted({g["device"] for g in grants})
        jobs = sorted({g["job"] for g in grants})
        for g in grants:
            if g["t_release"] < t0 or g["t_grant"] > t1:
                continue
            row = devices.index(g["device"])
            ax.broken_barh([(g["t_grant"] - t0, g["t_release"] - g["t_grant"])], (row - 0.4, 0.8),
                           color=COLOURS[jobs.index(g["job"]) % len(COLOURS)])
        ax.set_yticks(range(len(devices)), devices)
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{arm}: device grants, rounds {first}-{first + rounds - 1}"
                     f" ({', '.join(f'{j}={COLOURS[i]}' for i, j in enumerate(jobs))})",
                     fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    path = out / f"{point}-timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
