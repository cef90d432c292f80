"""The sparse-block wire format of the sparse all-reduce strategies.

One message carries any number of blocks of one tensor::

    meta = {"n": tensor length, "s": step, "b": [block ids], "k": [counts],
            "ix": [index scheme per block], "nb": [index bytes per block]}
    buffers = (values of all blocks, concatenated; index data of all blocks, uint8)

Indices are block-local and travel in the encodings of ``gossip.compress.indices``: the
smallest of its schemes (``indices="compact"``, about 1.1 bytes per index at 1% density) or
plain int32 (``indices="int32"``). Each block is encoded once by the peer that selects it;
a peer forwarding a block forwards its bytes. Everything received is validated (block ids,
counts, dtype, indices sorted, distinct and in range) and a violation raises ProtocolError
naming the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip.compress.indices import decode_indices, encode_indices
from gossip.errors import ProtocolError
from gossip.transport import Message


@dataclass
class Block:
    """One sparse block as it travels: decoded indices and values, and its wire bytes."""

    id: int
    idx: np.ndarray   # int64, block-local, sorted, distinct
    val: np.ndarray
    scheme: str
    data: np.ndarray  # uint8 index data


def encode_block(block_id: int, idx: np.ndarray, val: np.ndarray, length: int,
                 coding: str) -> Block:
    """``idx`` (sorted, in [0, length)) and ``val`` in their wire form."""
    if coding == "int32":
        scheme, data = "raw", idx.astype("<i4").view(np.uint8)
    else:
        scheme, encoded = encode_indices(torch.from_numpy(idx), length)
        data = encoded.numpy()
    return Block(block_id, idx, val, scheme, data)


def pack(kind: str, round: int, blocks: Sequence[Block], *, n: int, step: int,
         epoch: int | None = None) -> Message:
    """One message carrying ``blocks`` of a tensor of length ``n`` (in an elastic view: of
    its ``epoch``, as ``meta.e``)."""
    meta = block_meta(n, step, [b.id for b in blocks], [int(b.idx.size) for b in blocks],
                      [b.scheme for b in blocks], [int(b.data.size) for b in blocks])
    if epoch is not None:
        meta["e"] = epoch
    if len(blocks) == 1:
        values, data = blocks[0].val, blocks[0].data
    else:
        values = np.concatenate([b.val for b in blocks])
        data = np.concatenate([b.data for b in blocks])
    return Message(kind=kind, round=round, meta=meta,
                   buffers=(_tensor(values), _tensor(data)))


def block_meta(n: int, step: int, ids: list, counts: list, schemes: list,
               sizes: list) -> dict[str, Any]:
    """The header meta of a message of blocks (the module docstring's ``meta``)."""
    return {"n": n, "s": step, "b": ids, "k": counts, "ix": schemes, "nb": sizes}


def _tensor(a: np.ndarray) -> torch.Tensor:
    # numpy gives empty results stride 0, which the codec's byte view rejects.
    tensor = torch.from_numpy(a)
    return tensor if a.size else torch.empty(0, dtype=tensor.dtype)


def unpack(msg: Message, *, rank: int, n: int, step: int, blocks: Sequence[int], length: int,
           limit: int, dtype: torch.dtype) -> list[Block]:
    """The blocks of ``msg``, checked against what the schedule expects.

    Args:
        blocks: The block ids expected, in order.
        length: Block length (indices lie in [0, length)).
        limit: Most entries a block may carry.

    Raises:
        ProtocolError: naming the sender and what is wrong.
    """
    def fail(reason: str) -> ProtocolError:
        return ProtocolError(f"rank {rank}: peer {msg.src} sent {msg.kind} round {msg.round} "
                             f"step {step}: {reason}")

    meta = msg.meta
    if meta.get("n") != n:
        raise fail(f"tensor length {meta.get('n')!r}, ours is {n} (do all peers synchronize "
                   f"tensors of the same length?)")
    if meta.get("s") != step or meta.get("b") != list(blocks):
        raise fail(f"step {meta.get('s')!r} blocks {meta.get('b')!r}, expected step {step} "
                   f"blocks {list(blocks)}")
    counts, schemes, sizes = meta.get("k"), meta.get("ix"), meta.get("nb")
    m = len(blocks)
    if not (_int_list(counts, m) and _int_list(sizes, m) and isinstance(schemes, list)
            and len(schemes) == m and all(isinstance(s, str) for s in schemes)):
        raise fail(f"malformed block header k={counts!r} ix={schemes!r} nb={sizes!r}")
    if len(msg.buffers) != 2:
        raise fail(f"{len(msg.buffers)} buffers, expected 2 (values, index data)")
    values, data = msg.buffers
    if values.dtype != dtype or data.dtype != torch.uint8:
        raise fail(f"buffers of {values.dtype} and {data.dtype}, expected {dtype} and uint8")
    if any(not 0 <= c <= limit for c in counts):
        raise fail(f"block counts {counts} exceed the {limit} entries a block may carry")
    if values.numel() != sum(counts) or data.numel() != sum(sizes) or min(sizes, default=0) < 0:
        raise fail(f"{values.numel()} values and {data.numel()} index bytes, header says "
                   f"{sum(counts)} and {sum(sizes)}")
    values, data = values.numpy(), data.numpy()
    out, v0, d0 = [], 0, 0
    for block_id, count, scheme, size in zip(blocks, counts, schemes, sizes):
        raw = data[d0:d0 + size]
        try:
            idx = decode_indices(scheme, torch.from_numpy(raw), count, length).numpy()
        except ProtocolError as exc:
            raise fail(f"block {block_id}: {exc}") from None
        out.append(Block(block_id, idx, values[v0:v0 + count], scheme, raw))
        v0, d0 = v0 + count, d0 + size
    return out


def _int_list(value: Any, length: int) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
