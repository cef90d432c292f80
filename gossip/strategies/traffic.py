"""A strategy's message pattern with sizes and no payloads: what the sizes-only simulation
(gossip/sim/sizes.py) replays at 10^4 peers, where running the math of every peer is too slow.

A plan is one rank's round as an iterable of ``Step``: the messages it sends, then the
messages it waits for before its next step; iterated once per round. A list will do where a
round has few steps; a ``Plan`` makes its steps as they are replayed, where lists would add
up to O(P^2) over P ranks (the ring's 2(P-1) steps each). Sizes are the bytes the transport
counts (header + frames) in round 0; ``round_bytes`` adds what a later round's number adds
to the msgpack header.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import msgpack
import torch

from gossip.transport import Message, codec


class Step(NamedTuple):
    """Sends ``(dst, kind, bytes in round 0)``, then waits for one message per ``(src, kind)``."""

    sends: tuple[tuple[int, str, int], ...]
    recvs: tuple[tuple[int, str], ...]


class Plan:
    """A plan whose steps are made as they are iterated: ``steps()`` once per round."""

    def __init__(self, steps: Callable[[], Iterator[Step]]):
        self._steps = steps

    def __iter__(self) -> Iterator[Step]:
        return self._steps()


def message_bytes(rank: int, kind: str, meta: dict, buffers: list[tuple[torch.dtype, int]]) -> int:
    """Bytes the transport counts for a message of round 0 with ``meta`` and buffers of
    ``(dtype, numel)`` (their values do not matter: none are allocated beyond the empties).

    The codec encodes a message once per shape: messages whose header numbers take as many
    bytes in msgpack (the same width class) have the same size."""
    return _encoded_bytes(_same_width(rank), kind, _shape(meta), tuple(buffers))


@functools.lru_cache(maxsize=4096)
def _encoded_bytes(rank: int, kind: str, meta: tuple, buffers: tuple) -> int:
    tensors = tuple(torch.empty(numel, dtype=dtype) for dtype, numel in buffers)
    message = Message(kind=kind, round=0, meta=_unshape(meta), buffers=tensors)
    header, frames = codec.encode(message, rank)
    return len(header) + sum(f.numel() for f in frames)


def _same_width(value: int) -> int:
    """The smallest int msgpack encodes in as many bytes as ``value``."""
    if value >= 0:
        return 0 if value < 128 else 128 if value < 256 else 256 if value < 65536 else \
            65536 if value < 2**32 else 2**32
    return -1 if value >= -32 else -33 if value >= -128 else -129 if value >= -32768 else \
        -32769 if value >= -2**31 else -2**31 - 1


def _shape(value):
    """``value`` made hashable, every int replaced by one of its msgpack width: what its
    encoded size depends on (on the hot path of a replay: exact types first)."""
    kind = type(value)
    if kind is int:
        return _same_width(value)
    if kind is dict or (kind is not str and isinstance(value, Mapping)):
        return ("map", tuple([(_shape(k), _shape(v)) for k, v in value.items()]))
    if kind is list or kind is tuple:
        return ("array", tuple([_shape(v) for v in value]))
    if kind is float:
        return 0.0  # always a float 64
    return value  # str, bytes, bool, None: as they are


def _unshape(shape):
    if isinstance(shape, tuple):
        kind, items = shape
        if kind == "map":
            return {_unshape(k): _unshape(v) for k, v in items}
        return [_unshape(v) for v in items]
    return shape


def round_bytes(round: int) -> int:
    """Bytes the header of a round-``round`` message has more than one of round 0."""
    return len(msgpack.packb(int(round))) - 1
