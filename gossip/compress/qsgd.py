"""QSGD (Alistarh et al. 2017): stochastic rounding of |x| / ‖x‖ to s levels; unbiased."""

from __future__ import annotations

import math

import numpy as np
import torch

from gossip.compress.base import (
    COMPRESSORS,
    Compressor,
    Payload,
    buffers,
    check_buffer,
    check_seed,
    flatten,
    generator,
    header,
    meta_float,
    meta_int,
    parse_header,
)
from gossip.compress.dense import decoded, finite, work_dtype, work_numpy
from gossip.compress.packing import expand_codes, pack_codes, packed_size
from gossip.errors import ConfigError, ProtocolError

MAX_LEVELS = 32767


def code_format(levels: int) -> tuple[str, torch.dtype]:
    """How codes in [-s, s] travel: 4-bit nibbles (s <= 7), int8 (s <= 127) or int16."""
    if levels <= 7:
        return "nibble", torch.uint8
    return ("int8", torch.int8) if levels <= 127 else ("int16", torch.int16)


@COMPRESSORS.register("qsgd")
class QSGD(Compressor):
    """x ≈ ‖x‖₂ · sign(x) · l / s, l ∈ {0..s} rounded up with probability of the remainder.

    Unbiased with variance factor c = min(d/s², √d/s); ``quality`` is ω = 1/(1 + c) of the
    rescaled Q/(1 + c) (choco.md). The norm travels in meta (a float64, exact), the codes
    sign·l as 4-bit nibbles (s <= 7), int8 (s <= 127) or int16.

    Args:
        levels: s, the number of magnitude levels, 1 to 32767.
        seed: Seeds the rounding (per key and round). Give peers different seeds (e.g. their
            rank) so their rounding noise is independent and averages out.
    """

    name = "qsgd"
    unbiased = True

    def __init__(self, *, levels: int = 16, seed: int = 0):
        if not isinstance(levels, int) or isinstance(levels, bool) or not (
                1 <= levels <= MAX_LEVELS):
            raise ConfigError(f"levels must be an int in [1, {MAX_LEVELS}], got {levels!r}")
        self.levels = levels
        self.seed = check_seed(seed)

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        work = work_dtype(flat)
        s = self.levels
        norm = finite(float(torch.linalg.vector_norm(work)), "norm") if work.numel() else 0.0
        kind, dtype = code_format(s)
        if norm == 0.0:
            codes = torch.zeros(work.numel(), dtype=dtype)
        else:
            noise = torch.rand(work.numel(), generator=generator(self.seed, key, round),
                               dtype=work.dtype).to(work.device)
            # floor(r + U) = floor(r) + 1 with probability frac(r): unbiased rounding.
            # |x|/‖x‖ can exceed 1 by an ulp; never emit a level beyond s.
            level = work.abs().mul_(s / norm).add_(noise).floor_().clamp_(max=s)
            codes = level.mul_(work.sign()).to(dtype if kind != "nibble" else torch.int8)
        meta = header(self.name, x)
        meta.update(s=s, norm=norm)
        if kind == "nibble":
            return Payload(meta, (pack_codes((codes + 7).to(torch.uint8), 4, fill=7),))
        return Payload(meta, (codes.cpu().contiguous(),))

    def decompress(self, p: Payload) -> torch.Tensor:
        head = parse_header(p, self.name)
        s = meta_int(p.meta, "s", 1, MAX_LEVELS)
        norm = meta_float(p.meta, "norm")
        (buf,) = buffers(p, 1, self.name)
        kind, dtype = code_format(s)
        step = norm / s
        if kind == "nibble":
            check_buffer(buf, dtype, packed_size(head.numel, 4), "qsgd codes")
            nibble = np.arange(16) - 7
            table = (nibble * step).astype(work_numpy(head.dtype))
            try:
                values = expand_codes(buf, 4, head.numel, table, valid=np.abs(nibble) <= s)
            except ProtocolError:
                raise ProtocolError(f"qsgd payload: a code exceeds the {s} levels") from None
            return decoded(values, head)
        codes = check_buffer(buf, dtype, head.numel, "qsgd codes")
        # min/max, not abs: abs(-128) overflows int8.
        if codes.numel() and (int(codes.min()) < -s or int(codes.max()) > s):
            raise ProtocolError(f"qsgd payload: a code exceeds the {s} levels")
        work = torch.float64 if head.dtype == torch.float64 else torch.float32
        return codes.to(work).mul_(step).to(head.dtype).view(head.shape)

    def quality(self, numel: int) -> float:
        if numel == 0:
            return 1.0
        s = self.levels
        return 1.0 / (1.0 + min(numel / s**2, math.sqrt(numel) / s))

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels})"

