"""Shared-memory segments: the sender's Outbox, the receiver's mappings (Inbox), and the
envelope that says where a message's frames lie.

Segments: one per (sender, destination), an anonymous memfd the receiver opens through
``/proc/<pid>/fd/<fd>``, so nothing is ever left behind, however the processes end.

Slots: the sender places each frame in a record whose first 8 bytes are a state word (busy,
free). The receiver marks it free once the last reference to the frame is gone; the sender
reuses space in allocation order once it is free. With no room (a receiver keeping frames,
a burst) a frame simply goes over the socket instead: never a wait, never a deadlock.

The handshake that sets a segment up between two peers is shm.py's.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import weakref
from collections import deque

import numpy as np
import torch

from gossip.errors import ProtocolError
from gossip.transport import codec

log = logging.getLogger("gossip.transport")

# Smaller frames stay in the socket message: copying them there is cheaper.
MIN_FRAME_BYTES = codec.ZERO_COPY_MIN_BYTES
# Address space per segment. Memory is taken only as records are placed (and reserved with
# fallocate, so a full machine means "use the socket", not SIGBUS); the lowest free space is
# used first, so a segment's resident size stays near the bytes in flight at once.
SEGMENT_BYTES = 1 << 30
# Memory is reserved in steps of this many bytes.
RESERVE_STEP = 16 << 20
ALIGN = 64  # records and frames start on cache lines
DATA_START = ALIGN  # the token lives before it
RECORD_HEADER = ALIGN  # the state word, then padding to keep the frame aligned
BUSY, FREE = 1, 0
MEMFD_NAME = "gossip-frames"

# Envelope: frame 0 of a message whose frames are (partly) in shared memory. No msgpack
# header starts with a zero byte, so it cannot be mistaken for one.
MAGIC = b"\x00shm1"
_HEAD = struct.Struct("<iIQ16sH")  # sender pid, its fd, segment size and token, entries
_ENTRY = struct.Struct("<HQQ")  # frame index, data offset, bytes
MAX_ENTRIES = 64


def is_envelope(frame) -> bool:
    buf = codec.frame_buffer(frame)
    return bool(buf) and buf[0] == 0 and bytes(buf[:len(MAGIC)]) == MAGIC


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Outbox:
    """The sender's segment for one destination: places frames, reuses freed space."""

    def __init__(self, size: int | None = None):
        self.size = size = size or SEGMENT_BYTES
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.token = os.urandom(16)
        self._map[:16] = self.token
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._states = np.frombuffer(self._map, dtype=np.int64)
        self._live: deque[tuple[int, int]] = deque()  # (start, end) of records, oldest first
        self._reserved = DATA_START  # bytes backed by fallocate so far
        self._limit = size  # where records may end: less once the machine ran out of memory
        self.accepted = False  # the destination mapped the segment

    def offer(self) -> dict:
        return {"pid": os.getpid(), "fd": self.fd, "size": self.size, "token": self.token.hex()}

    def put(self, frame: torch.Tensor) -> tuple[int, int] | None:
        """Copy a uint8 frame into a free record: its (data offset, bytes), or None if it
        belongs in the socket message (small) or the segment has no room for it now."""
        nbytes = frame.numel()
        if nbytes < MIN_FRAME_BYTES or nbytes > self._limit // 4:  # a few must fit at once
            return None
        start = self._allocate(RECORD_HEADER + _aligned(nbytes))
        if start is None:
            return None
        self._states[start // 8] = BUSY
        data = start + RECORD_HEADER
        # A plain memory copy on this thread: a torch copy this large runs on torch's
        # intra-op pool, whose threads stall when several peers share the cores.
        np.copyto(self._bytes[data:data + nbytes], frame.numpy())
        return data, nbytes

    def free(self, data_offsets) -> None:
        """Give back records whose message was never sent."""
        for data in data_offsets:
            self._states[(data - RECORD_HEADER) // 8] = FREE

    def envelope(self, entries: list[tuple[int, int, int]]) -> bytes:
        """Frame 0 of a message whose frames ``(index, offset, bytes)`` are in this segment."""
        return (MAGIC + _HEAD.pack(os.getpid(), self.fd, self.size, self.token, len(entries))
                + b"".join(_ENTRY.pack(*entry) for entry in entries))

    def _allocate(self, need: int) -> int | None:
        live = self._live
        while live and self._states[live[0][0] // 8] == FREE:  # the receiver is done
            live.popleft()
        if not live:
            start = DATA_START
        else:
            head, tail = live[0][0], live[-1][1]
            wrapped = live[-1][0] < head
            if not wrapped and DATA_START + need <= head:  # lowest free space first
                start = DATA_START
            elif tail + need <= (head if wrapped else self._limit):
                start = tail
            else:
                return None
        if not self._reserve(start + need):
            return None
        live.append((start, start + need))
        return start

    def _reserve(self, end: int) -> bool:
        if end <= self._reserved:
            return True
        grown = min(self._limit, -(-end // RESERVE_STEP) * RESERVE_STEP)
        try:
            os.posix_fallocate(self.fd, self._reserved, grown - self._reserved)
        except OSError as exc:
            log.warning("shared memory: cannot reserve %d more bytes (%s); the segment stays "
                        "at %d bytes, larger bursts go over the socket",
                        grown - self._reserved, exc, self._reserved)
            self._limit = self._reserved  # asked once, not at every frame
            return False
        self._reserved = grown
        return True

    def close(self) -> None:
        del self._bytes, self._states
        try:
            self._map.close()
        except BufferError:  # a frame still being copied elsewhere: left to the collector
            pass
        os.close(self.fd)


class _Segment:
    """A sender's segment as mapped by the receiver."""

    def __init__(self, pid: int, fd: int, size: int, token: bytes):
        path = f"/proc/{pid}/fd/{fd}"
        target = os.readlink(path)
        if not target.startswith(f"/memfd:{MEMFD_NAME}"):
            raise OSError(f"{path} is {target}, not a gossip segment")
        handle = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(handle)
            if stat.st_uid != os.getuid():  # another user could change frames under us
                raise OSError(f"{path} belongs to uid {stat.st_uid}, not to this user")
            if stat.st_size != size:
                raise OSError(f"{path} is not {size} bytes")
            self.map = mmap.mmap(handle, size)
        finally:
            os.close(handle)
        if self.map[:16] != token:
            self.map.close()
            raise OSError(f"{path} does not hold the offered token")
        self.size = size
        self.states = np.frombuffer(self.map, dtype=np.int64)

    def frame(self, offset: int, nbytes: int) -> np.ndarray:
        """The received frame at ``offset``; its record is freed when the last reference to
        it (tensor, view, forwarded message) is gone."""
        frame = np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=offset)
        weakref.finalize(frame, self.states.__setitem__, (offset - RECORD_HEADER) // 8, FREE)
        return frame


class Inbox:
    """The segments of every sender that offered one, by token."""

    def __init__(self):
        self._segments: dict[bytes, _Segment] = {}
        self._by_sender: dict[int, bytes] = {}

    def attach(self, src: int, offer) -> str | None:
        """Map a sender's offered segment; None if done, else why not."""
        try:
            pid, fd, size, token = (offer["pid"], offer["fd"], offer["size"],
                                    bytes.fromhex(offer["token"]))
            if not (isinstance(pid, int) and isinstance(fd, int) and isinstance(size, int)
                    and len(token) == 16 and 0 < size <= SEGMENT_BYTES):
                raise ValueError("bad pid, fd, size or token")
            segment = _Segment(pid, fd, size, token)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        old = self._by_sender.pop(src, None)  # a restarted sender: its old segment is done
        self._segments.pop(old, None)
        self._segments[token] = segment
        self._by_sender[src] = token
        return None

    def open(self, frames: list) -> list:
        """The frames of an envelope's message, those in shared memory mapped in place.

        Raises ProtocolError naming what is wrong with the envelope.
        """
        body = codec.frame_buffer(frames[0])[len(MAGIC):]
        if len(body) < _HEAD.size:
            raise ProtocolError("shared-memory envelope is truncated")
        pid, fd, size, token, count = _HEAD.unpack_from(body)
        if not 0 < count <= MAX_ENTRIES or len(body) != _HEAD.size + count * _ENTRY.size:
            raise ProtocolError(f"shared-memory envelope of {len(body)} bytes does not hold "
                                f"{count} entries")
        segment = self._segments.get(bytes(token))
        if segment is None:
            # A receiver restarted since the handshake: the sender's segment is still there.
            try:
                if not 0 < size <= SEGMENT_BYTES:
                    raise OSError(f"segment size {size} out of range")
                segment = _Segment(pid, fd, size, bytes(token))
            except OSError as exc:
                raise ProtocolError(f"cannot map the sender's shared memory: {exc}") from None
            self._segments[bytes(token)] = segment
        out = list(frames[1:])
        seen = set()
        for i in range(count):
            index, offset, nbytes = _ENTRY.unpack_from(body, _HEAD.size + i * _ENTRY.size)
            placeholder = 1 <= index < len(out) and not len(codec.frame_buffer(out[index]))
            if not placeholder or index in seen:
                raise ProtocolError(f"shared-memory envelope names frame {index}, which is "
                                    f"not an empty placeholder")
            if (offset % ALIGN or offset < DATA_START + RECORD_HEADER or nbytes == 0
                    or offset + nbytes > segment.size):
                raise ProtocolError(f"shared-memory frame {index} at {offset} of {nbytes} "
                                    f"bytes is outside the sender's segment")
            seen.add(index)
            out[index] = segment.frame(offset, nbytes)
        return out

    def close(self) -> None:
        # Frames still referenced keep their mapping alive; the rest unmap with the objects.
        self._segments.clear()
        self._by_sender.clear()
