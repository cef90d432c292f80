"""Scaled sign: 1 bit per entry plus one scale, mean |x| (EF-signSGD, Karimireddy et al.)."""

from __future__ import annotations

import numpy as np
import torch

from gossip.compress.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    buffers,
    flatten,
    header,
    meta_float,
    parse_header,
)
from gossip.compress.dense import decoded, finite, work_dtype, work_numpy
from gossip.compress.packing import expand_codes, pack_codes


@COMPRESSORS.register("sign")
class Sign(Compressor):
    """x ≈ (‖x‖₁ / d) · sign(x) (zero counts as +). Biased: wrap it in error feedback.

    With that scale ‖Q(x) − x‖² = ‖x‖² − ‖x‖₁²/d, so ω = ‖x‖₁² / (d‖x‖²) is data dependent:
    about 2/π for Gaussian vectors, 1 for constant magnitudes, 1/d at worst (one non-zero).
    ``quality`` returns that worst case, 1/d; measure it on your data for step sizes.
    """

    name = "sign"

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        work = work_dtype(flat)
        scale = finite(float(work.abs().mean()), "mean |x|") if work.numel() else 0.0
        meta = header(self.name, x)
        meta["scale"] = scale
        return Payload(meta, (pack_codes(work < 0, 1),))

    def decompress(self, p: Payload) -> torch.Tensor:
        head = parse_header(p, self.name)
        scale = meta_float(p.meta, "scale")
        (buf,) = buffers(p, 1, self.name)
        table = np.array([scale, -scale], dtype=work_numpy(head.dtype))
        return decoded(expand_codes(buf, 1, head.numel, table), head)

    def quality(self, numel: int) -> float:
        return 1.0 / numel if numel else 1.0
