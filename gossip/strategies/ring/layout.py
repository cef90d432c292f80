"""Where a ring all-reduce's pieces go: neighbours, segments and pieces, and the checks on
what arrives. Shared by the exact and the compressed rings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gossip.errors import ProtocolError


class RingLayout:
    """The ring 0 -> 1 -> ... -> P-1 -> 0 (whatever the topology's edges) as one rank sees it.

    Args:
        rank, size: This peer and the number of peers (in an elastic view: its slot and the
            number of members).
        piece_bytes: Largest piece of a segment, in bytes of the input.
        members: In an elastic view, the member id of each slot (neighbours are ids).
        epoch: In an elastic view, its epoch: every message carries it (``meta``), and
            messages of older ones are dropped (``current``).
    """

    def __init__(self, rank: int, size: int, piece_bytes: int, *,
                 members: Sequence[int] | None = None, epoch: int | None = None):
        self.rank, self.size, self.piece_bytes = rank, size, piece_bytes
        ids = list(range(size)) if members is None else list(members)
        self.right = ids[(rank + 1) % size]
        self.left = ids[(rank - 1) % size]
        self.epoch = epoch

    def meta(self, **fields: Any) -> dict[str, Any]:
        """A message's meta: ``fields``, with the epoch in an elastic view."""
        return fields if self.epoch is None else {**fields, "e": self.epoch}

    def current(self, meta: Mapping[str, Any]) -> bool:
        """Whether a message belongs to this layout's view; False for an older epoch's
        (dropped by the caller). A newer epoch's cannot reach a member still in this one:
        a view is agreed only once every member left the one before, and a join's view is
        held by every member before anyone can start its round (epochs.py, ``ctl.held``)."""
        return self.epoch is None or meta.get("e", -1) >= self.epoch

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
        if (meta.get("n") != numel or meta.get("s") != step or meta.get("j") != piece
                or meta.get("e") != self.epoch):
            raise ProtocolError(
                f"rank {self.rank}: peer {self.left} sent {kind} round {round} "
                f"(n={meta.get('n')}, step={meta.get('s')}, piece={meta.get('j')}"
                f"{_epoch(meta.get('e'))}), expected (n={numel}, step={step}, piece={piece}"
                f"{_epoch(self.epoch)}) — do all peers synchronize tensors of the same length?")

    def nonfinite(self, round: int) -> ProtocolError:
        """The error every peer raises when the mean holds NaN or Inf (they all hold it)."""
        return ProtocolError(
            f"rank {self.rank}: the all-reduced mean of round {round} holds NaN or Inf: "
            f"some peer's input did (a diverged model?) or a message was corrupt")


def _epoch(epoch: int | None) -> str:
    return "" if epoch is None else f", epoch={epoch}"
