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
    groups = _groups(directory)
    ticks = sorted(int(name) for name in groups if name != FINAL)
    names = [str(tick) for tick in ticks] + [FINAL]
    return [_row(name, groups[name]) for name in names if len(groups.get(name, ())) > 1]


def final_consensus(directory: str | Path) -> dict[str, Any] | None:
    """``consensus_over_time``'s last row, computed alone (a run summary needs no more)."""
    groups = _groups(directory)
    shared = [name for name, paths in groups.items() if len(paths) > 1]
    if not shared:
        return None
    name = FINAL if FINAL in shared else max(shared, key=int)
    return _row(name, groups[name])


def _groups(directory: str | Path) -> dict[str, list[Path]]:
    """Snapshot files by name (a tick or ``final``), every peer's."""
    groups: dict[str, list[Path]] = {}
    for path in Path(directory).glob("peer-*/*.npy"):
        groups.setdefault(path.stem, []).append(path)
    return groups


def _row(name: str, paths: list[Path]) -> dict[str, Any]:
    return {"tick": None if name == FINAL else int(name), "peers": len(paths),
            "consensus": distance(paths)}


def distance(paths: list[Path]) -> float:
    """Mean over the models of their squared distance to the models' average (float64)."""
    models = np.stack([np.load(path).astype(np.float64) for path in paths])
    return float(((models - models.mean(axis=0)) ** 2).sum(axis=1).mean())
