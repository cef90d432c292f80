"""ZeroMQ TCP transport: each peer binds its outbox (a ROUTER, router.py) and connects one
receiving socket (a DEALER) to every other peer's outbox.

Every sender has a receiving socket of its own, read a bounded number of frames per poll
turn (drain.py), so a flood of frames from one peer cannot hold up the others'. Messages
for a peer whose receiving socket has not connected yet wait in the outbox's queue, so
peers may start in any order. Per-pair ordering is FIFO, which the strategies rely on for
multi-part exchanges. With CURVE keys every socket authenticates and encrypts (ipc twins
included): the outbox is a CURVE server that lets in only the topology's keys (auth.py),
each receiving socket a CURVE client of its sender's key. Without keys, large frames to
peers on this machine go through shared memory (shm.py). The sockets' settings are
sockets.py's, the Unix-socket twin of a local peer endpoints.py's.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Sequence

import zmq

from gossip.errors import PeerTimeout, ProtocolError, TransportError
from gossip.keys import CurveKeys, for_rank
from gossip.transport import codec, shm
from gossip.transport.auth import ZapHandler
from gossip.transport.base import Transport
from gossip.transport.drain import FRAMES_PER_TURN, Drain, Oversized
from gossip.transport.endpoints import Endpoints, bind_address, is_ipv6
from gossip.transport.malloc_tuning import keep_freed_buffers
from gossip.transport.message import Message
from gossip.transport.monitor import ConnectionWatch, LinkWatch
from gossip.transport.router import RouterOutbox
from gossip.transport.shm_segments import is_envelope
from gossip.transport.sockets import (CURVE_FRAME_OVERHEAD, HWM, Tracker, inbound_socket,
                                      outbox_socket)

log = logging.getLogger(__name__)

# A peer is declared dead once our connection to it has been down this long (default).
DEAD_AFTER_S = 5.0
# No valid message has more frames: a shared-memory envelope, the header, MAX_TENSORS tensors.
MAX_FRAMES = 2 + codec.MAX_TENSORS
# While a receive waits, the connection monitors are read this often (and whenever the
# sockets run empty after that): a dead peer is noticed at most this much later.
WATCH_EVERY_S = 0.1
# What a receiving socket says to the outbox it connects to, as its first message: the
# only message an outbox takes. Its ``endpoint``: where the sender's own outbox listens
# (a restarted peer may have moved; its join cannot reach anyone before they connect there).
HELLO = "hello"
_HELLO_KINDS = frozenset({HELLO})


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
        self._outbox: RouterOutbox | None = None
        self._inbound: dict[int, zmq.Socket] | None = None  # sender -> receiving socket
        self._drains: dict[zmq.Socket, tuple[int | None, Drain]] = {}  # None: the outbox
        self._poller = zmq.Poller()
        self._ready: deque[tuple[int, list]] = deque()  # (sender, frames) read, not taken
        self._from: int | None = None  # the sender of the frames handed out last
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

    @property
    def _max_frame(self) -> int:
        return self.max_message_bytes + (CURVE_FRAME_OVERHEAD if self.keys else 0)

    def open(self) -> ZmqTransport:
        """Bind this rank's endpoint (its outbox). Raises TransportError naming the address
        if it cannot. The receiving sockets connect at the first send, receive or
        ``connect``: by then a rendezvous has told where the others listen."""
        keep_freed_buffers()  # before the I/O thread starts, so it shares the tuned arena
        # One I/O thread: the connection watch relies on its events coming in order.
        self._ctx = zmq.Context(io_threads=1)
        if self.keys is not None:
            self._zap = ZapHandler(self._ctx, self.keys)
        endpoint = self.endpoints[self.rank]
        router = outbox_socket(self._ctx, max_frame=self._max_frame, timeout=self.timeout,
                               keys=self.keys, ipv6=is_ipv6(endpoint))
        self._outbox = RouterOutbox(router, max_queued=HWM, describe=self.describe,
                                    now=self.clock.monotonic)
        self._listen(router, None, max_frames=2)  # routing id and a hello
        self._watch = ConnectionWatch(router, self.reject, max_frame_bytes=self._max_frame,
                                      curve=self.keys is not None,
                                      denials=self._zap.denials if self._zap else None,
                                      now=self.clock.monotonic)
        try:
            router.bind(bind_address(endpoint))
            if endpoint.endswith(":*"):  # an ephemeral port: the one the system chose
                self.endpoints.bound(router.getsockopt_string(zmq.LAST_ENDPOINT))
            twin = self.endpoints.twin(self.rank)
            # The TCP bind above is the lock on this port, so the ipc path is ours to take.
            if twin:  # bound even if we do not use it: others may
                router.bind(twin)
                self._ipc_path = twin.removeprefix("ipc://")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"rank {self.rank} cannot listen on {endpoint}: {exc}") from None
        if self.endpoints.machine is None:  # known addresses (not a rendezvous): connect now
            self._connected()
        return self

    def _listen(self, sock: zmq.Socket, src: int | None, max_frames: int = MAX_FRAMES) -> None:
        self._drains[sock] = (src, Drain(sock, max_frames))
        self._poller.register(sock, zmq.POLLIN)

    def describe(self, rank: int) -> str:
        where = self.endpoints[rank] if 0 <= rank < len(self.endpoints) else "?"
        return f"peer {rank} ({where})"

    def _connected(self) -> dict[int, zmq.Socket]:
        """The receiving sockets, one per other rank, connected at the first call."""
        if self._inbound is None:
            if self._ctx is None:
                raise TransportError(f"rank {self.rank}: transport is not open")
            self._inbound = {}
            for src in range(len(self.endpoints)):
                if src != self.rank:
                    self._connect_to(src)
        return self._inbound

    def _connect_to(self, src: int, *, again: bool = False) -> None:
        """Connect a receiving socket to ``src``'s outbox and say hello there (queued by
        libzmq until the connection is up); ``again``: in place of one whose link broke."""
        endpoint = self.endpoints[src]
        sock = inbound_socket(self._ctx, self.rank, src, max_frame=self._max_frame,
                              timeout=self.timeout, keys=self.keys, ipv6=is_ipv6(endpoint))
        if again:
            self._links.rewatch(src, sock)
        else:
            self._links.watch(src, sock)
        sock.connect(self._address(src))
        header, _ = codec.encode(Message(kind=HELLO, round=-1, meta={
            "endpoint": self.endpoints[self.rank]}), self.rank)
        try:
            sock.send(header, zmq.NOBLOCK)
        except zmq.Again:  # the handshake failed before the send: libzmq dropped the pipe
            log.warning("rank %d: %s refused our connection at the handshake (other CURVE "
                        "keys, or none?): no hello sent", self.rank, self.describe(src))
        self._inbound[src] = sock
        self._listen(sock, src)

    def locate(self, endpoints: Sequence[str], local: set[int]) -> None:
        """Where the other ranks listen and which share this machine (a rendezvous);
        connects to them now."""
        before = {src: self._address(src) for src in self._inbound or ()}
        self.endpoints.locate(endpoints, local)
        self._connected()
        for src, where in before.items():  # connected early to where they were not yet
            if self._address(src) != where:
                self._links.forget(src)
                self._disconnect(src)
                self._connect_to(src)

    def _address(self, src: int) -> str:
        """Where our receiving socket for ``src`` connects."""
        return (self.use_ipc and self.endpoints.twin(src)) or self.endpoints[src]

    def repoint(self, rank: int, endpoint: str, *, local: bool = False) -> None:
        """``rank`` came back at ``endpoint`` (a restarted peer's rejoin): connect there
        from now on (what waits in the outbox for it goes to its new process, whose hello
        made the way)."""
        if self.endpoints.move(rank, endpoint, local=local) and self._inbound is not None:
            self._links.forget(rank)
            self._disconnect(rank)
            self._connect_to(rank)

    def _disconnect(self, src: int) -> None:
        """Close the receiving socket for ``src``, keeping the messages complete in it."""
        sock = self._inbound.pop(src)
        drain = self._drains.pop(sock)[1]
        while batch := drain.read():
            self._ready.extend((src, frames) for frames in batch
                               if not isinstance(frames, Oversized))
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _reconnect(self) -> None:
        """A fresh receiving socket for each peer whose link broke (libzmq gives up on one
        after a protocol error, e.g. a frame over ZMQ_MAXMSGSIZE)."""
        for src in self._links.went_down():
            if self._inbound is not None and src in self._inbound:
                self._disconnect(src)
                self._connect_to(src, again=True)

    def _moved(self, rank: int, endpoint: str) -> None:
        """A rejoining peer's join says where it listens now: reach it there if that moved.
        At the same address our receiving socket reconnects by itself; a new one would take
        a new routing id, and what the peer sent to the old one meanwhile would be lost."""
        if endpoint != self.endpoints[rank]:
            self.repoint(rank, endpoint)

    def connect(self, ranks) -> None:
        self._connected()
        self.linked.update(dst for dst in ranks if dst != self.rank)

    def close_links(self, ranks) -> None:
        super().close_links(ranks)
        for rank in ranks:  # its receiving socket and monitor (a dead peer's would retry)
            if self._inbound is not None and rank in self._inbound:
                self._links.forget(rank)
                self._disconnect(rank)

    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False,
                     received=()) -> list:
        if self._outbox is None:
            raise TransportError(f"rank {self.rank}: transport is not open")
        if not 0 <= dst < len(self.endpoints) or dst == self.rank:
            raise TransportError(f"rank {self.rank}: no peer {dst} (there are "
                                 f"{len(self.endpoints)})")
        if dst not in self.linked:
            self.connect([dst])
        outbox = self._shm.outbox(dst, frames) if frames else None
        parts, trackers, placed = [header], [], []
        for i, f in enumerate(frames, 1):
            # Copied into the segment at once: nothing to track either.
            where = outbox.put(f) if outbox else None
            if where is not None:
                placed.append((i, *where))
                parts.append(b"")
                continue
            frame = received[i - 1] if received else None
            if type(frame) is zmq.Frame and not track:
                # libzmq's own message, shared by reference count: no copy, and no Python
                # memory for pyzmq to hand back through its garbage-collector thread.
                parts.append(frame)
                continue
            array = f.numpy()
            # Zero-copy pays off only for large frames; small ones are cheaper to copy
            # (pyzmq copies them: the outbox's copy threshold is this size, sockets.py).
            if array.nbytes < codec.ZERO_COPY_MIN_BYTES:
                parts.append(array)
            else:
                frame = zmq.Frame(array, copy=False, track=track)
                parts.append(frame)
                if track:
                    trackers.append(Tracker(frame.tracker))
        if placed:
            parts.insert(0, outbox.envelope(placed))
        try:
            self._outbox.send(dst, parts, wait=self._read_some, timeout=self.timeout)
        except PeerTimeout as exc:
            if placed:
                outbox.free(offset for _, offset, _ in placed)
            raise PeerTimeout(f"rank {self.rank}: {exc}") from None
        return trackers

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
            size = codec.frame_bytes(frames)
            self.stats.bytes_recv += size
            self.reject(f"{exc} ({size} bytes)", nbytes=size)
            return None  # woken early: the caller asks again

    def _receive(self, timeout: float) -> list | None:
        if self._outbox is None:
            raise TransportError(f"rank {self.rank}: transport is not open")
        self._connected()
        clock = self.clock
        deadline = clock.monotonic() + timeout
        while True:
            if self._ready:
                self._from, frames = self._ready.popleft()
                return frames
            now = clock.monotonic()
            if now >= self._watch_due:
                if self._turn(0):
                    continue
                # The sockets are empty: the connection watches need attention only now.
                self._watch_due = now + WATCH_EVERY_S
                self._outbox.flush()  # what a full queue held back
                if self._watch_connections():  # wake the caller: what it waits for may
                    return None                # never come now
            if not self._turn(max(min(deadline, self._watch_due) - now, 0.0)) \
                    and clock.monotonic() >= deadline:
                return None

    def _read_some(self, wait: float) -> None:
        """Read what arrives within ``wait`` seconds (a send waiting for room: a hello)."""
        self._turn(wait)

    def _turn(self, wait: float) -> bool:
        """One poll turn: wait up to ``wait`` seconds for any socket to be readable, then
        read at most FRAMES_PER_TURN frames of each readable one. Complete messages join
        ``_ready``; hellos and oversized messages are handled here. Whether any was read."""
        ready = self._poller.poll(math.ceil(wait * 1000))
        for sock, _ in ready:
            src, drain = self._drains[sock]
            for message in drain.read(FRAMES_PER_TURN):
                if isinstance(message, Oversized):
                    self._drop(src, message)
                elif src is None:
                    self._hello(message)
                else:
                    self._ready.append((src, message))
        if self._outbox.waiting():
            self._outbox.flush()
        return bool(ready)

    def _drop(self, src: int | None, message: Oversized) -> None:
        """Reject a message of more frames than any valid one, read without being held."""
        self.stats.bytes_recv += message.nbytes
        if src is None:
            what = (f"message of {message.frames} frames on this peer's outbox, which takes "
                    f"only hellos (a routing id and one frame)")
        else:
            what = (f"message of {message.frames} frames, more than the {MAX_FRAMES} of any "
                    f"valid message (envelope, header and {codec.MAX_TENSORS} tensors)")
        self.reject(f"{what}, dropped unread ({message.nbytes} bytes)", nbytes=message.nbytes)

    def _hello(self, frames: list) -> None:
        """A receiving socket's hello on our outbox: messages for its rank may go now (and
        go where its hello says it listens, if that moved). Anything else is rejected."""
        size = codec.frame_bytes(frames)
        try:
            if len(frames) != 2:
                raise ProtocolError("an empty message on this peer's outbox, which takes "
                                    "only hellos")
            user = self._user(frames[1])
            msg = codec.decode(frames[1:], kinds=_HELLO_KINDS,
                               max_message_bytes=self.max_message_bytes, peers=self.size,
                               sender=user)
            route = bytes(frames[0])
            if not route.startswith(b"%d-" % msg.src):
                raise ProtocolError(f"hello from peer {msg.src} with the routing id "
                                    f"{route[:40]!r}, not one of peer {msg.src}'s")
            endpoint = msg.meta.get("endpoint")
            if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") \
                    or len(endpoint) > 300:
                raise ProtocolError(f"hello from peer {msg.src}: endpoint={endpoint!r} is "
                                    f"not tcp://HOST:PORT")
        except ProtocolError as exc:
            self.stats.bytes_recv += size
            self.reject(f"{exc} ({size} bytes)", nbytes=size)
            return
        self._watch.heard(frames[1].get(zmq.SRCFD), msg.src, goodbye=False)
        # Moved, as a restarted peer may (our socket to its old address is down then); a
        # peer reached already may name its address otherwise (a host name, an IP).
        if endpoint != self.endpoints[msg.src] and self._inbound is not None \
                and not self._links.up(msg.src):
            self.repoint(msg.src, endpoint)
        self._outbox.greeted(msg.src, route)

    def _watch_connections(self) -> bool:
        """Read the connection monitors; True if a peer was just declared dead."""
        self._watch.read()
        self._watch.judge(link_up=self._links.up,
                          expected=lambda src: src in self.contacts and src not in self.departed)
        dead = self._poll_liveness()
        self._reconnect()
        for rank in self._links.came_back():
            if rank not in self.departed:
                self.reject(f"our connection to {self.describe(rank)} closed without a goodbye "
                            f"while peer {rank} is still up: a frame over this socket's "
                            f"{self._max_frame}-byte limit (ZMQ_MAXMSGSIZE) was dropped with "
                            f"what followed it on that connection")
        return dead

    def _user(self, frame: zmq.Frame) -> int | None:
        """The rank whose CURVE key sent ``frame`` (set by our ZAP handler), None without keys."""
        if self.keys is None:
            return None
        user = frame.get("User-Id")
        try:
            return int(user)
        except (TypeError, ValueError):
            raise ProtocolError(f"connection has no authenticated rank (User-Id {user!r})") \
                from None

    def _sender(self, frames: list) -> int | None:
        # A receiving socket talks to one outbox, whose CURVE key it checked.
        return None if self.keys is None else self._from

    def _poll_liveness(self) -> bool:
        if self._ctx is None:
            return False
        if self._outbox.waiting():  # a send waiting for its delivery reaches here
            self._outbox.flush()
        self._links.read_all()
        # Peers we work with: sent to, connected to, or heard from (our socket for a sender
        # is our link to it: we notice its death ourselves, not only from another's word).
        dead = self._links.judge(self.departed, among=self.linked | self.contacts)
        for rank, reason in dead:
            self.membership.declare_dead(rank, reason)
        return bool(dead)

    def _link_up(self, rank: int) -> bool:
        # Only peers we work with: a socket to every peer is there to receive, not a vouch.
        return self._ctx is not None and rank in self.linked and bool(self._links.up(rank))

    def _starting(self, rank: int) -> bool:
        return self._ctx is not None and self._links.starting(rank)

    def _unreached(self) -> set[int]:
        if self._ctx is None:
            return set()
        self._links.read_all()
        return self._links.never_up()

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
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for sock in self._drains:
            self._poller.unregister(sock)
        self._drains.clear()
        for sock in (self._inbound or {}).values():
            sock.close(linger=0)
        self._inbound = None
        self._ready.clear()
        if self._outbox is not None:  # what is queued for a dead peer stays unsent
            # Peers declared dead have no connection left: nothing waits for them.
            self._outbox.close(linger)
            self._outbox = None
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
