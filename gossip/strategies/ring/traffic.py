"""The exact ring all-reduce's message pattern with sizes (gossip/strategies/traffic.py):
piece by piece, as gossip/strategies/ring/exact.py sends and forwards them."""

from __future__ import annotations

import torch

from gossip.strategies.traffic import Step, message_bytes


def ring_traffic(rank: int, size: int, n: int, dtype: torch.dtype, tag: str,
                 pieces: list[list[tuple[int, int]]]) -> list[Step]:
    """Our segment's pieces go right; then each piece received from the left is forwarded
    right at once (reduce-scatter, then all-gather), except the last of each phase."""
    if size == 1:
        return []
    rs, ag = f"{tag}.rs", f"{tag}.ag"
    p, r = size, rank
    right, left = (r + 1) % p, (r - 1) % p

    def piece(kind, step, j, lo, hi):
        return (right, kind, message_bytes(r, kind, {"n": n, "s": step, "j": j},
                                           [(dtype, hi - lo)]))

    steps, pending = [], [piece(rs, 0, j, lo, hi) for j, (lo, hi) in enumerate(pieces[r])]
    for phase, kind in ((0, rs), (1, ag)):
        for step in range(p - 1):
            seg = (r - step - 1 + phase) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                steps.append(Step(tuple(pending), ((left, kind),)))
                if step < p - 2:
                    pending = [piece(kind, step + 1, j, lo, hi)]
                else:
                    pending = [piece(ag, 0, j, lo, hi)] if kind == rs else []
    return steps
