"""Ring all-reduce with a compressor that can be summed on the way.

Each reduce-scatter hop decompresses the partial sum it receives, adds its own values and
compresses the new partial sum for the next peer; the owner of a segment compresses the mean
once and the all-gather forwards that payload unchanged, so every peer decodes the same bits
and all peers return identical tensors. With error feedback, each compression point (hop and
piece) keeps its own residual and re-injects it at the same point next round, so nothing a
quantizer drops is lost for good.

Data-dependent sparsifiers are refused: the union of k-sparse sets grows with every hop,
which is what the sparse all-reduce strategies (topk-allgather, gtopk, spardl) are designed
around. Random-k is the exception: its indices come from a seed all peers share, so every
peer keeps the same k entries and the exact ring averages just those values.
"""

from __future__ import annotations

import torch

from gossip.compress import Compressor, Payload
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.allreduce import RingAllReduce
from gossip.transport import Message


class _RingWithCompressor(RingAllReduce):
    """A ring all-reduce that owns a compressor, and with it the state a checkpoint keeps."""

    def __init__(self, *, rank, topology, transport, compressor: Compressor,
                 piece_bytes: int = 64 << 20, tag: str = "ring"):
        super().__init__(rank=rank, topology=topology, transport=transport,
                         piece_bytes=piece_bytes, tag=tag)
        self.compressor = compressor

    def state_dict(self) -> dict:
        """The compressor's (error-feedback residuals, one per compression point)."""
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))


class CompressedRingAllReduce(_RingWithCompressor):
    """Mean over all peers; every message is a payload of ``compressor``.

    Args:
        compressor: A dense compressor (a cast or a quantizer, optionally with wrappers).
        piece_bytes, tag: As for the exact ring all-reduce (pieces count uncompressed bytes).
    """

    def __init__(self, *, rank, topology, transport, compressor: Compressor,
                 piece_bytes: int = 64 << 20, tag: str = "ring"):
        if compressor.sparse:
            raise ConfigError(
                f"ring-allreduce cannot carry the sparsifier {compressor.name!r}: its sparse sets "
                f"differ between peers and grow as they are summed around the ring; use "
                f"topk-allgather, gtopk or spardl (option density=...) for sparse all-reduce")
        super().__init__(rank=rank, topology=topology, transport=transport,
                         compressor=compressor, piece_bytes=piece_bytes, tag=tag)

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_floating_point():
            raise ConfigError(f"ring-allreduce averages floating-point tensors, got {x.dtype}")
        flat, out = x.reshape(-1), self._output(x, out)
        if self.size == 1:  # nothing to send: the mean is exact
            return out.copy_(flat).view_as(x)
        pieces = self._pieces(flat.numel(), flat.element_size())
        rs, ag = self.kinds
        p, r, n = self.size, self.rank, flat.numel()
        # Payloads are fresh tensors, so ``out`` (even aliasing ``x``) is ours to overwrite.
        for j, (lo, hi) in enumerate(pieces[r]):
            self._send_payload(rs, round, 0, j, n, self._compress(flat[lo:hi], rs, 0, j, round))
        for step in range(p - 1):
            seg = (r - step - 1) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                partial = out[lo:hi]
                received = self._recv_payload(rs, round, step, j, n, hi - lo)
                if partial.data_ptr() != flat[lo:hi].data_ptr():
                    partial.copy_(flat[lo:hi])
                self.compressor.add_to(received, partial)
                if step < p - 2:
                    payload = self._compress(partial, rs, step + 1, j, round)
                    self._send_payload(rs, round, step + 1, j, n, payload)
                else:
                    payload = self._compress(partial.div_(p), ag, 0, j, round)
                    self._send_payload(ag, round, 0, j, n, payload)
                    self._decode_into(payload, partial)  # the same bits as everyone else
        for step in range(p - 1):
            seg = (r - step) % p
            for j, (lo, hi) in enumerate(pieces[seg]):
                payload = self._recv_payload(ag, round, step, j, n, hi - lo)
                self._decode_into(payload, out[lo:hi])
                if step < p - 2:
                    self._send_payload(ag, round, step + 1, j, n, payload)
        return self._check_finite(out, round).view_as(x)

    def _compress(self, values: torch.Tensor, kind: str, step: int, piece: int,
                  round: int) -> Payload:
        # The all-gather payload is compressed once, by the owner: one residual per piece.
        key = f"{kind}.{piece}" if kind.endswith(".ag") else f"{kind}.{step}.{piece}"
        return self.compressor.compress(values, key=key, round=round)

    def _decode_into(self, payload: Payload, target: torch.Tensor) -> None:
        target.zero_()
        self.compressor.add_to(payload, target)

    def _send_payload(self, kind, round, step, piece, numel, payload: Payload) -> None:
        meta = {"n": numel, "s": step, "j": piece, "q": dict(payload.meta)}
        msg = Message(kind=kind, round=round, meta=meta, buffers=payload.buffers)
        self.transport.send(self.right, msg)

    def _recv_payload(self, kind, round, step, piece, numel, length) -> Payload:
        msg = self.transport.recv(src=self.left, kind=kind, round=round)
        meta = msg.meta
        self._check_meta(kind, round, meta, numel, step, piece)
        payload = Payload(meta.get("q"), msg.buffers)
        q = payload.meta
        if not isinstance(q, dict) or q.get("n") != length:
            raise ProtocolError(f"rank {self.rank}: peer {self.left} sent a {kind} payload for "
                                f"{q.get('n') if isinstance(q, dict) else '?'} values, "
                                f"expected {length}")
        return payload


class SharedRandomKRingAllReduce(_RingWithCompressor):
    """Mean of the same k random entries on every peer; the others come back as zeros.

    The random-k seed derives from (seed, tag, round), equal on all peers, so the k values
    are at the same positions everywhere and the exact ring averages them: only 1/density
    of the dense traffic, no indices on the wire. Error feedback (a wrapper of the
    compressor) keeps what was not picked for the next rounds.
    """

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        payload = self.compressor.compress(flat, key=self.tag, round=round)
        if len(payload.buffers) != 1:
            raise ConfigError(f"random-k payload with {len(payload.buffers)} buffers: "
                              f"expected the values alone")
        mean = super().synchronize(payload.buffers[0], round)  # x was read: dest is free
        dest.zero_()
        self.compressor.add_to(Payload(payload.meta, (mean,)), dest)
        return dest.view_as(x)
