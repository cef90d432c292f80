"""What crosses the wire: a small header plus raw tensor buffers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Message:
    """One message between two peers.

    Attributes:
        kind: What the message is for, e.g. ``"gossip"`` or ``"ring.rs"``; receivers match on it.
        round: The training round (iteration) it belongs to.
        src: Rank of the sender (set by the transport on send).
        meta: Small msgpack-able header values (step numbers, scales, ...).
        buffers: Tensors sent as raw frames after the header.
        wire: For the transport only: the frames a received message arrived in. A buffer
            sent on in place (the same memory) goes out as its received frame: no copy, and
            nothing for the sender to track (see ``Transport.send``).
    """

    kind: str
    round: int
    src: int = -1
    meta: Mapping[str, Any] = field(default_factory=dict)
    buffers: tuple[torch.Tensor, ...] = ()
    wire: tuple = field(default=(), repr=False, compare=False)
