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

from gossip.compress import Payload
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.strategies.ring.exact import RingAllReduce
from gossip.strategies.ring.layout import RingLayout
from gossip.strategies.ring.options import RingOptions
from gossip.transport import Message
from gossip.transport.codec import has_nonfinite


class _Compressing(Strategy):
    """A ring all-reduce with a compressor, and with it the state a checkpoint keeps."""

    options_class = RingOptions
    operates_on = "grads"
    needs_every_peer = True
    checks_own_result = True  # the result is checked once, every peer holding the same

    def __init__(self, *, rank, topology, transport, options: RingOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        if self.options.compressor is None:
            raise ConfigError(f"{type(self).__name__} needs a compressor")
        self.compressor = self.options.compressor
        self.tag = self.options.tag

    def state_dict(self) -> dict:
        """The compressor's (error-feedback residuals, one per compression point)."""
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))


class CompressedRingAllReduce(_Compressing):
    """Mean over all peers; every message is a payload of a dense compressor (a cast or a
    quantizer, optionally with wrappers); pieces count uncompressed bytes."""

    def __init__(self, *, rank, topology, transport, options: RingOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.layout = RingLayout(rank, self.size, self.options.piece_bytes)
        self.right, self.left = self.layout.right, self.layout.left

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_floating_point():
            raise ConfigError(f"ring-allreduce averages floating-point tensors, got {x.dtype}")
        flat, out = x.reshape(-1), self._output(x, out)
        if self.size == 1:  # nothing to send: the mean is exact
            return out.copy_(flat).view_as(x)
        pieces = self.layout.pieces(flat.numel(), flat.element_size())
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
        if has_nonfinite(out):  # every peer holds the same result, so every peer raises
            raise self.layout.nonfinite(round)
        return out.view_as(x)

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
        self.layout.check_meta(kind, round, meta, numel, step, piece)
        payload = Payload(meta.get("q"), msg.buffers)
        q = payload.meta
        if not isinstance(q, dict) or q.get("n") != length:
            raise ProtocolError(f"rank {self.rank}: peer {self.left} sent a {kind} payload for "
                                f"{q.get('n') if isinstance(q, dict) else '?'} values, "
                                f"expected {length}")
        return payload


class SharedRandomKRingAllReduce(_Compressing):
    """Mean of the same k random entries on every peer; the others come back as zeros.

    The random-k seed derives from (seed, tag, round), equal on all peers, so the k values
    are at the same positions everywhere and the exact ring (a RingAllReduce this strategy
    runs on them) averages them: only 1/density of the dense traffic, no indices on the
    wire. Error feedback (a wrapper of the compressor) keeps what was not picked for the
    next rounds.
    """

    def __init__(self, *, rank, topology, transport, options: RingOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        if not self.compressor.shared_support:
            raise ConfigError(f"{type(self).__name__} shares random-k indices; got "
                              f"{self.compressor.name!r}")
        self.ring = RingAllReduce(rank=rank, topology=topology, transport=transport,
                                  options=RingOptions(piece_bytes=self.options.piece_bytes,
                                                      tag=self.tag))

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        flat, dest = x.reshape(-1), self._output(x, out)
        payload = self.compressor.compress(flat, key=self.tag, round=round)
        if len(payload.buffers) != 1:
            raise ConfigError(f"random-k payload with {len(payload.buffers)} buffers: "
                              f"expected the values alone")
        # The peers must agree on x's length, not only on k: check it in every message.
        mean = self.ring.reduce(payload.buffers[0], round, out=None, length=flat.numel())
        dest.zero_()
        self.compressor.add_to(Payload(payload.meta, (mean,)), dest)
        return dest.view_as(x)
