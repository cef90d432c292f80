"""ZeroMQ TCP transport: one PULL socket bound per peer, one PUSH socket per destination.

PUSH queues messages while a destination is still starting, so peers may start in any
order. Per-pair ordering is FIFO, which the strategies rely on for multi-part exchanges.
With CURVE keys every socket authenticates and encrypts (ipc twins included): the PULL socket
is a CURVE server that lets in only the topology's keys (auth.py), each PUSH a CURVE client.
Without keys, large frames to peers on this machine go through shared memory (shm.py).
The sockets' settings are sockets.py's, the Unix-socket twin of a local peer endpoints.py's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import zmq

from gossip.errors import PeerTimeout, ProtocolError, TransportError
from gossip.keys import CurveKeys, for_rank
from gossip.transport import codec, shm
from gossip.transport.auth import ZapHandler
from gossip.transport.base import BYE, Transport
from gossip.transport.endpoints import Endpoints, bind_address, is_ipv6
from gossip.transport.malloc_tuning import keep_freed_buffers
from gossip.transport.message import Message
from gossip.transport.monitor import ConnectionWatch, LinkWatch
from gossip.transport.shm_segments import is_envelope
from gossip.transport.sockets import CURVE_FRAME_OVERHEAD, Tracker, pull_socket, push_socket

# A peer is declared dead once our connection to it has been down this long (default).
DEAD_AFTER_S = 5.0
# No valid message has more frames: a shared-memory envelope, the header, MAX_TENSORS tensors.
MAX_FRAMES = 2 + codec.MAX_TENSORS
# While a receive waits, the connection monitors are read this often (and whenever the
# queue runs empty after that): a dead peer is noticed at most this much later.
WATCH_EVERY_S = 0.1


class ZmqTransport(Transport):
    """Messages over ZeroMQ TCP between ranks whose endpoints are ``tcp://host:port``.

    Args:
        rank: This peer's rank; it binds ``endpoints[rank]``.
        endpoints: Every rank's endpoint, indexed by rank.
        local_ipc: Reach peers on loopback addresses through a Unix socket (faster).
        shared_memory: Send large frames to those peers through shared memory (faster
            still; shm.py). Off with CURVE keys, whose promise is encrypted bytes, and with
            ``GOSSIP_SHARED_MEMORY=0`` in the environment.
        keys: CURVE keys (``gossip.keys.for_rank``): authenticate and encrypt every
            connection, let in only the other ranks' keys, and reject messages whose ``src``
            is not the rank whose key sent them. None: plaintext, anyone may connect.
        dead_after: Declare a peer dead once our connection to it has been down this many
            seconds (docs/ARCHITECTURE.md, Dead peers).
        machine: A tag of this machine, for peers that met through a rendezvous
            (endpoints.Endpoints): our endpoint may be ``tcp://IP:*``, an ephemeral port.
        **kwargs: See Transport.
    """

    own_kinds = shm.KINDS

    def __init__(self, rank: int, endpoints: Sequence[str], *, local_ipc: bool = True,
                 shared_memory: bool = True, keys: CurveKeys | None = None,
                 dead_after: float = DEAD_AFTER_S, machine: str | None = None, **kwargs):
        super().__init__(rank, size=len(endpoints), **kwargs)
        if not dead_after > 0:
            raise TransportError(f"dead_after must be > 0 seconds, got {dead_after!r}")
        self.use_ipc = local_ipc
        if not 0 <= rank < len(endpoints):
            raise TransportError(f"rank {rank} has no endpoint (there are {len(endpoints)})")
        if keys is not None and (keys.rank != rank or len(keys.peers) != len(endpoints)):
            raise TransportError(f"rank {rank}: CURVE keys are for rank {keys.rank} of "
                                 f"{len(keys.peers)} peers, not rank {rank} of {len(endpoints)}")
        self.endpoints = Endpoints(rank, endpoints, machine)
        self.keys = keys
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._push: dict[int, zmq.Socket] = {}
        self._ipc_path: str | None = None
        self._watch_due = 0.0  # when the connection watches are next read
        self._zap: ZapHandler | None = None
        self._watch: ConnectionWatch | None = None
        self._links = LinkWatch(dead_after, now=self.clock.monotonic)
        self.shared_memory = (shared_memory and local_ipc and keys is None and shm.available()
                              and os.environ.get("GOSSIP_SHARED_MEMORY", "1") != "0")
        self._shm = shm.SharedMemory(rank, self._send_own, self.describe, self.shared_memory,
                                     reachable=self._on_this_machine)

    @classmethod
    def for_topology(cls, rank: int, topology, *, key_file=None, **kwargs) -> ZmqTransport:
        """The (unopened) transport of ``rank`` in ``topology``: its endpoints, and CURVE keys
        when the topology lists public keys (secret key from ``key_file`` or the topology's
        key directory; ConfigError if none fits)."""
        endpoints = [topology.address(r) for r in range(topology.size)]
        return cls(rank, endpoints, keys=for_rank(topology, rank, key_file), **kwargs)

    def open(self) -> ZmqTransport:
        """Bind this rank's endpoint. Raises TransportError naming the address if it cannot."""
        keep_freed_buffers()  # before the I/O thread starts, so it shares the tuned arena
        # One I/O thread: the connection watch relies on its events coming in order.
        self._ctx = zmq.Context(io_threads=1)
        if self.keys is not None:
            self._zap = ZapHandler(self._ctx, self.keys)
        max_frame = self.max_message_bytes + (CURVE_FRAME_OVERHEAD if self.keys else 0)
        endpoint = self.endpoints[self.rank]
        self._pull = pull_socket(self._ctx, max_frame=max_frame, keys=self.keys,
                                 ipv6=is_ipv6(endpoint))
        self._watch = ConnectionWatch(self._pull, self.reject, max_frame_bytes=max_frame,
                                      curve=self.keys is not None,
                                      denials=self._zap.denials if self._zap else None,
                                      now=self.clock.monotonic)
        try:
            self._pull.bind(bind_address(endpoint))
            if endpoint.endswith(":*"):  # an ephemeral port: the one the system chose
                self.endpoints.bound(self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
            twin = self.endpoints.twin(self.rank)
            # The TCP bind above is the lock on this port, so the ipc path is ours to take.
            if twin:  # bound even if we do not use it: others may
                self._pull.bind(twin)
                self._ipc_path = twin.removeprefix("ipc://")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"rank {self.rank} cannot listen on {endpoint}: {exc}") from None
        return self

    def describe(self, rank: int) -> str:
        where = self.endpoints[rank] if 0 <= rank < len(self.endpoints) else "?"
        return f"peer {rank} ({where})"

    def _socket_to(self, dst: int) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            if self._ctx is None:
                raise TransportError(f"rank {self.rank}: transport is not open")
            if not 0 <= dst < len(self.endpoints):
                raise TransportError(f"rank {self.rank}: no peer {dst} (there are "
                                     f"{len(self.endpoints)})")
            endpoint = self.endpoints[dst]
            sock = push_socket(self._ctx, dst, timeout=self.timeout, keys=self.keys,
                               ipv6=is_ipv6(endpoint))
            self._links.watch(dst, sock)
            self.linked.add(dst)
            sock.connect((self.use_ipc and self.endpoints.twin(dst)) or endpoint)
            self._push[dst] = sock
        return sock

    def locate(self, endpoints: Sequence[str], local: set[int]) -> None:
        """Where the other ranks listen and which share this machine (a rendezvous)."""
        self.endpoints.locate(endpoints, local)

    def repoint(self, rank: int, endpoint: str, *, local: bool = False) -> None:
        """``rank`` came back at ``endpoint`` (a restarted peer's rejoin): connect there
        from now on; what was queued for its old address died with it."""
        if self.endpoints.move(rank, endpoint, local=local) and rank in self._push:
            self._links.forget(rank)
            self._push.pop(rank).close(linger=0)

    _moved = repoint  # a rejoining peer's join says where it listens now

    def connect(self, ranks) -> None:
        for dst in ranks:
            if dst != self.rank:
                self._socket_to(dst)

    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False,
                     received=()) -> list:
        outbox = self._shm.outbox(dst, frames)
        parts, trackers, placed = [header], [], []
        for i, (f, frame) in enumerate(zip(frames, received or [None] * len(frames)), 1):
            # Copied into the segment at once: nothing to track either.
            where = outbox.put(f) if outbox else None
            if where is not None:
                placed.append((i, *where))
                parts.append(b"")
                continue
            if isinstance(frame, zmq.Frame) and not track:
                # libzmq's own message, shared by reference count: no copy, and no Python
                # memory for pyzmq to hand back through its garbage-collector thread.
                parts.append(frame)
                continue
            array = f.numpy()
            # Zero-copy pays off only for large frames; small ones are cheaper to copy.
            if array.nbytes < codec.ZERO_COPY_MIN_BYTES:
                parts.append(zmq.Frame(array, copy=True))
            else:
                frame = zmq.Frame(array, copy=False, track=track)
                parts.append(frame)
                if track:
                    trackers.append(Tracker(frame.tracker))
        if placed:
            parts.insert(0, outbox.envelope(placed))
        try:
            self._socket_to(dst).send_multipart(parts, copy=False)
            return trackers
        except zmq.Again:
            if placed:
                outbox.free(offset for _, offset, _ in placed)
            raise PeerTimeout(f"rank {self.rank}: sending to {self.describe(dst)} timed out "
                              f"after {self.timeout:g} s (is it running?)") from None

    def _on_this_machine(self, rank: int) -> bool:
        """Whether ``rank`` is reached over the ipc twin (so shares this machine's memory)."""
        return 0 <= rank < len(self.endpoints) and bool(self.endpoints.twin(rank))

    def shares_memory_with(self, rank: int) -> bool:
        """Whether large frames to ``rank`` go through shared memory now."""
        return self._shm.shares_with(rank)

    def _restarted(self, rank: int) -> None:
        self._shm.restarted(rank)

    def _send_own(self, dst: int, kind: str, meta: dict) -> None:
        """Send one of ``own_kinds`` (no tensors, not kept for a rejoin)."""
        header, _ = codec.encode(Message(kind=kind, round=-1, meta=meta), self.rank)
        self._send_encoded(dst, kind, header, [])

    def _validate_internal(self, msg: Message) -> None:
        shm.validate(msg)

    def _internal(self, msg: Message) -> None:
        self._shm.handle(msg)

    def _recv_frames(self, timeout: float) -> list | None:
        frames = self._receive(timeout)
        if frames is None or not is_envelope(frames[0]):
            return frames
        try:
            return self._shm.open(frames)
        except ProtocolError as exc:
            size = sum(len(codec.frame_buffer(f)) for f in frames)
            self.stats.bytes_recv += size
            self.reject(f"{exc} ({size} bytes)", nbytes=size)
            return None  # woken early: the caller asks again

    def _receive(self, timeout: float) -> list | None:
        pull = self._pull
        if pull is None:
            raise TransportError(f"rank {self.rank}: transport is not open")
        clock = self.clock
        deadline = clock.monotonic() + timeout
        while True:
            now = clock.monotonic()
            if now >= self._watch_due:
                try:
                    return self._read(zmq.NOBLOCK)
                except zmq.Again:
                    pass
                # The queue is empty: the connection watches need attention only now.
                self._watch_due = now + WATCH_EVERY_S
                if self._watch_connections():  # wake the caller: what it waits for may
                    return None                # never come now
            # A receive blocking in libzmq (GIL released) wakes on a message with less work
            # than zmq_poll over the monitor sockets too; 0 ms makes it non-blocking.
            wait = max(min(deadline, self._watch_due) - now, 0.0)
            pull.setsockopt(zmq.RCVTIMEO, math.ceil(wait * 1000))
            try:
                return self._read(0)
            except zmq.Again:
                if clock.monotonic() >= deadline:
                    return None

    def _read(self, flags: int) -> list | None:
        """The next multipart message; None if it had more frames than any valid message
        (rejected, and read off the socket without ever being held: constant memory).
        Raises zmq.Again if none is waiting (with NOBLOCK) or within the receive timeout."""
        pull = self._pull
        frame = pull.recv(flags, copy=False)
        frames = [frame]
        while frame.more:
            if len(frames) == MAX_FRAMES:
                return self._drop_rest(frames)
            # The parts of a message are delivered together: the rest is already here.
            frame = pull.recv(copy=False)
            frames.append(frame)
        return frames

    def _drop_rest(self, frames: list) -> None:
        """Read the rest of an oversized message frame by frame, each let go as the next comes
        (constant memory; the frame's ``more``, not a socket option per frame: fast); reject it."""
        recv, frame = self._pull.recv, frames[-1]
        count, size = len(frames), sum(len(codec.frame_buffer(f)) for f in frames)
        while frame.more:
            frame = recv(copy=False)
            size += len(frame)
            count += 1
        self.stats.bytes_recv += size
        self.reject(f"message of {count} frames, more than the {MAX_FRAMES} of any valid "
                    f"message (envelope, header and {codec.MAX_TENSORS} tensors), dropped "
                    f"unread ({size} bytes)", nbytes=size)
        return None

    def _watch_connections(self) -> bool:
        """Read the connection monitors; True if a peer was just declared dead."""
        self._watch.read()
        self._watch.judge(link_up=self._links.up)
        return self._poll_liveness()

    def _sender(self, frames: list) -> int | None:
        if self.keys is None:
            return None
        user = frames[0].get("User-Id")  # set by our ZAP handler: the rank of the key
        try:
            return int(user)
        except (TypeError, ValueError):
            raise ProtocolError(f"connection has no authenticated rank (User-Id {user!r})") \
                from None

    def _poll_liveness(self) -> bool:
        if self._ctx is None:
            return False
        self._links.read_all()
        dead = self._links.judge(self.departed)
        for rank, reason in dead:
            self.membership.declare_dead(rank, reason)
        return bool(dead)

    def _link_up(self, rank: int) -> bool:
        return self._ctx is not None and self._links.up(rank)

    def _never_reached(self) -> set[int]:
        self._links.read_all()
        return self._links.never_up()

    def _heard(self, frames: list, msg: Message) -> None:
        if self._watch is not None:
            self._watch.heard(frames[0].get(zmq.SRCFD), msg.src, msg.kind == BYE)

    def close(self, linger: float = 0.0) -> None:
        # libzmq leaves the ipc socket file behind. Remove it while our TCP bind still guards
        # the path: a successor on the same port may bind it as soon as the port is free.
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
            self._ipc_path = None
        self._links.close()
        self._shm.close()
        dead = self.membership.firsthand()
        for dst, sock in self._push.items():  # what is queued for a dead peer stays unsent
            sock.close(linger=0 if dst in dead else int(linger * 1000))
        self._push.clear()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self):
        if self._ctx is None:
            self.open()
        return self

