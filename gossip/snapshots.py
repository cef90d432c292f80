"""Consensus of an asynchronous run, measured from model snapshots instead of a probe.

The synchronous probe (consensus.py) is an all-reduce keyed by round: a barrier that
asynchronous peers, each on its own budget, would never all reach. Instead every peer saves
its model whenever the wall clock crosses a multiple of ``period`` seconds (at its next
step boundary), so peers snapshot together without talking; one more snapshot, ``final``,
is its model after its exchanges drained. Afterwards the snapshots of one tick give the
consensus distance then: the mean squared distance of the models to their average, as the
probe defines it.

Files: ``DIR/peer-R/K.npy`` (K = floor(wall / period)) and ``DIR/peer-R/final.npy``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

FINAL = "final"


class SnapshotWriter:
    """Saves one peer's flat model on every tick of the wall clock it sees.

    Args:
        directory: The run's snapshot directory (``run_dir/snapshots``).
        rank: This peer's rank.
        period: Seconds between ticks (> 0).
    """

    def __init__(self, directory: str | Path, rank: int, period: float):
        self.directory = Path(directory) / f"peer-{rank}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.period = period
        self.last_tick: int | None = None

    def maybe(self, flat: torch.Tensor, wall: float) -> None:
        """Save ``flat`` if the clock crossed a tick since the last snapshot."""
        tick = math.floor(wall / self.period)
        if tick != self.last_tick:
            self.last_tick = tick
            self._save(str(tick), flat)

    def final(self, flat: torch.Tensor) -> None:
        """Save the model this peer ends with."""
        self._save(FINAL, flat)

    def _save(self, name: str, flat: torch.Tensor) -> None:
        np.save(self.directory / f"{name}.npy", flat.detach().cpu().numpy())


def consensus_over_time(directory: str | Path) -> list[dict[str, Any]]:
    """One row per tick that two or more peers saved, in time order, then the final
    models: ``{"tick", "peers", "consensus"}``; a tick K is the wall clock K * period, the
    final row's tick is None. No directory: no rows."""
    by_name: dict[str, list[Path]] = {}
    for path in Path(directory).glob("peer-*/*.npy"):
        by_name.setdefault(path.stem, []).append(path)
    ticks = sorted(int(name) for name in by_name if name != FINAL)
    rows = [{"tick": tick, "peers": len(by_name[str(tick)]),
             "consensus": distance(by_name[str(tick)])}
            for tick in ticks if len(by_name[str(tick)]) > 1]
    if len(by_name.get(FINAL, ())) > 1:
        rows.append({"tick": None, "peers": len(by_name[FINAL]),
                     "consensus": distance(by_name[FINAL])})
    return rows


def distance(paths: list[Path]) -> float:
    """Mean over the models of their squared distance to the models' average (float64)."""
    models = np.stack([np.load(path).astype(np.float64) for path in paths])
    return float(((models - models.mean(axis=0)) ** 2).sum(axis=1).mean())
