"""Pack small unsigned codes (1, 2, 4 or 8 bits each) densely into bytes, LSB first.

Decoding goes straight from packed bytes to values through a 256-row lookup table (one
``np.take`` over the bytes), which is several times faster than unpacking codes first.
"""

from __future__ import annotations

import numpy as np
import torch

from gossip.errors import ProtocolError

WIDTHS = (1, 2, 4, 8)


def packed_size(count: int, width: int) -> int:
    """Bytes ``count`` codes of ``width`` bits take."""
    return (count * width + 7) // 8


def pack_codes(codes: torch.Tensor, width: int, *, fill: int = 0) -> torch.Tensor:
    """Pack uint8 codes (each < 2**width) into ``packed_size`` bytes; ``fill`` pads the end."""
    if width not in WIDTHS:
        raise ValueError(f"width must be one of {WIDTHS}, got {width}")
    a = codes.detach().cpu().reshape(-1).numpy()
    a = a.view(np.uint8) if a.dtype == np.bool_ else a.astype(np.uint8, copy=False)
    if width == 8:
        return torch.from_numpy(a.copy())
    if width == 1 and fill == 0:  # packbits pads with zero bits itself
        return torch.from_numpy(np.packbits(a, bitorder="little"))
    per = 8 // width
    padded = a
    if a.size % per:
        padded = np.full(-(-a.size // per) * per, fill, dtype=np.uint8)
        padded[:a.size] = a
    if width == 1:
        return torch.from_numpy(np.packbits(padded, bitorder="little"))
    rows = padded.reshape(-1, per)
    out = rows[:, 0].copy()
    for j in range(1, per):
        out |= rows[:, j] << (width * j)
    return torch.from_numpy(out)


def unpack_codes(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The uint8 codes ``pack_codes`` packed (ProtocolError if the size is wrong)."""
    return torch.from_numpy(expand_codes(data, width, count, np.arange(1 << width,
                                                                       dtype=np.uint8)))


def expand_codes(data: torch.Tensor, width: int, count: int, values: np.ndarray,
                 *, valid: np.ndarray | None = None) -> np.ndarray:
    """``values[code]`` for each of the ``count`` codes packed in ``data``.

    Args:
        data: Packed uint8 bytes; must be exactly ``packed_size(count, width)`` long.
        width: Bits per code (1, 2 or 4; 8 works too).
        count: Codes wanted.
        values: Table of ``2**width`` entries, in the dtype wanted.
        valid: Optional bool table of ``2**width`` entries; a code marked False anywhere in
            ``data`` (padding included) raises ProtocolError.
    """
    if data.dtype != torch.uint8:
        raise ProtocolError(f"packed codes must be uint8, got {data.dtype}")
    if data.numel() != packed_size(count, width):
        raise ProtocolError(f"packed codes: {data.numel()} bytes for {count} codes of {width} "
                            f"bits (want {packed_size(count, width)})")
    raw = data.detach().cpu().reshape(-1).numpy()
    per = 8 // width
    byte = np.arange(256, dtype=np.uint16)
    codes_of_byte = np.stack([(byte >> (width * j)) & ((1 << width) - 1)
                              for j in range(per)], axis=1)
    if valid is not None:
        bad_byte = ~valid[codes_of_byte].all(axis=1)
        if bad_byte.any() and bad_byte[raw].any():
            raise ProtocolError(f"packed codes: invalid {width}-bit code in the data")
    table = values[codes_of_byte]  # (256, per): the values every byte expands to
    return np.take(table, raw, axis=0).reshape(-1)[:count]
