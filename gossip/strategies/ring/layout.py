"""Where a ring all-reduce's pieces go: neighbours, segments and pieces, and the checks on
what arrives. Shared by the exact and the compressed rings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gossip.errors import ProtocolError


class RingLayout:
    """The ring 0 -> 1 -> ... -> P-1 -> 0 (whatever the topology's edges) as one rank sees it.

    Args:
        rank, size: This peer and the number of peers.
        piece_bytes: Largest piece of a segment, in bytes of the input.
    """

    def __init__(self, rank: int, size: int, piece_bytes: int):
        self.rank, self.size, self.piece_bytes = rank, size, piece_bytes
        self.right = (rank + 1) % size
        self.left = (rank - 1) % size

    def pieces(self, numel: int, itemsize: int) -> list[list[tuple[int, int]]]:
        """Per segment, the [lo, hi) ranges of its pieces; the same on every peer. Segments
        differ in length by at most one element; an empty one has one empty piece."""
        return [self.segment_pieces(i, numel, itemsize) for i in range(self.size)]

    def segment_pieces(self, segment: int, numel: int, itemsize: int) -> list[tuple[int, int]]:
        """``pieces(numel, itemsize)[segment]`` alone (the sizes-only simulation asks for one
        segment at a time: every segment of every rank at once is O(P^2))."""
        per_piece = max(1, self.piece_bytes // itemsize)
        lo, hi = numel * segment // self.size, numel * (segment + 1) // self.size
        return [(a, min(a + per_piece, hi)) for a in range(lo, hi, per_piece)] or [(lo, lo)]

    def check_meta(self, kind: str, round: int, meta: Mapping[str, Any], numel: int,
                   step: int, piece: int) -> None:
        """Raise ProtocolError unless the left neighbour's message is the one expected."""
        if meta.get("n") != numel or meta.get("s") != step or meta.get("j") != piece:
            raise ProtocolError(
                f"rank {self.rank}: peer {self.left} sent {kind} round {round} "
                f"(n={meta.get('n')}, step={meta.get('s')}, piece={meta.get('j')}), expected "
                f"(n={numel}, step={step}, piece={piece}) — do all peers synchronize tensors "
                f"of the same length?")

    def nonfinite(self, round: int) -> ProtocolError:
        """The error every peer raises when the mean holds NaN or Inf (they all hold it)."""
        return ProtocolError(
            f"rank {self.rank}: the all-reduced mean of round {round} holds NaN or Inf: "
            f"some peer's input did (a diverged model?) or a message was corrupt")
