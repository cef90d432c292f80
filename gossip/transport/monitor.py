"""Socket monitors: refused input on the outbox, and links to peers that stay down.

``ConnectionWatch`` (the outbox, the socket this peer binds) turns connection events into
rejections with a reason; ``LinkWatch`` (our receiving sockets, one connected to each peer's
outbox) tells which peer has become unreachable, the evidence a peer is declared dead on
(docs/ARCHITECTURE.md, Dead peers).

libzmq refuses some input before any message exists, and tells only its socket monitor:

* a failed handshake: a plaintext client at a CURVE socket or the reverse
  (``HANDSHAKE_FAILED_PROTOCOL`` with ``ZMTP_MECHANISM_MISMATCH`` if this side noticed first,
  else ``HANDSHAKE_FAILED_NO_DETAIL``: the client hung up mid-handshake), a client that has a
  wrong server key (``ZMTP_CRYPTOGRAPHIC``), a key the ZAP handler refused
  (``HANDSHAKE_FAILED_AUTH``, status 400). Each is followed by the ``DISCONNECTED`` of the same
  connection, which is not counted again;
* a frame over ``ZMQ_MAXMSGSIZE``: libzmq 4.3.5 drops it, with whatever follows it on that
  connection, and closes the connection. Its only trace is ``DISCONNECTED``, the very event a
  peer going away causes (measured; no protocol error is reported, with or without CURVE).

Our peers' receiving sockets say hello on the connection they open to us, and the peers say
goodbye (over our connection to them) before closing. So a connection that closes while its
peer is one we talk to and did not say goodbye is counted as a rejection. ``DISCONNECTED`` itself does not say
why, and a peer that exits or crashes causes it far more often than a 2 GiB frame: the
judgement asks our own link to the peer last heard on that connection. A process that ended
took both directions down (its kernel closed every socket at once); a sender whose frame was
dropped is alive, our link to it stays up, and libzmq reconnects it. The goodbye may still be
queued behind other messages when the event comes, so a disconnect is judged only once the
socket's queue is empty and ``GRACE_S`` has passed.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

_MONITOR_IDS = itertools.count()
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def next_event(monitor: zmq.Socket) -> dict | None:
    """The next event waiting on ``monitor``, None if there is none. Asking first is
    cheaper than the exception a read of an empty socket raises (these are read every
    0.1 s while a receive waits, one per link)."""
    if not monitor.getsockopt(_EVENTS) & _POLLIN:
        return None
    try:
        return recv_monitor_message(monitor, zmq.NOBLOCK)
    except zmq.Again:
        return None


def monitor_socket(socket: zmq.Socket, events: int) -> zmq.Socket:
    """``socket``'s monitor at an address never used before: pyzmq's default names it by
    the socket's file descriptor, which a socket opened after a close can reuse before
    libzmq has let the old monitor's address go (EADDRINUSE, then a hanging ctx.term)."""
    return socket.get_monitor_socket(events, addr=f"inproc://gossip-monitor-{next(_MONITOR_IDS)}")

# Covers the instant between libzmq reporting a disconnect and flushing the messages that
# preceded it to the socket's queue.
GRACE_S = 0.2
# A refused client reconnects every 100 ms: the same reason is logged (at warning level) at most
# once per this many seconds; every refusal is still counted.
REPEAT_QUIET_S = 10.0

EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)
_PROTOCOL_ERRORS = {getattr(zmq, name): name for name in dir(zmq)
                    if name.startswith("PROTOCOL_ERROR_")}
_MISMATCH = {True: "the client does not use CURVE (plaintext?)",
             False: "the client uses a security mechanism (CURVE?) but this peer has no keys"}
_CRYPTO = "CURVE handshake does not decrypt (the client has a wrong server key for this peer?)"


class ConnectionWatch:
    """Reads a socket's monitor and reports refused input through ``reject(reason)``.

    Args:
        socket: The receiving socket; its monitor socket becomes ``self.socket``, to be polled
            alongside it.
        reject: ``reject(reason, quiet=False)``, called once per refused connection or
            dropped frame with a one-line reason.
        max_frame_bytes: The socket's ZMQ_MAXMSGSIZE, named in reasons.
        curve: Whether the socket is a CURVE server (for the wording of reasons).
        denials: ``(address, key)`` of clients the ZAP handler refused, oldest first.
        now: The transport's clock (seconds, monotonic).
    """

    def __init__(self, socket: zmq.Socket, reject: Callable[..., None], *,
                 max_frame_bytes: int, curve: bool = False, denials: deque | None = None,
                 now: Callable[[], float]):
        self._now = now
        self.socket = monitor_socket(socket, EVENTS)
        self._watched = socket
        self._reject = reject
        self._max_frame_bytes = max_frame_bytes
        self._why = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: _MISMATCH[curve],
                     zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: _CRYPTO}
        self._denials = denials if denials is not None else deque()
        self._handshake_failed = 0  # disconnects still to come from failed handshakes
        self._closed: deque[tuple[float, int, str]] = deque()  # (when, fd, endpoint) to judge
        self._goodbyes: Counter[int] = Counter()  # fds a goodbye came over, not yet closed
        self._last_src: dict[int, int] = {}  # fd -> rank of the last message over it
        self._logged: dict[str, float] = {}  # refusal reason -> when last logged loudly

    def heard(self, fd: int, src: int, goodbye: bool) -> None:
        """A message from ``src`` came over connection ``fd``."""
        self._last_src[fd] = src
        if goodbye:
            self._goodbyes[fd] += 1

    def read(self) -> None:
        """Handle every event waiting on the monitor socket."""
        while (event := next_event(self.socket)) is not None:
            kind, value = event["event"], event["value"]
            endpoint = event["endpoint"].decode("utf-8", "replace")
            if kind == zmq.EVENT_DISCONNECTED:
                if self._handshake_failed:
                    self._handshake_failed -= 1
                else:
                    self._closed.append((self._now(), value, endpoint))
                continue
            self._handshake_failed += 1
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = (self._why.get(value)
                       or _PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}"))
                self._refuse(f"connection on {endpoint} refused: {why}")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                if self._denials:
                    address, key = self._denials.popleft()
                    who = f"CURVE key {key} from {address} is not in the topology"
                else:
                    who = f"authentication failed (ZAP status {value})"
                self._refuse(f"connection on {endpoint} refused: {who}")
            else:  # HANDSHAKE_FAILED_NO_DETAIL, value: errno
                self._refuse(f"connection on {endpoint} closed during the handshake (a client "
                             f"with other security settings, e.g. plaintext, or a port probe)")

    def _refuse(self, reason: str) -> None:
        now = self._now()
        quiet = now - self._logged.get(reason, -REPEAT_QUIET_S) < REPEAT_QUIET_S
        if not quiet:
            if len(self._logged) > 1000:  # clients with ever new keys must not grow it forever
                self._logged.clear()
            self._logged[reason] = now
        self._reject(reason, quiet=quiet)

    def judge(self, link_up: Callable[[int], bool | None] = lambda rank: None,
              expected: Callable[[int], bool] = lambda rank: True) -> None:
        """Count the disconnects without a goodbye that are due; call only when the
        sockets' queues are empty (the transport looks again every WATCH_EVERY_S).

        ``link_up(rank)``: whether our own link to ``rank`` is up (None: we have none, or it
        never came up), read after this socket's events: it tells a peer that ended from a
        live sender whose frame libzmq dropped. ``expected(rank)``: whether ``rank`` closing
        its connection is news (it is a contact that has not said goodbye)."""
        now = self._now()
        while self._closed:
            when, fd, endpoint = self._closed[0]
            if now - when < GRACE_S:
                return
            self._closed.popleft()
            src = self._last_src.pop(fd, None)
            if self._goodbyes[fd]:
                self._goodbyes[fd] -= 1
                if not self._goodbyes[fd]:
                    del self._goodbyes[fd]
                continue
            if src is not None and not expected(src):
                continue
            closed = f"connection {fd} on {endpoint}"
            oversized = (f"a frame over the socket's {self._max_frame_bytes}-byte limit "
                         f"(ZMQ_MAXMSGSIZE) was dropped with what followed it on that "
                         f"connection")
            up = None if src is None else link_up(src)
            if src is None:  # nothing heard on it: a client that hung up, or its first frame
                self._reject(f"{closed} closed without a goodbye before any valid message: "
                             f"the client hung up or died, or {oversized}")
            elif up is False:
                self._reject(f"{closed}, last heard from peer {src}, closed without a "
                             f"goodbye: peer {src} exited or crashed (this peer's link to "
                             f"it went down too)")
            elif up:
                self._reject(f"{closed}, last heard from peer {src}, closed without a "
                             f"goodbye while peer {src} is still up: {oversized}")
            else:
                self._reject(f"{closed}, last heard from peer {src}, closed without a "
                             f"goodbye: peer {src} exited or crashed, or {oversized}")

    def close(self) -> None:
        if self.socket is not None:
            self._watched.disable_monitor()
            self.socket.close(linger=0)
            self.socket = None


class LinkWatch:
    """Our own connections to other peers (one receiving socket each): which peer is
    unreachable.

    A link is *up* once its ZMTP handshake succeeded (with CURVE: once the peer proved its
    key), *down* from its ``DISCONNECTED`` on, until a reconnect completes a handshake again.
    libzmq keeps reconnecting on its own, so a peer that restarts on the same address comes
    back by itself. ZMTP heartbeats (set on each socket by the transport) turn a peer that
    vanished without closing its sockets (machine off, cable cut, process stopped) into a
    disconnect too; a peer that is only slow still answers them from its I/O thread.

    ``judge`` declares a peer dead when its link, once up, has been down for ``dead_after``
    seconds without the peer having said goodbye. A link that never came up proves nothing
    (the peer may still be starting): waiting for such a peer ends in PeerTimeout instead.
    """

    EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, dead_after: float, *, now: Callable[[], float]):
        self.dead_after = dead_after
        self._now = now
        self.sockets: dict[int, zmq.Socket] = {}  # rank -> monitor socket of our link to it
        self._watched: dict[int, zmq.Socket] = {}
        self._ever_up: set[int] = set()
        self._watched_since: dict[int, float] = {}
        self._down_since: dict[int, float] = {}
        self._judged: set[int] = set()  # declared dead: never again
        self._broken: set[int] = set()  # went down since last up: a reconnect is news
        self._came_back: list[int] = []  # ranks whose link broke and came back up
        self._went_down: list[int] = []  # ranks whose link broke since ``went_down()``

    def watch(self, rank: int, socket: zmq.Socket) -> zmq.Socket:
        """Watch our link to ``rank``; returns its monitor socket (``read`` drains it)."""
        monitor = monitor_socket(socket, self.EVENTS)
        self.sockets[rank], self._watched[rank] = monitor, socket
        self._watched_since[rank] = self._now()
        return monitor

    def forget(self, rank: int) -> None:
        """Stop watching our link to ``rank`` (its socket is about to close)."""
        monitor = self.sockets.pop(rank, None)
        if monitor is not None:
            self._watched.pop(rank).disable_monitor()
            monitor.close(linger=0)
        for state in (self._ever_up, self._judged, self._broken):
            state.discard(rank)
        self._watched_since.pop(rank, None)
        self._down_since.pop(rank, None)

    def read(self, rank: int) -> None:
        """Handle every event waiting on the monitor of our link to ``rank``."""
        monitor = self.sockets[rank]
        while (event := next_event(monitor)) is not None:
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._ever_up.add(rank)
                self._down_since.pop(rank, None)
                if rank in self._broken:
                    self._broken.discard(rank)
                    self._came_back.append(rank)
            elif rank in self._ever_up:  # DISCONNECTED
                self._down_since.setdefault(rank, self._now())
                self._broken.add(rank)
                self._went_down.append(rank)

    def read_all(self) -> None:
        for rank in list(self.sockets):
            self.read(rank)

    def went_down(self) -> list[int]:
        """Peers whose link broke since the last call. libzmq reconnects after a broken
        connection, but not after a protocol error (a frame over ZMQ_MAXMSGSIZE): the
        transport connects a fresh socket itself (``rewatch``)."""
        down, self._went_down = self._went_down, []
        return down

    def rewatch(self, rank: int, socket: zmq.Socket) -> None:
        """Watch ``socket`` as our link to ``rank`` from now on, in place of the one that
        broke (read first); what is known of the link stays."""
        old = self.sockets.pop(rank)
        try:
            self._watched.pop(rank).disable_monitor()
        except zmq.ZMQError:  # closed already
            pass
        old.close(linger=0)
        self.sockets[rank] = monitor_socket(socket, self.EVENTS)
        self._watched[rank] = socket

    def came_back(self) -> list[int]:
        """Peers whose link broke and came back up since the last call, oldest first: the
        peer's process ran on (or restarted at once). libzmq closes a connection that
        delivered a frame over ZMQ_MAXMSGSIZE, dropping what followed it, then reconnects."""
        back, self._came_back = self._came_back, []
        return back

    def up(self, rank: int) -> bool | None:
        """Whether our link to ``rank`` is up now (events read first): its process answers
        ZMTP heartbeats from its I/O thread, however long its training loop is busy. None if
        we have no link to it or it never came up."""
        if rank not in self.sockets or rank not in self._ever_up:
            return None
        self.read(rank)
        return rank not in self._down_since and rank not in self._judged

    def starting(self, rank: int) -> bool:
        """Whether ``rank``'s link has not come up once, but we started connecting less than
        ``dead_after`` seconds ago: its process may still be starting."""
        self.read(rank)
        since = self._watched_since.get(rank)
        return since is not None and rank not in self._ever_up \
            and self._now() - since < self.dead_after

    def never_up(self) -> set[int]:
        """Peers whose link has not come up once in the ``dead_after`` seconds since we
        started connecting to them: nothing listens at their address."""
        now = self._now()
        return {rank for rank, since in self._watched_since.items()
                if rank not in self._ever_up and now - since >= self.dead_after}

    def judge(self, departed: set[int], among: set[int] | None = None) -> list[tuple[int, str]]:
        """Peers now dead, each with its reason; only those ``among`` if given (the peers
        this one works with: the others' links are watched but not judged)."""
        now, dead = self._now(), []
        for rank, since in list(self._down_since.items()):
            if among is not None and rank not in among:
                continue
            if rank in departed:  # it said goodbye: closing was the plan
                del self._down_since[rank]
                continue
            if now - since < self.dead_after:
                continue
            del self._down_since[rank]
            if rank not in self._judged:
                self._judged.add(rank)
                dead.append((rank, (f"its connection broke (it exited, crashed or stopped "
                                    f"answering heartbeats) and did not come back within "
                                    f"{self.dead_after:g} s")))
        return dead

    def close(self) -> None:
        for rank, monitor in self.sockets.items():
            try:
                self._watched[rank].disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
        self.sockets.clear()
        self._watched.clear()
