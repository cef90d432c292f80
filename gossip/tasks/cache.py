"""Arrays computed once per machine: a dataset's preprocessed split, kept as ``.npz`` in the
user's cache directory.

Every peer is a process of its own, and building the digits split means importing
scikit-learn: 1.7 s of CPU per process, a quarter of a peer's start-up (8 peers on 2 cores:
7 s of wall time per launch). The first process builds and writes the file; the others load
it in milliseconds. The key names everything the arrays depend on, so a stale file is never
read; a file that does not load is rebuilt, and a directory that cannot be written only
costs the rebuild.

Peers that are threads of one process (the library in a test or a notebook) take turns: the
first builds, the others load. Loading under the lock also keeps ``np.load``'s header parse
(``ast.literal_eval``) on one thread at a time: CPython 3.11 counts the AST's recursion depth
per interpreter, not per thread, and concurrent parses can fail with "AST constructor
recursion depth mismatch" (python/cpython#106905).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np


_lock = threading.Lock()


def cache_dir() -> Path:
    """``$GOSSIP_CACHE``, else ``$XDG_CACHE_HOME/gossip``, else ``~/.cache/gossip``."""
    if os.environ.get("GOSSIP_CACHE"):
        return Path(os.environ["GOSSIP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gossip"


def cached_arrays(key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``build()``'s arrays, from ``key``'s file in ``cache_dir()`` when it is there."""
    with _lock:
        return _load_or_build(cache_dir() / f"{key}.npz", build)


def _load_or_build(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, KeyError):  # not there yet, or broken: build it again
        pass
    arrays = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(out, **arrays)
            os.replace(tmp, path)  # atomic: a concurrent reader sees all of it or nothing
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:  # a read-only home: every process builds its own
        pass
    return arrays
