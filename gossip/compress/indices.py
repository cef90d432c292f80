"""Compact wire encodings of a sorted set of k distinct indices into [0, n).

Every message picks the smallest of six schemes (sizes are computed before encoding):

* ``bits``: the sorted deltas (the first is the index itself) bit-packed at a fixed width, the
  bit length of the largest delta; one leading byte holds the width. Never more than
  ``ceil(log2 n)`` bits per index, which bounds every payload.
* ``ef``: Elias-Fano: the low ``L`` bits of every index bit-packed, the high parts as a unary
  bit vector; about ``2 + log2(n/k)`` bits per index, the best for spread-out sets.
* ``varint``: LEB128 deltas; wins when a few huge gaps would widen ``bits``.
* ``block``: per-65536-element block counts (LEB128), then 16-bit offsets in each block.
* ``bitmap``: one bit per element; wins at high density.
* ``raw``: little-endian int32 (only for n <= 2**31); simple and fast to decode.

Everything is vectorized with numpy (no per-index Python loop). Decoding validates the data
and raises ProtocolError for truncated or garbage data, out-of-range, unsorted or duplicate
indices and count mismatches.
"""

from __future__ import annotations

import numpy as np
import torch

from gossip.errors import ProtocolError

SCHEMES = ("ef", "bits", "varint", "block", "bitmap", "raw")
BLOCK = 1 << 16
_MAX_VARINT_BYTES = 9  # 63 bits: every delta fits a non-negative int64
_EMPTY = np.zeros(0, dtype=np.uint8)


def encode_indices(idx: torch.Tensor, n: int) -> tuple[str, torch.Tensor]:
    """Encode strictly increasing int64 indices in [0, n) with the smallest scheme.

    Returns:
        The scheme name and its data as a 1-D uint8 tensor.

    Raises:
        ValueError: If ``idx`` is not strictly increasing in [0, n) (a caller bug).
    """
    a = np.ascontiguousarray(idx.detach().cpu().reshape(-1).numpy(), dtype=np.int64)
    k = a.size
    deltas = np.diff(a, prepend=0) if k else a
    if k and (a[0] < 0 or a[-1] >= n or (k > 1 and deltas[1:].min() <= 0)):
        raise ValueError("encode_indices needs strictly increasing indices in [0, n)")
    scheme = _smallest(a, deltas, n)
    data = _ENCODERS[scheme](a, deltas, n)
    return scheme, torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))


def decode_indices(scheme: str, data: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Decode ``data`` into k strictly increasing int64 indices in [0, n).

    Raises:
        ProtocolError: Unknown scheme, truncated or garbage data, a count other than ``k``,
            an index out of range, unsorted or duplicate indices.
    """
    if scheme not in _DECODERS:
        raise ProtocolError(f"unknown index scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ProtocolError(f"index data must be a uint8 tensor, got {got}")
    if not 0 <= k <= n:
        raise ProtocolError(f"index count k={k} not in [0, n={n}]")
    buf = data.detach().cpu().reshape(-1).numpy()
    idx = _DECODERS[scheme](buf, k, n)
    _check(idx, k, n, scheme)
    return torch.from_numpy(idx)


# ------------------------------------------------------------------------------------ sizes


def _sizes(a: np.ndarray, deltas: np.ndarray, n: int) -> dict[str, int]:
    """Every applicable scheme's size in bytes, in ``SCHEMES`` order."""
    return {scheme: size() for scheme, _, size in _bounded_sizes(a, deltas, n)}


def _smallest(a: np.ndarray, deltas: np.ndarray, n: int) -> str:
    """The scheme ``_sizes`` finds smallest (the first in ``SCHEMES`` order on a tie), sizing
    only the schemes whose lower bound still beats the best so far: at 1% density Elias-Fano
    wins, and the varints are counted only until they pass it, the block counts not at all."""
    best, least = "", 0
    for scheme, bound, size in _bounded_sizes(a, deltas, n):
        if best and bound >= least:
            continue
        exact = size(least if best else None)
        if not best or exact < least:
            best, least = scheme, exact
    return best


def _bounded_sizes(a: np.ndarray, deltas: np.ndarray, n: int):
    """``(scheme, a lower bound of its size, size(stop=None))`` for every applicable scheme, in
    ``SCHEMES`` order; ``size`` may stop counting once it reaches ``stop`` (then it returns
    a value >= stop, not the size)."""
    k = a.size
    width = int(deltas.max()).bit_length() if k else 0
    ef, bits = 1 + _ef_size(k, n, _ef_low_bits(k, n)), 1 + (k * width + 7) // 8
    yield "ef", ef, lambda stop=None: ef
    yield "bits", bits, lambda stop=None: bits
    yield "varint", k, lambda stop=None: _varint_size(deltas, stop)
    nblocks = -(-n // BLOCK)
    if nblocks <= 2 * k:  # otherwise the counts alone exceed what raw costs
        yield "block", nblocks + 2 * k, lambda stop=None: 2 * k + _varint_size(
            np.bincount(a >> 16, minlength=nblocks), None if stop is None else stop - 2 * k)
    yield "bitmap", (n + 7) // 8, lambda stop=None: (n + 7) // 8
    if n <= 1 << 31:
        yield "raw", 4 * k, lambda stop=None: 4 * k


def _varint_size(values: np.ndarray, stop: int | None = None) -> int:
    """LEB128 bytes of ``values``; counting stops once the total reaches ``stop``."""
    if not values.size:
        return 0
    total, top, shift = values.size, int(values.max()), 7
    while top >> shift and (stop is None or total < stop):
        total += int(np.count_nonzero(values >= (1 << shift)))
        shift += 7
    return total


# ---------------------------------------------------------------------------------- schemes


def _ef_low_bits(k: int, n: int) -> int:
    """The Elias-Fano split that minimizes the size (floor(log2(n/k)) or a neighbour)."""
    if k == 0 or n <= k:
        return 0
    guess = (n // k).bit_length() - 1
    return min((low for low in (guess - 1, guess, guess + 1) if 0 <= low <= 62),
               key=lambda low: _ef_size(k, n, low))


def _ef_size(k: int, n: int, low: int) -> int:
    upper = k + ((n - 1) >> low) + 1 if n else 0
    return (k * low + 7) // 8 + (upper + 7) // 8


def _encode_ef(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    low = _ef_low_bits(a.size, n)
    upper = np.zeros(a.size + ((n - 1) >> low) + 1 if n else 0, dtype=bool)
    upper[(a >> low) + np.arange(a.size)] = True
    return np.concatenate([np.array([low], np.uint8), pack_bits(a & ((1 << low) - 1), low),
                           np.packbits(upper, bitorder="little")])


def _decode_ef(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    if buf.size < 1:
        raise ProtocolError("ef index data is empty (no split byte)")
    low = int(buf[0])
    if low > 62:
        raise ProtocolError(f"ef index data: split {low} > 62")
    if buf.size != 1 + _ef_size(k, n, low):
        raise ProtocolError(f"ef index data has {buf.size} bytes, k={k} n={n} split {low} "
                            f"needs {1 + _ef_size(k, n, low)}")
    low_bytes = (k * low + 7) // 8
    lows = unpack_bits(buf[1:1 + low_bytes], low, k)
    ones = np.unpackbits(buf[1 + low_bytes:], bitorder="little").view(bool).nonzero()[0]
    if ones.size != k:
        raise ProtocolError(f"ef index data holds {ones.size} indices, meta says k={k}")
    # In place: index i is (ones[i] - i) << low | lows[i] (each below 2**low: no carry).
    ones -= np.arange(k)
    ones <<= low
    ones |= lows.view(np.int64)
    return ones


def _encode_bits(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    width = int(deltas.max()).bit_length() if a.size else 0
    return np.concatenate([np.array([width], np.uint8), pack_bits(deltas, width)])


def _decode_bits(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    if buf.size < 1:
        raise ProtocolError("bits index data is empty (no width byte)")
    width = int(buf[0])
    if width > 63:
        raise ProtocolError(f"bits index data: width {width} > 63")
    return _cumsum(unpack_bits(buf[1:], width, k))


def _encode_varint(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    return varint_encode(deltas)


def _decode_varint(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    deltas, used = varint_decode(buf, k)
    if used != buf.size:
        raise ProtocolError(f"varint index data: {buf.size - used} trailing bytes")
    return _cumsum(deltas)


def _encode_block(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    counts = np.bincount(a >> 16, minlength=-(-n // BLOCK))
    offsets = (a & (BLOCK - 1)).astype("<u2").view(np.uint8)
    return np.concatenate([varint_encode(counts), offsets])


def _decode_block(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    nblocks = -(-n // BLOCK)
    counts, used = varint_decode(buf, nblocks)
    if counts.size and int(counts.max()) > BLOCK:
        raise ProtocolError(f"block index data: a block count exceeds {BLOCK}")
    if int(counts.sum()) != k:
        raise ProtocolError(f"block index data counts {int(counts.sum())} indices, k={k}")
    if buf.size - used != 2 * k:
        raise ProtocolError(f"block index data: {buf.size - used} offset bytes for k={k} "
                            f"(want {2 * k})")
    offsets = buf[used:].copy().view("<u2").astype(np.int64)
    starts = np.repeat(np.arange(nblocks, dtype=np.int64) * BLOCK, counts.astype(np.int64))
    return starts + offsets


def _encode_bitmap(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[a] = True
    return np.packbits(mask, bitorder="little")


def _decode_bitmap(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    if buf.size != (n + 7) // 8:
        raise ProtocolError(f"bitmap index data has {buf.size} bytes, n={n} needs {(n + 7) // 8}")
    # Padding bits past n decode to indices >= n and are reported as out of range.
    return np.flatnonzero(np.unpackbits(buf, bitorder="little").view(bool)).astype(np.int64)


def _encode_raw(a: np.ndarray, deltas: np.ndarray, n: int) -> np.ndarray:
    return a.astype("<i4").view(np.uint8)


def _decode_raw(buf: np.ndarray, k: int, n: int) -> np.ndarray:
    if buf.size != 4 * k:
        raise ProtocolError(f"raw index data has {buf.size} bytes, k={k} needs {4 * k}")
    return buf.copy().view("<i4").astype(np.int64)


_ENCODERS = {"ef": _encode_ef, "bits": _encode_bits, "varint": _encode_varint, "block": _encode_block,
             "bitmap": _encode_bitmap, "raw": _encode_raw}
_DECODERS = {"ef": _decode_ef, "bits": _decode_bits, "varint": _decode_varint, "block": _decode_block,
             "bitmap": _decode_bitmap, "raw": _decode_raw}


def _cumsum(deltas: np.ndarray) -> np.ndarray:
    # Deltas are < 2**63; a wrap-around of the sum shows up as a decrease, caught by _check.
    return np.cumsum(deltas.astype(np.int64))


def _check(idx: np.ndarray, k: int, n: int, scheme: str) -> None:
    if idx.size != k:
        raise ProtocolError(f"{scheme} index data holds {idx.size} indices, meta says k={k}")
    if not k:
        return
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= n:
        bad = low if low < 0 else high
        raise ProtocolError(f"index {bad} out of range [0, {n})")
    steps = np.diff(idx)
    if steps.size and int(steps.min()) <= 0:
        if np.any(steps == 0):
            raise ProtocolError(f"duplicate index {int(idx[np.flatnonzero(steps == 0)[0]])}")
        raise ProtocolError("indices are not sorted")


# ------------------------------------------------------------------------ bits and varints


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative ints (< 2**width) LSB first at ``width`` bits each."""
    if width == 0 or values.size == 0:
        return _EMPTY
    if width <= 8:
        return _pack_narrow(values, width)
    nbytes = (width + 7) // 8
    raw = np.ascontiguousarray(values, dtype="<u8").view(np.uint8).reshape(-1, 8)[:, :nbytes]
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _pack_narrow(values: np.ndarray, width: int) -> np.ndarray:
    """``pack_bits`` for widths up to 8 by shifts and ors: eight values fill ``width`` bytes
    of one uint64 exactly, so no value is ever spread out to one byte per bit (Elias-Fano's
    low bits at 1% density are 6 or 7 wide)."""
    count = values.size
    groups = -(-count // 8)
    v = np.zeros(groups * 8, dtype=np.uint64)
    v[:count] = values
    v &= np.uint64((1 << width) - 1)  # as the general path, which keeps the low bits only
    v = v.reshape(groups, 8)
    word = v[:, 0].copy()
    for j in range(1, 8):
        word |= v[:, j] << np.uint64(j * width)
    packed = word.astype("<u8", copy=False).view(np.uint8).reshape(groups, 8)[:, :width]
    return packed.reshape(-1)[:(count * width + 7) // 8]


def unpack_bits(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of ``pack_bits``; the data must have exactly the bytes ``count`` values need."""
    need = (count * width + 7) // 8
    if buf.size != need:
        raise ProtocolError(f"bit-packed data has {buf.size} bytes, {count} values of "
                            f"{width} bits need {need}")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    if width <= 8:
        return _unpack_narrow(buf, width, count)
    if width <= 57:
        # Every value lies in the 8 bytes from its first byte: gather them as one uint64.
        starts = np.arange(count, dtype=np.int64) * width
        padded = np.concatenate([buf, np.zeros(8, dtype=np.uint8)])
        # An unaligned uint64 view at every byte offset (x86 and arm64 load those fine).
        every = np.ndarray((buf.size + 1,), dtype="<u8", buffer=padded, strides=(1,))
        words = every[starts >> 3]
        shifts = (starts & 7).astype(np.uint64)
        return (words >> shifts) & np.uint64((1 << width) - 1)
    bits = np.unpackbits(buf, count=count * width, bitorder="little").reshape(count, width)
    out = np.zeros((count, 8), dtype=np.uint8)
    out[:, :(width + 7) // 8] = np.packbits(bits, axis=1, bitorder="little")
    return out.view("<u8").reshape(-1)


def _unpack_narrow(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """``unpack_bits`` for widths up to 8: every ``width`` bytes hold eight values, read as
    one uint64 and split by shifts (no gather at a per-value byte offset)."""
    groups = -(-count // 8)
    padded = np.zeros(groups * width, dtype=np.uint8)
    padded[:buf.size] = buf
    words = np.zeros((groups, 8), dtype=np.uint8)
    words[:, :width] = padded.reshape(groups, width)
    word = words.view("<u8").reshape(groups)
    mask = np.uint64((1 << width) - 1)
    out = np.empty((groups, 8), dtype=np.uint64)
    for j in range(8):
        np.bitwise_and(word >> np.uint64(j * width), mask, out=out[:, j])
    return out.reshape(-1)[:count]


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 encoding of non-negative ints (< 2**63), concatenated."""
    if not values.size:
        return _EMPTY
    v = np.ascontiguousarray(values, dtype=np.uint64)
    longest = max(1, -(-int(v.max()).bit_length() // 7))
    lengths = np.ones(v.size, dtype=np.int64)
    for j in range(1, longest):
        lengths += v >= np.uint64(1 << (7 * j))
    table = np.empty((v.size, longest), dtype=np.uint8)
    for j in range(longest):
        byte = ((v >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        table[:, j] = byte | np.where(j < lengths - 1, 0x80, 0).astype(np.uint8)
    return table[np.arange(longest) < lengths[:, None]]


def varint_decode(buf: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The first ``count`` LEB128 values of ``buf`` and the bytes they used."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    ends = np.flatnonzero(buf < 0x80)[:count]
    if ends.size < count:
        raise ProtocolError(f"varint data truncated: {ends.size} of {count} values complete")
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise ProtocolError(f"varint longer than {_MAX_VARINT_BYTES} bytes")
    used = int(ends[-1]) + 1
    shifts = (np.arange(used, dtype=np.int64) - np.repeat(starts, lengths)) * 7
    parts = (buf[:used] & 0x7F).astype(np.uint64) << shifts.astype(np.uint64)
    return np.add.reduceat(parts, starts), used
