"""The exact ring all-reduce's message pattern with sizes (gossip/strategies/traffic.py):
piece by piece, as gossip/strategies/ring/exact.py sends and forwards them. A rank's round
is 2(P-1) steps or more, so its plan makes them as they are replayed (``Plan``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from gossip.strategies.traffic import Plan, Step, message_bytes

Pieces = Callable[[int], list[tuple[int, int]]]  # segment -> its pieces' [lo, hi) ranges


def ring_traffic(rank: int, size: int, n: int, dtype: torch.dtype, tag: str,
                 segment_pieces: Pieces) -> Plan:
    """Our segment's pieces go right; then each piece received from the left is forwarded
    right at once (reduce-scatter, then all-gather), except the last of each phase."""
    return Plan(functools.partial(_ring_steps, rank, size, n, dtype, tag, segment_pieces))


def _ring_steps(rank: int, size: int, n: int, dtype: torch.dtype, tag: str,
                segment_pieces: Pieces) -> Iterator[Step]:
    if size == 1:
        return
    rs, ag = f"{tag}.rs", f"{tag}.ag"
    p, r = size, rank
    right, left = (r + 1) % p, (r - 1) % p

    def piece(kind, step, j, lo, hi):
        return (right, kind, message_bytes(r, kind, {"n": n, "s": step, "j": j},
                                           [(dtype, hi - lo)]))

    pending = [piece(rs, 0, j, lo, hi) for j, (lo, hi) in enumerate(segment_pieces(r))]
    for phase, kind in ((0, rs), (1, ag)):
        for step in range(p - 1):
            seg = (r - step - 1 + phase) % p
            for j, (lo, hi) in enumerate(segment_pieces(seg)):
                yield Step(tuple(pending), ((left, kind),))
                if step < p - 2:
                    pending = [piece(kind, step + 1, j, lo, hi)]
                else:
                    pending = [piece(ag, 0, j, lo, hi)] if kind == rs else []
