"""Checkpoint files: one peer's training state, written atomically, read back with checks.

``save`` writes a temporary file in the target's directory, flushes and fsyncs it, then
renames it over the target (``os.replace`` is atomic within a file system) and fsyncs the
directory, so the rename itself survives a power loss. A crash at any point leaves either
the previous checkpoint or the new one, never a torn file. The one it replaces stays as
the previous generation (``peer-R.prev.pt``): peers of a job restarted together may have
died a round apart, and resume at the newest round every peer has. ``load`` reads with
``weights_only`` (tensors and plain containers only: a checkpoint cannot run code) and turns
every failure into one CheckpointError line naming the file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.errors import CheckpointError

FORMAT = 1
#: Keys every checkpoint holds (see gossip.training.synchronous for what they mean).
REQUIRED = ("format", "rank", "strategy", "task", "round", "model", "optimizer", "strategy_state",
            "torch_rng", "batches_drawn", "lost_peers")


def path_for(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its checkpoint in ``directory``."""
    return Path(directory) / f"peer-{rank}.pt"


def previous(path: str | Path) -> Path:
    """Where the generation before the one at ``path`` is kept."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".pt") + ".prev.pt")


def save(path: str | Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` (tensors and plain containers) to ``path`` atomically, keeping the
    checkpoint it replaces as ``previous(path)``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # a second name first, then the move: each step atomic
            link = f"{tmp}.prev"
            os.link(path, link)
            os.replace(link, previous(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def load(path: str | Path, **expect: Any) -> dict[str, Any]:
    """The checkpoint at ``path``, checked to be complete and to match ``expect``
    (e.g. ``rank=3, strategy="dpsgd"``).

    Raises:
        CheckpointError: missing, unreadable, corrupt, incomplete or another peer's/run's.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file (was the peer run with "
                              f"--checkpoint-every?)") from None
    except Exception as exc:  # noqa: BLE001 - torch/pickle raise many unrelated types
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise CheckpointError(f"checkpoint {path} is corrupt or not a checkpoint: "
                              f"{type(exc).__name__}: {detail}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a checkpoint (holds a "
                              f"{type(state).__name__})")
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {state.get('format')!r}, this "
                              f"version reads {FORMAT}")
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")
    for key, want in expect.items():
        if state.get(key) != want:
            raise CheckpointError(f"checkpoint {path} is for {key} {state.get(key)!r}, this "
                                  f"peer has {key} {want!r}")
    return state


def generations(path: str | Path, **expect: Any) -> dict[int, Path]:
    """The checkpoints kept at ``path`` and ``previous(path)`` by their round (none if
    neither exists); ``expect`` as for ``load``.

    Raises:
        CheckpointError: one exists but is corrupt or another peer's/run's.
    """
    found = {}
    for candidate in (previous(path), Path(path)):
        if candidate.exists():
            found[int(load(candidate, **expect)["round"])] = candidate
    return found


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported here (e.g. some network file systems): best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
