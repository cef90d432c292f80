"""QSGD (Alistarh et al. 2017): stochastic rounding of |x| / ‖x‖ to s levels per bucket;
unbiased."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    meta_int,
    parse_header,
)
from gossip.compress.dense import finite, work_dtype, work_numpy
from gossip.compress.packing import expand_codes, pack_codes, packed_size
from gossip.errors import ProtocolError
from gossip.options import Options, option

MAX_LEVELS = 32767


def code_format(levels: int) -> tuple[str, torch.dtype]:
    """How codes in [-s, s] travel: 4-bit nibbles (s <= 7), int8 (s <= 127) or int16."""
    if levels <= 7:
        return "nibble", torch.uint8
    return ("int8", torch.int8) if levels <= 127 else ("int16", torch.int16)


def level_count(value: int) -> str | None:
    return None if 1 <= value <= MAX_LEVELS else f"must be an int in [1, {MAX_LEVELS}]"


def bucket_size(value: Any) -> str | None:
    # Type and range in one message: the field takes None too, so it has no int annotation.
    fits = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if fits else "must be an int >= 1 (or 0/None: one bucket)"


@dataclass(frozen=True)
class QSGDOptions(Options):
    """Options of ``qsgd``."""

    examples = ({}, {"levels": 3, "bucket": 0, "seed": 5}, {"levels": 200, "bucket": None})

    levels: int = option(16, "s, the number of magnitude levels, 1 to 32767", check=level_count)
    bucket: Any = option(512, "values per norm; None or 0: one bucket, the whole tensor",
                         check=bucket_size)
    seed: int = option(0, "seeds the rounding (per key and round); give peers different seeds "
                          "(e.g. their rank) so their rounding noise is independent and "
                          "averages out")


@COMPRESSORS.register("qsgd")
class QSGD(Compressor):
    """x ≈ ‖x_b‖₂ · sign(x) · l / s per bucket b, l ∈ {0..s} rounded up with probability of
    the remainder.

    Each bucket of ``bucket`` consecutive values is scaled by its own norm, as in the paper's
    experiments: the variance factor c = min(b/s², √b/s) depends on the bucket size b instead
    of the tensor's length d, so large tensors stay usable with few levels (with one bucket of
    25M values and s = 16, c = 312: the noise swamps the signal). ``quality`` is
    ω = 1/(1 + c) of the rescaled Q/(1 + c) (choco.md). The norms travel as a second buffer
    (float32; float64 for float64 input), the codes sign·l as 4-bit nibbles (s <= 7), int8
    (s <= 127) or int16.
    """

    name = "qsgd"
    unbiased = True
    options_class = QSGDOptions
    options: QSGDOptions

    def _bucket(self, numel: int) -> int:
        """Values per norm for a tensor of ``numel`` values (>= 1)."""
        return max(1, min(self.options.bucket or numel, numel))

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        work = work_dtype(flat)
        s, n = self.options.levels, work.numel()
        b = self._bucket(n)
        kind, dtype = code_format(s)
        # |x| in rows of one bucket each; the last row padded with zeros.
        rows = work.new_zeros(-(-n // b), b)
        rows.view(-1)[:n] = work.abs()
        norms = torch.linalg.vector_norm(rows, dim=1)
        finite(float(norms.max()) if n else 0.0, "norm")
        noise = torch.rand(rows.shape, generator=generator(self.options.seed, key, round),
                           dtype=work.dtype).to(work.device)
        # floor(r + U) = floor(r) + 1 with probability frac(r): unbiased rounding.
        # |x|/‖x‖ can exceed 1 by an ulp; never emit a level beyond s. A zero bucket stays 0.
        inverse = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        level = rows.mul_(inverse[:, None]).add_(noise).floor_().clamp_(max=s).view(-1)[:n]
        codes = level.mul_(work.sign()).to(dtype if kind != "nibble" else torch.int8)
        meta = header(self.name, x)
        meta.update(s=s, bucket=b)
        norms = norms.cpu().contiguous()
        if kind == "nibble":
            return Payload(meta, (pack_codes((codes + 7).to(torch.uint8), 4, fill=7), norms))
        return Payload(meta, (codes.cpu().contiguous(), norms))

    def decompress(self, p: Payload) -> torch.Tensor:
        head = parse_header(p, self.name)
        s = meta_int(p.meta, "s", 1, MAX_LEVELS)
        b = meta_int(p.meta, "bucket", 1, max(1, head.numel))
        codes_buf, norms_buf = buffers(p, 2, self.name)
        kind, dtype = code_format(s)
        work = torch.float64 if head.dtype == torch.float64 else torch.float32
        norms = check_buffer(norms_buf, work, -(-head.numel // b), "qsgd norms")
        if norms.numel() and not (float(norms.min()) >= 0 and math.isfinite(float(norms.max()))):
            raise ProtocolError("qsgd payload: a bucket norm is negative, NaN or Inf")
        if kind == "nibble":
            check_buffer(codes_buf, dtype, packed_size(head.numel, 4), "qsgd codes")
            nibble = np.arange(16) - 7
            try:
                levels = expand_codes(codes_buf, 4, head.numel, nibble.astype(work_numpy(
                    head.dtype)), valid=np.abs(nibble) <= s)
            except ProtocolError:
                raise ProtocolError(f"qsgd payload: a code exceeds the {s} levels") from None
            values = torch.from_numpy(levels)
        else:
            codes = check_buffer(codes_buf, dtype, head.numel, "qsgd codes")
            # min/max, not abs: abs(-128) overflows int8.
            if codes.numel() and (int(codes.min()) < -s or int(codes.max()) > s):
                raise ProtocolError(f"qsgd payload: a code exceeds the {s} levels")
            values = codes.to(work)
        steps = (norms.to(work) / s).repeat_interleave(b)[:head.numel]
        return values.mul_(steps).to(head.dtype).view(head.shape)

    def quality(self, numel: int) -> float:
        if numel == 0:
            return 1.0
        s, b = self.options.levels, self._bucket(numel)
        return 1.0 / (1.0 + min(b / s**2, math.sqrt(b) / s))
