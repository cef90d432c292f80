"""Pipelining pieces: the copy of piece i+1 is under way while piece i is sent.

Time is about max(copy, send) per piece instead of their sum, plus one piece of start-up;
the caller picks the piece size (large enough to amortize a send, small enough to
overlap: a few MB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def pieces(numel: int, piece: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of at most ``piece`` elements covering ``numel``."""
    if piece <= 0:
        raise ValueError(f"piece must be > 0, got {piece}")
    return [(lo, min(lo + piece, numel)) for lo in range(0, numel, piece)]


def pipelined(ranges: Sequence[tuple[int, int]], start: Callable[[int, int, int], Any],
              finish: Callable[[int, Any], None], *, ahead: int = 1) -> None:
    """For each range i: ``handle = start(i, lo, hi)`` is issued ``ahead`` ranges before
    ``finish(i, handle)`` (which waits for it and passes the piece on, e.g. sends it)."""
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    handles: dict[int, Any] = {}
    for i in range(min(ahead, len(ranges))):
        handles[i] = start(i, *ranges[i])
    for i in range(len(ranges)):
        following = i + ahead
        if following < len(ranges):
            handles[following] = start(following, *ranges[following])
        finish(i, handles.pop(i))
