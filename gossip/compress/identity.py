"""The identity compressor: the tensor itself, for dense baselines and tests."""

from __future__ import annotations

import torch

from gossip.compress.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    buffers,
    check_buffer,
    check_out,
    flatten,
    header,
    parse_header,
)


@COMPRESSORS.register("none")
class Identity(Compressor):
    """Send the tensor as it is (zero-copy: the payload may alias the input); ω = 1."""

    name = "none"
    unbiased = True

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        return Payload(header(self.name, x), (flatten(x).cpu(),))

    def _buffer(self, p: Payload) -> tuple[torch.Tensor, tuple[int, ...]]:
        head = parse_header(p, self.name)
        (buf,) = buffers(p, 1, self.name)
        return check_buffer(buf, head.dtype, head.numel, f"{self.name} buffer"), head.shape

    def decompress(self, p: Payload) -> torch.Tensor:
        buf, shape = self._buffer(p)
        # A copy: received buffers may live in read-only socket memory.
        return buf.clone().view(shape)

    def add_to(self, p: Payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        buf, _ = self._buffer(p)
        check_out(out, buf.numel())
        return out.add_(buf.view(out.shape), alpha=alpha)

    def quality(self, numel: int) -> float:
        return 1.0
