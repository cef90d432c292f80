"""Dense payloads: the tensor itself (``none``) or cast to a 16-bit float (half the bytes),
decompressed back to the original dtype."""

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


class Cast(Compressor):
    """Send ``x`` cast to ``dtype``; values beyond its range become ±inf (fp16: 65504).

    ω = 1 − u², u the unit roundoff (fp16: 2⁻¹¹, bf16: 2⁻⁸), ignoring overflow and underflow.
    A ``dtype`` of None keeps the input's.
    """

    dtype: torch.dtype | None
    roundoff: float

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        return Payload(header(self.name, x), (flat.to(self.dtype or flat.dtype).cpu(),))

    def _buffer(self, p: Payload) -> tuple[torch.Tensor, torch.dtype, tuple[int, ...]]:
        head = parse_header(p, self.name)
        (buf,) = buffers(p, 1, self.name)
        check_buffer(buf, self.dtype or head.dtype, head.numel, f"{self.name} buffer")
        return buf, head.dtype, head.shape

    def decompress(self, p: Payload) -> torch.Tensor:
        buf, dtype, shape = self._buffer(p)
        # Always a copy: received buffers may live in read-only socket memory.
        return buf.to(dtype, copy=True).view(shape)

    def add_to(self, p: Payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        buf, _, _ = self._buffer(p)
        check_out(out, buf.numel())
        return out.add_(buf.view(out.shape), alpha=alpha)  # promotes in place, no temporary

    def quality(self, numel: int) -> float:
        return 1.0 - self.roundoff**2


@COMPRESSORS.register("none")
class Identity(Cast):
    """Send the tensor as it is (zero-copy: the payload may alias the input); ω = 1."""

    name = "none"
    dtype = None
    roundoff = 0.0
    unbiased = True


@COMPRESSORS.register("fp16")
class Float16(Cast):
    """IEEE half precision: 10-bit mantissa, range ±65504."""

    name = "fp16"
    dtype = torch.float16
    roundoff = 2.0**-11


@COMPRESSORS.register("bf16")
class BFloat16(Cast):
    """bfloat16: float32's range with an 7-bit mantissa."""

    name = "bf16"
    dtype = torch.bfloat16
    roundoff = 2.0**-8
