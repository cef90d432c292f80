"""PowerSGD's arithmetic on one peer: which tensors of a flat vector are compressed, the
seeded first factor, and orthogonalization. The strategy (powersgd.py) runs it between its
two exact ring all-reduces; nothing here communicates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gossip.compress.base import generator
from gossip.errors import ConfigError

#: Gram-Schmidt up to this rank (as newer torch does), torch.linalg.qr above.
GRAM_SCHMIDT_UP_TO = 2


@dataclass(frozen=True)
class Block:
    """One tensor of the layout: ``[start, stop)`` of the flat vector, viewed as a
    ``rows`` x ``cols`` matrix (a conv kernel as (out, in*kh*kw)); ``rank`` 0: sent dense."""

    start: int
    stop: int
    rows: int
    cols: int
    rank: int


def blocks(shapes: Sequence[Sequence[int]], numel: int, *, rank: int,
           min_compression_rate: float) -> tuple[Block, ...]:
    """The blocks of a flat vector of ``numel`` elements laid out as ``shapes``: a matrix of
    two or more dimensions is compressed to rank r = min(rank, n, m) when
    ``min_compression_rate`` * r(n + m) < nm; vectors, scalars and the rest go dense.

    Raises:
        ConfigError: the shapes do not add up to ``numel``.
    """
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else size
        cols = size // rows if len(shape) >= 2 and rows else 1
        r = min(rank, rows, cols) if len(shape) >= 2 else 0
        if r and not min_compression_rate * r * (rows + cols) < rows * cols:
            r = 0
        out.append(Block(start, start + size, rows, cols, r))
        start += size
    if start != numel:
        raise ConfigError(f"powersgd: the layout's tensors hold {start} elements, the vector "
                          f"{numel}")
    return tuple(out)


def first_factor(seed: int, key: str, step: int, cols: int, rank: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """A fresh Q (cols x rank), standard normal, the same on every peer for the same
    (seed, key, step)."""
    q = torch.randn(cols, rank, generator=generator(seed, key, step), dtype=torch.float64)
    return q.to(dtype)


def orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """A new matrix whose columns are orthonormal and span ``m``'s leading columns, computed
    in at least fp32 (a column's square overflows fp16) and returned in ``m``'s dtype."""
    work = m.to(torch.promote_types(m.dtype, torch.float32), copy=True)
    if work.shape[1] > GRAM_SCHMIDT_UP_TO:
        return torch.linalg.qr(work).Q.to(m.dtype)
    # A zero column stays zero instead of NaN; any other is normalized exactly (c/(|c|+eps)
    # would shrink it by eps/|c|, off by far more than rounding).
    tiny = torch.finfo(work.dtype).tiny
    for i in range(work.shape[1]):
        col = work[:, i]
        col.div_(col.norm().clamp_min(tiny))
        rest = work[:, i + 1:]
        if rest.numel():
            rest.sub_(torch.outer(col, col @ rest))
    return work.to(m.dtype)
