"""Bandwidth-optimal ring all-reduce (reduce-scatter, then all-gather) returning the mean.

The tensor is cut into P segments (sizes differ by at most one element; some may be empty)
and each segment into pieces of at most ``piece_bytes``. A piece is forwarded as soon as it
is reduced, so huge tensors stream around the ring instead of moving segment by segment
(on few cores, fewer and larger messages are faster: the default only splits beyond 64 MiB).
Pieces are added into and forwarded from the buffers they arrived in, so only the first
send reads the input; ``out`` may alias it (see ``synchronize``).
Ranks form the ring 0 -> 1 -> ... -> P-1 -> 0 whatever the topology's edges are.
"""

from __future__ import annotations

import torch

from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import STRATEGIES, Strategy
from gossip.transport import Message
from gossip.transport.codec import has_nonfinite


@STRATEGIES.register("ring-allreduce")
def ring_allreduce(*, rank, topology, transport, piece_bytes: int = 64 << 20, tag: str = "ring",
                   compressor=None) -> Strategy:
    """The exact ring all-reduce, or its compressed form when given a (dense) compressor."""
    if compressor is None:
        return RingAllReduce(rank=rank, topology=topology, transport=transport,
                             piece_bytes=piece_bytes, tag=tag)
    from gossip.strategies.allreduce_compressed import (
        CompressedRingAllReduce,
        SharedRandomKRingAllReduce,
    )

    ring = SharedRandomKRingAllReduce if compressor.name == "randomk" else CompressedRingAllReduce
    return ring(rank=rank, topology=topology, transport=transport, piece_bytes=piece_bytes,
                tag=tag, compressor=compressor)


class RingAllReduce(Strategy):
    """Mean over all peers in 2(P-1) steps, each moving 1/P of the tensor per peer.

    Args:
        piece_bytes: Largest message; smaller pieces pipeline better, larger ones cost
            less per-message overhead.
        tag: Message kind prefix, distinct per instance sharing one transport.
    """

    operates_on = "grads"
    # Every element of the result is checked as it is copied into place (NaN/Inf survive the
    # adds): one read of the result instead of 2(P-1)/P of one in per-frame checks.
    checks_own_result = True

    def __init__(self, *, rank, topology, transport, piece_bytes: int = 64 << 20,
                 tag: str = "ring"):
        super().__init__(rank=rank, topology=topology, transport=transport)
        if piece_bytes < 64:
            raise ConfigError(f"piece_bytes must be >= 64, got {piece_bytes}")
        self.piece_bytes = piece_bytes
        self.tag = tag
        self.right = (rank + 1) % self.size
        self.left = (rank - 1) % self.size

    @property
    def kinds(self) -> tuple[str, ...]:
        return (f"{self.tag}.rs", f"{self.tag}.ag")

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_floating_point():
            raise ConfigError(f"ring-allreduce averages floating-point tensors, got {x.dtype}")
        flat, out = x.reshape(-1), self._output(x, out)
        if self.size == 1:
            return out.copy_(flat).view_as(x)
        pieces = self._pieces(flat.numel(), flat.element_size())
        rs, ag = self.kinds
        p, r = self.size, self.rank

        # Only the first send reads our memory; it is consumed before anything can overwrite
        # it (the mean of our segment reaches us only after our right neighbour added it in).
        # Every later send forwards a received buffer, updated in place: libzmq's own memory,
        # sent by reference, with nothing to copy or track.
        self._send_all(rs, round, 0, flat, pieces[r])
        # Reduce-scatter: after step s this peer holds the partial sum of segment r-s-1 over
        # s+2 peers; the last step completes segment r+1, which this peer then owns.
        nonfinite = False
        for step in range(p - 1):
            seg = (r - step - 1) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                msg = self._recv(rs, round, step, j, flat, hi - lo)
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
                msg = self._recv(ag, round, step, j, flat, hi - lo)
                if step < p - 2:
                    self._forward(msg, ag, step + 1)
                nonfinite |= self._keep(msg.buffers[0], out[lo:hi])
        if nonfinite:  # only now: raising earlier would leave the peers after us waiting
            raise self._nonfinite(round)
        return out.view_as(x)

    def _check_finite(self, result: torch.Tensor, round: int) -> torch.Tensor:
        """``result``, unless it holds NaN or Inf: then a ProtocolError, so no peer trains on
        it (every peer holds the same result, so every peer raises)."""
        if has_nonfinite(result):
            raise self._nonfinite(round)
        return result

    def _nonfinite(self, round: int) -> ProtocolError:
        return ProtocolError(
            f"rank {self.rank}: the all-reduced mean of round {round} holds NaN or Inf: "
            f"some peer's input did (a diverged model?) or a message was corrupt")

    @staticmethod
    def _keep(part: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy a piece of the result into place; whether it holds NaN or Inf.

        Every element of the result passes here once, so this checks all of it, each piece
        while it is still in cache.
        """
        dst.copy_(part)
        return has_nonfinite(part)

    def _pieces(self, numel: int, itemsize: int) -> list[list[tuple[int, int]]]:
        """Per segment, the [lo, hi) ranges of its pieces; the same on every peer."""
        per_piece = max(1, self.piece_bytes // itemsize)
        bounds = [numel * i // self.size for i in range(self.size + 1)]
        return [[(lo, min(lo + per_piece, hi)) for lo in range(bounds[i], hi, per_piece)]
                or [(bounds[i], bounds[i])]
                for i, hi in enumerate(bounds[1:])]

    def _send_all(self, kind, round, step, flat, pieces) -> None:
        for j, (lo, hi) in enumerate(pieces):
            meta = {"n": flat.numel(), "s": step, "j": j}
            self.transport.send(self.right, Message(kind=kind, round=round, meta=meta,
                                                    buffers=(flat[lo:hi],)))

    def _forward(self, msg: Message, kind: str, step: int) -> None:
        """Send a received piece on to the right as ``kind`` ``step`` (by reference)."""
        self.transport.send(self.right, Message(kind, msg.round, meta={**msg.meta, "s": step},
                                                buffers=msg.buffers, wire=msg.wire))

    def _recv(self, kind, round, step, piece, flat, length) -> Message:
        msg = self.transport.recv(src=self.left, kind=kind, round=round)
        self._check_meta(kind, round, msg.meta, flat.numel(), step, piece)
        if self._expect(msg, length).dtype != flat.dtype:
            raise ProtocolError(f"rank {self.rank}: peer {self.left} sent {kind} round {round} "
                                f"as {msg.buffers[0].dtype}, expected {flat.dtype} — do all "
                                f"peers synchronize tensors of the same dtype?")
        return msg

    def _check_meta(self, kind, round, meta, numel, step, piece) -> None:
        if meta.get("n") != numel or meta.get("s") != step or meta.get("j") != piece:
            raise ProtocolError(
                f"rank {self.rank}: peer {self.left} sent {kind} round {round} "
                f"(n={meta.get('n')}, step={meta.get('s')}, piece={meta.get('j')}), expected "
                f"(n={numel}, step={step}, piece={piece}) — do all peers synchronize tensors "
                f"of the same length?"
            )
