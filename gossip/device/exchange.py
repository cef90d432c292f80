"""A device tensor sent to a peer piece by piece, its copies pipelined with the sends.

Sender: piece i+1 is copied device -> pinned slot (side stream, event) while piece i is on
the wire; each slot is handed to ZeroMQ zero-copy and returns to the pool when its send
completes. Receiver: each piece is staged in a pinned slot (pyzmq's recv_into would
spare that host copy; the transport does not use it yet) and copied host -> device without blocking, so the copy of
piece i overlaps the wait for piece i+1; the device tensor is complete once the caller's
stream reaches the last copy. Each piece is one message whose meta names its range, checked
against the receiver's tensor.
"""

from __future__ import annotations

import torch

from gossip.device.copier import Copier
from gossip.device.pipeline import pieces, pipelined
from gossip.device.pool import HostPool
from gossip.errors import ProtocolError
from gossip.transport import Message


def send_device(transport, dst: int, x: torch.Tensor, *, pool: HostPool, copier: Copier,
                kind: str, round: int) -> None:
    """Send the flat contiguous ``x`` to ``dst`` in pieces of one pool slot each."""
    flat = x.reshape(-1)
    slots: dict[int, tuple[int, torch.Tensor]] = {}

    def start(i, lo, hi):
        slots[i] = pool.acquire(flat.dtype, hi - lo)
        return copier.start(slots[i][1], flat[lo:hi])

    def finish(i, event):
        index, slot = slots.pop(i)
        event.synchronize()  # the slot holds piece i only once its copy has completed
        lo, hi = ranges[i]
        delivery = transport.send(dst, Message(kind=kind, round=round,
                                               meta={"lo": lo, "hi": hi, "n": flat.numel()},
                                               buffers=(slot,)), track=True)
        pool.release_after(index, delivery.wait)

    copier.after_device_work()
    ranges = pieces(flat.numel(), _piece_numel(pool, flat))
    pipelined(ranges, start, finish, ahead=pool.depth - 1)
    pool.drain()


def recv_device(transport, src: int, out: torch.Tensor, *, pool: HostPool, copier: Copier,
                kind: str, round: int) -> torch.Tensor:
    """Receive what ``send_device`` sent into the flat contiguous ``out`` (on any device);
    the caller's stream waits for the last copy. Raises ProtocolError on a bad piece."""
    flat = out.reshape(-1)
    event = None
    for lo, hi in pieces(flat.numel(), _piece_numel(pool, flat)):
        msg = transport.recv(src=src, kind=kind, round=round)
        meta = msg.meta
        if (meta.get("lo"), meta.get("hi"), meta.get("n")) != (lo, hi, flat.numel()) or \
                len(msg.buffers) != 1 or msg.buffers[0].dtype != flat.dtype or \
                msg.buffers[0].numel() != hi - lo:
            raise ProtocolError(f"peer {src} sent piece {meta.get('lo')}:{meta.get('hi')} of "
                                f"{meta.get('n')} where {lo}:{hi} of {flat.numel()} "
                                f"{flat.dtype} was expected")
        piece = msg.buffers[0].reshape(-1)
        if pool.pinned:  # a copy from pageable memory would block: stage it in a slot
            index, slot = pool.acquire(flat.dtype, hi - lo)
            piece = slot.copy_(piece)
        event = copier.start(flat[lo:hi], piece)
        if pool.pinned:
            pool.release_after(index, event.synchronize)
    if event is not None:
        copier.before_device_use(event)
    return out


def _piece_numel(pool: HostPool, flat: torch.Tensor) -> int:
    return max(1, pool.slot_bytes // flat.element_size())
