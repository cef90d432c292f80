"""A strategy's message pattern with sizes and no payloads: what the sizes-only simulation
(gossip/sim/sizes.py) replays at 10^4 peers, where running the math of every peer is too slow.

A plan is one rank's round as a list of ``Step``: the messages it sends, then the messages it
waits for before its next step. Sizes are the bytes the transport counts (header + frames)
in round 0; ``round_bytes`` adds what a later round's number adds to the msgpack header.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack
import torch

from gossip.transport import Message, codec


class Step(NamedTuple):
    """Sends ``(dst, kind, bytes in round 0)``, then waits for one message per ``(src, kind)``."""

    sends: tuple[tuple[int, str, int], ...]
    recvs: tuple[tuple[int, str], ...]


def message_bytes(rank: int, kind: str, meta: dict, buffers: list[tuple[torch.dtype, int]]) -> int:
    """Bytes the transport counts for a message of round 0 with ``meta`` and buffers of
    ``(dtype, numel)`` (their values do not matter: none are allocated beyond the empties)."""
    tensors = tuple(torch.empty(numel, dtype=dtype) for dtype, numel in buffers)
    header, frames = codec.encode(Message(kind=kind, round=0, meta=meta, buffers=tensors), rank)
    return len(header) + sum(f.numel() for f in frames)


def round_bytes(round: int) -> int:
    """Bytes the header of a round-``round`` message has more than one of round 0."""
    return len(msgpack.packb(int(round))) - 1
