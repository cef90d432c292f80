"""Per-peer metrics as JSON Lines, plus a named-phase stopwatch.

Each peer appends one JSON object per round to its own file and flushes it, so a
monitor (or the benchmark harness) can read progress live and a peer killed
mid-run leaves at worst one partial trailing line, which the readers skip.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from gossip.errors import ConfigError

__all__ = ["MetricsWriter", "Stopwatch", "last_record", "read_jsonl", "run_dirs"]


def _jsonable(value: Any) -> Any:
    """Convert ``value`` into plain JSON types; non-finite floats become ``None``.

    JSON has no NaN/Infinity, and Python's ``NaN`` token breaks other readers, so
    they are written as ``null``. NumPy/torch scalars and arrays are converted via
    ``item``/``tolist`` (duck-typed so this module never imports them).
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays/scalars, torch tensors
        return _jsonable(value.tolist())
    if hasattr(value, "item"):
        return _jsonable(value.item())
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON-serializable")


class MetricsWriter:
    """Writes one JSON object per line to a file, flushing after every line.

    Usable as a context manager; closing twice is harmless.
    """

    def __init__(self, path: str | Path):
        """Open ``path`` for writing, creating parent directories and truncating it.

        Args:
            path: The JSONL file to write.
        """
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line; values are written as given (NaN -> null).

        Args:
            record: The fields of the line; nothing is added.

        Raises:
            TypeError: A value cannot be represented in JSON.
            ValueError: The writer is closed.
        """
        line = json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":")) + "\n"
        # A single write call keeps a torn line possible only at the very end of the file.
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_line(raw: bytes) -> dict | None:
    """The dict on ``raw`` or None if it is not a complete JSON object."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def read_jsonl(path: str | Path) -> list[dict]:
    """Read every record of a metrics file.

    A trailing line without newline that does not parse (a writer killed mid-write)
    is ignored; blank lines are skipped.

    Args:
        path: The JSONL file.

    Returns:
        The records in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: A complete (newline-terminated) line is not a JSON object.
    """
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        obj = _parse_line(raw)
        if obj is None:
            raise ConfigError(f"{path}:{number}: not a JSON object: {raw[:80]!r}")
        records.append(obj)
    if tail.strip():
        obj = _parse_line(tail)
        if obj is not None:
            records.append(obj)
    return records


def last_record(path: str | Path, *, block: int = 4096) -> dict | None:
    """The last complete record of a metrics file, reading only its tail.

    Meant for polling live runs, so a file that does not exist yet gives None.

    Args:
        path: The JSONL file.
        block: Initial number of bytes read from the end; doubled until a whole
            line fits.

    Returns:
        The last record, or None if the file is missing or holds no complete record.

    Raises:
        ConfigError: The last complete line is not a JSON object.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        while True:
            start = max(0, size - block)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
            tail = lines.pop()
            if tail.strip():
                obj = _parse_line(tail)  # complete but unterminated lines still count
                if obj is not None:
                    return obj
            # lines[0] may be cut by the block start unless we read from offset 0.
            complete = lines if start == 0 else lines[1:]
            for raw in reversed(complete):
                if raw.strip():
                    obj = _parse_line(raw)
                    if obj is None:
                        raise ConfigError(f"{path}: last line is not a JSON object: {raw[:80]!r}")
                    return obj
            if start == 0:
                return None
            block *= 2


class Stopwatch:
    """Accumulates elapsed seconds per phase name.

    ``with sw("compute"): ...`` adds the block's duration to ``"compute"``.
    :meth:`totals` is cumulative since creation; :meth:`take` returns the amounts
    since the previous ``take`` (per-round figures) and restarts them. Safe to use
    from several threads; do not nest blocks of the same name (time would count twice).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        """Create an empty stopwatch.

        Args:
            clock: Monotonic seconds source (injectable for tests).
        """
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._since: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``name`` (for time measured elsewhere)."""
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + seconds
            self._since[name] = self._since.get(name, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        """Cumulative seconds per name since creation."""
        with self._lock:
            return dict(self._totals)

    def take(self) -> dict[str, float]:
        """Seconds per name since the previous call, then restart that count.

        Every name ever timed appears (0.0 if unused since the last take), so
        per-round records keep a stable set of keys.
        """
        with self._lock:
            out = {name: self._since.get(name, 0.0) for name in self._totals}
            self._since = {}
            return out


def run_dirs(path: Path) -> list[Path]:
    """The run directories under ``path`` in experiment order (``path`` itself if it is
    one run's directory)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory")
    if any(path.glob("peer-*.jsonl")):
        return [path]
    order: list[str] = []
    spec = path / "experiment.yaml"
    if spec.exists():
        order = [r.get("name") for r in (yaml.safe_load(spec.read_text()) or {}).get("runs", [])
                 if isinstance(r, dict)]
    found = {d.name: d for d in path.iterdir() if d.is_dir() and any(d.glob("peer-*.jsonl"))}
    if not found:
        raise ConfigError(f"{path}: no run directories (with peer-R.jsonl files) in it")
    return [found[n] for n in order if n in found] + sorted(
        d for n, d in found.items() if n not in order)
