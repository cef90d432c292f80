"""TernGrad (Wen et al. 2017): x ≈ max|x| · sign(x) · Bernoulli(|x| / max|x|); unbiased."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gossip.compress.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    buffers,
    check_buffer,
    flatten,
    generator,
    header,
    meta_float,
    parse_header,
)
from gossip.compress.dense import decoded, finite, work_dtype, work_numpy
from gossip.compress.packing import expand_codes, pack_codes, packed_size
from gossip.errors import ProtocolError
from gossip.options import Options, option

_VALID = np.array([True, True, True, False])


@dataclass(frozen=True)
class TernGradOptions(Options):
    """Options of ``terngrad``."""

    examples = ({}, {"seed": 5})

    seed: int = option(0, "seeds the rounding (per key and round); give peers different seeds")


@COMPRESSORS.register("terngrad")
class TernGrad(Compressor):
    """Ternary codes {-1, 0, 1} at 2 bits each, times one scale (max |x|) in meta.

    Unbiased; variance factor c <= √d − 1 (since max|x|·‖x‖₁ <= √d‖x‖²), so ``quality``
    gives ω = 1/√d for the rescaled Q/√d.
    """

    name = "terngrad"
    unbiased = True
    options_class = TernGradOptions
    options: TernGradOptions

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        work = work_dtype(flat)
        n = work.numel()
        scale = finite(float(work.abs().max()), "max |x|") if n else 0.0
        if scale > 0:
            noise = torch.rand(n, generator=generator(self.options.seed, key, round),
                               dtype=work.dtype).to(work.device)
            # floor(p + U) is 1 with probability p = |x| / scale (p <= 1, U < 1).
            keep = work.abs().div_(scale).add_(noise).floor_()
            codes = keep.mul_(work.sign()).add_(1).to(torch.uint8)  # code + 1: 0, 1, 2
        else:
            codes = torch.ones(n, dtype=torch.uint8)
        meta = header(self.name, x)
        meta["scale"] = scale
        return Payload(meta, (pack_codes(codes, 2, fill=1),))

    def decompress(self, p: Payload) -> torch.Tensor:
        head = parse_header(p, self.name)
        scale = meta_float(p.meta, "scale")
        (buf,) = buffers(p, 1, self.name)
        table = np.array([-scale, 0.0, scale, 0.0], dtype=work_numpy(head.dtype))
        check_buffer(buf, torch.uint8, packed_size(head.numel, 2), "terngrad codes")
        try:
            values = expand_codes(buf, 2, head.numel, table, valid=_VALID)
        except ProtocolError:
            raise ProtocolError("terngrad payload: invalid ternary code 3") from None
        return decoded(values, head)

    def quality(self, numel: int) -> float:
        return 1.0 / math.sqrt(numel) if numel else 1.0
