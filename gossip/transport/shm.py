"""Shared memory between peers on one machine: large frames skip the socket.

Over a Unix socket the kernel copies every byte twice (into the socket, out of it into
memory libzmq allocates per message), and on a small machine that is most of a large
all-reduce's CPU. Between peers on the same machine the sender instead copies a large frame
once into a segment of its own that the receiver has mapped, and ZeroMQ carries the header
plus where the bytes are (an *envelope*). The receiver reads and updates them in place:
they are its own memory until it drops them, like any received frame.

Segments: one per (sender, destination), an anonymous memfd the receiver opens through
``/proc/<pid>/fd/<fd>``, so nothing is ever left behind, however the processes end.
Handshake: the sender offers (pid, fd, size, token); the receiver maps the segment, checks
that it is a gossip memfd holding the token (the same memory, not a namesake pid on another
host) and belongs to this user (no other could change frames under it), and accepts; only
then do frames go through it. A receiver that cannot (another user, a hardened /proc)
refuses and everything keeps going over the socket.

Slots: the sender places each frame in a record whose first 8 bytes are a state word (busy,
free). The receiver marks it free once the last reference to the frame is gone; the sender
reuses space in allocation order once it is free. With no room (a receiver keeping frames,
a burst) a frame simply goes over the socket instead: never a wait, never a deadlock.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from gossip.errors import PeerTimeout, ProtocolError
from gossip.transport import codec
from gossip.transport.message import Message

log = logging.getLogger("gossip.transport")

# The handshake's message kinds, handled by the transport itself.
OFFER, ACCEPT, REFUSE = "shm.offer", "shm.accept", "shm.refuse"
KINDS = frozenset({OFFER, ACCEPT, REFUSE})
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


def validate(msg: Message) -> None:
    """Raise ProtocolError if a handshake message's meta is malformed."""
    meta = msg.meta
    token = meta.get("token")
    fields = {"token": isinstance(token, str) and len(token) == 32
              and all(c in "0123456789abcdef" for c in token)}
    if msg.kind == OFFER:
        fields.update({name: isinstance(meta.get(name), int)
                       and not isinstance(meta.get(name), bool) for name in ("pid", "fd", "size")})
    elif msg.kind == REFUSE:
        fields["why"] = isinstance(meta.get("why"), str)
    bad = [name for name, ok in fields.items() if not ok]
    if bad:
        raise ProtocolError(f"{msg.kind} from peer {msg.src}: bad meta: "
                            + ", ".join(f"{name}={meta.get(name)!r}" for name in bad))


def is_envelope(frame) -> bool:
    return bytes(codec.frame_buffer(frame)[:len(MAGIC)]) == MAGIC


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


class SharedMemory:
    """One transport's shared memory with the peers on its machine: its segments to them,
    theirs to it, and the handshake between the two.

    Args:
        rank: The transport's rank, for log lines.
        send: ``send(dst, kind, meta)`` sends a handshake message.
        describe: How to name a rank in log lines.
        enabled: Offer segments and accept offers; False refuses every offer.
        reachable: Whether a rank is on this machine, so that it may be offered a segment.
    """

    def __init__(self, rank: int, send: Callable[[int, str, dict], None],
                 describe: Callable[[int], str], enabled: bool, *,
                 reachable: Callable[[int], bool]):
        self.rank, self._send, self._describe = rank, send, describe
        self.enabled, self._reachable = enabled, reachable
        self._outboxes: dict[int, Outbox | None] = {}  # None: the socket only
        self._inbox = Inbox() if enabled else None

    def outbox(self, dst: int, frames: list) -> Outbox | None:
        """The segment for ``dst`` once it accepted it, else None. The first large frame for
        a peer on this machine offers it one."""
        if dst in self._outboxes:
            return self._outboxes[dst] if self.shares_with(dst) else None
        if not any(f.numel() >= MIN_FRAME_BYTES for f in frames):
            return None
        outbox = None
        if self.enabled and self._reachable(dst):
            try:
                outbox = Outbox()
            except OSError as exc:
                log.info("rank %d: no shared memory for %s (%s)", self.rank,
                         self._describe(dst), exc)
        self._outboxes[dst] = outbox
        if outbox is not None:
            self._send(dst, OFFER, outbox.offer())
        return None

    def shares_with(self, rank: int) -> bool:
        """Whether large frames to ``rank`` go through shared memory now."""
        outbox = self._outboxes.get(rank)
        return outbox is not None and outbox.accepted

    def handle(self, msg: Message) -> None:
        """Answer an offer, or take an answer to ours."""
        if msg.kind == OFFER:
            why = (self._inbox.attach(msg.src, msg.meta) if self._inbox is not None
                   else "shared memory is off here")
            token = msg.meta.get("token")
            try:
                if why is None:
                    self._send(msg.src, ACCEPT, {"token": token})
                else:
                    self._send(msg.src, REFUSE, {"token": token, "why": why})
            except PeerTimeout:
                pass  # it is not reading: it will not send either
            return
        outbox = self._outboxes.get(msg.src)
        if outbox is None or msg.meta.get("token") != outbox.token.hex():
            # An answer to an offer since withdrawn (the peer restarted meanwhile), or to none.
            log.info("rank %d: ignored %s from %s: not about its current segment", self.rank,
                     msg.kind, self._describe(msg.src))
        elif msg.kind == ACCEPT:
            outbox.accepted = True
        else:
            log.info("rank %d: %s cannot map shared memory (%s); large frames to it go over "
                     "the socket", self.rank, self._describe(msg.src), msg.meta.get("why"))
            self._outboxes[msg.src] = None
            outbox.close()

    def restarted(self, rank: int) -> None:
        """``rank`` restarted: records its old process held stay busy for good, so its
        successor gets a fresh segment, offered with the next large frame."""
        outbox = self._outboxes.pop(rank, None)
        if outbox is not None:
            outbox.close()

    def open(self, frames: list) -> list:
        """An envelope's message with its frames mapped in place (see ``Inbox.open``)."""
        if self._inbox is None:
            raise ProtocolError("frames in shared memory, which is off here")
        return self._inbox.open(frames)

    def close(self) -> None:
        for outbox in self._outboxes.values():
            if outbox is not None:
                outbox.close()
        self._outboxes.clear()
        if self._inbox is not None:
            self._inbox.close()
