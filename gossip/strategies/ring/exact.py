"""Bandwidth-optimal ring all-reduce (reduce-scatter, then all-gather) returning the mean.

The tensor is cut into P segments (sizes differ by at most one element; some may be empty)
and each segment into pieces of at most ``piece_bytes``. A piece is forwarded as soon as it
is reduced, so huge tensors stream around the ring instead of moving segment by segment
(on few cores, fewer and larger messages are faster: the default only splits beyond 64 MiB).
Pieces are added into and forwarded from the buffers they arrived in, so only the first
send reads the input; ``out`` may alias it (see ``synchronize``).
Ranks form the ring 0 -> 1 -> ... -> P-1 -> 0 whatever the topology's edges are; in an
elastic run (``regroup``) the members of the current view do, in the order of their ids.
"""

from __future__ import annotations

import torch

from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.ring.layout import RingLayout
from gossip.strategies.ring.options import RingOptions
from gossip.strategies.ring.traffic import ring_traffic
from gossip.transport import Message
from gossip.transport.codec import has_nonfinite


class RingAllReduce(Strategy):
    """Mean over all peers in 2(P-1) steps, each moving 1/P of the tensor per peer
    (options: RingOptions without a compressor)."""

    options_class = RingOptions
    operates_on = "grads"
    exact_mean = True
    needs_every_peer = True
    # Every element of the result is checked as it is copied into place (NaN/Inf survive the
    # adds): one read of the result instead of 2(P-1)/P of one in per-frame checks.
    checks_own_result = True
    survives_death = True

    def __init__(self, *, rank, topology, transport, options: RingOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.tag = self.options.tag
        self.layout = RingLayout(rank, self.size, self.options.piece_bytes)
        self.stale = 0  # messages of older views dropped

    def regroup(self, slot: int, members, epoch: int) -> None:
        """Run on the view ``epoch`` of ``members`` (ids, in ring order) from now on, as its
        ``slot``; its messages carry the epoch, older epochs' are dropped."""
        self.layout = RingLayout(slot, len(members), self.options.piece_bytes,
                                 members=members, epoch=epoch)

    @classmethod
    def traffic(cls, rank, size, numel, dtype, options):
        layout, itemsize = RingLayout(rank, size, options.piece_bytes), dtype.itemsize
        return ring_traffic(rank, size, numel, dtype, options.tag,
                            lambda segment: layout.segment_pieces(segment, numel, itemsize))

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        return self.reduce(x, round, out=out, length=x.numel())

    def reduce(self, x: torch.Tensor, round: int, *, out: torch.Tensor | None,
               length: int) -> torch.Tensor:
        """``synchronize``, the peers agreeing on ``length`` (checked in every message):
        x's own length, or that of the tensor x was drawn from (shared random-k)."""
        if not x.is_floating_point():
            raise ConfigError(f"ring-allreduce averages floating-point tensors, got {x.dtype}")
        flat, out = x.reshape(-1), self._output(x, out)
        layout = self.layout
        if layout.size == 1:
            return out.copy_(flat).view_as(x)
        pieces = layout.pieces(flat.numel(), flat.element_size())
        rs, ag = self.kinds
        p, r = layout.size, layout.rank

        # Only the first send reads our memory; it is consumed before anything can overwrite
        # it (the mean of our segment reaches us only after our right neighbour added it in).
        # Every later send forwards a received buffer, updated in place: libzmq's own memory,
        # sent by reference, with nothing to copy or track.
        self._send_all(rs, round, 0, flat, pieces[r], length)
        # Reduce-scatter: after step s this peer holds the partial sum of segment r-s-1 over
        # s+2 peers; the last step completes segment r+1, which this peer then owns.
        nonfinite = False
        for step in range(p - 1):
            seg = (r - step - 1) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                msg = self._recv(rs, round, step, j, flat, hi - lo, length)
                part = msg.buffers[0]
                part.add_(flat[lo:hi])
                if step < p - 2:
                    self._forward(msg, rs, step + 1)
                else:
                    part.div_(p)
                    self._forward(msg, ag, 0)
                    nonfinite |= self._keep(part, out[lo:hi])
        # All-gather: the owned mean segments travel once around the ring.
        for step in range(p - 1):
            seg = (r - step) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                msg = self._recv(ag, round, step, j, flat, hi - lo, length)
                if step < p - 2:
                    self._forward(msg, ag, step + 1)
                nonfinite |= self._keep(msg.buffers[0], out[lo:hi])
        if nonfinite:  # only now: raising earlier would leave the peers after us waiting
            raise layout.nonfinite(round)
        return out.view_as(x)

    @staticmethod
    def _keep(part: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy a piece of the result into place; whether it holds NaN or Inf.

        Every element of the result passes here once, so this checks all of it, each piece
        while it is still in cache.
        """
        dst.copy_(part)
        return has_nonfinite(part)

    def _send_all(self, kind, round, step, flat, pieces, length) -> None:
        for j, (lo, hi) in enumerate(pieces):
            meta = self.layout.meta(n=length, s=step, j=j)
            self.transport.send(self.layout.right, Message(kind=kind, round=round, meta=meta,
                                                    buffers=(flat[lo:hi],)))

    def _forward(self, msg: Message, kind: str, step: int) -> None:
        """Send a received piece on to the right as ``kind`` ``step`` (by reference)."""
        self.transport.send(self.layout.right, Message(kind, msg.round, meta={**msg.meta, "s": step},
                                                buffers=msg.buffers, wire=msg.wire))

    def _recv(self, kind, round, step, piece, flat, numel, length) -> Message:
        layout = self.layout
        msg = self.transport.recv(src=layout.left, kind=kind, round=round)
        while not layout.current(msg.meta):  # an older view's: dropped
            self.stale += 1
            msg = self.transport.recv(src=layout.left, kind=kind, round=round)
        layout.check_meta(kind, round, msg.meta, length, step, piece)
        if self._expect(msg, numel).dtype != flat.dtype:
            raise ProtocolError(f"rank {self.rank}: peer {layout.left} sent {kind} round {round} "
                                f"as {msg.buffers[0].dtype}, expected {flat.dtype} — do all "
                                f"peers synchronize tensors of the same dtype?")
        return msg
