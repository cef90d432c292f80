"""Transport interface: send a Message to a rank, receive one matched by (src, kind, round)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

from gossip.clock import REAL_TIME, Clock
from gossip.errors import PeerGone, PeerTimeout, ProtocolError
from gossip.transport import codec
from gossip.transport.delivery import Delivery, SendWatch
from gossip.transport.goodbye import Leaving, leave
from gossip.transport.inbox import Inbox
from gossip.transport.membership import CONTROL, Membership, Network
from gossip.transport.message import Message
from gossip.transport.pending import DEFAULT_MAX_BYTES, DEFAULT_MAX_MESSAGES, PendingMessages
from gossip.transport.stats import TransportStats
from gossip.transport.waits import PROBE, Waits, describe_cycle, validate_probe

log = logging.getLogger("gossip.transport")

# Messages that arrived before anyone asked for them are kept, up to this many bytes.
DEFAULT_MAX_PENDING_BYTES = DEFAULT_MAX_BYTES
TIMEOUT_S = 60.0  # seconds a receive waits by default (Peer and TrainConfig's too)
BYE = "bye"  # internal: the sender is done and sends nothing more
INTERNAL = CONTROL | {BYE, PROBE}  # kinds every transport accepts and handles itself


class Transport(ABC):
    """Point-to-point messages between ranks with out-of-order buffering.

    Subclasses move frames; this class encodes, validates, counts and matches.

    Args:
        rank: This peer's rank.
        size: Number of ranks, if known: messages claiming another ``src`` are rejected.
        kinds: Message kinds accepted; others are rejected. None accepts any valid kind.
        timeout: Default seconds ``recv`` waits before raising PeerTimeout.
        max_message_bytes: Larger messages are rejected.
        max_pending_bytes: Messages that arrive before anyone asks for them are kept up to
            this many bytes; more are rejected.
        max_pending_messages: ... and up to this many messages (see transport/pending.py,
            which also drops messages of rounds long past).
        reject_nonfinite: Reject float tensors holding NaN or Inf, so a broken or hostile
            neighbour cannot poison this peer's model (see docs/ARCHITECTURE.md).
        clock: Every time read and wait of this transport and of the code above it that
            asks it (membership, fault injection, training); real time by default.
    """

    #: Kinds a transport exchanges for itself (handshakes), handed to ``_internal``.
    own_kinds: frozenset[str] = frozenset()

    def __init__(
        self,
        rank: int,
        *,
        size: int | None = None,
        kinds: Sequence[str] | None = None,
        timeout: float = TIMEOUT_S,
        max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        max_pending_messages: int = DEFAULT_MAX_MESSAGES,
        reject_nonfinite: bool = True,
        clock: Clock | None = None,
    ):
        self.rank, self.size = rank, size
        self.clock = clock or REAL_TIME
        self.timeout = timeout
        self.kinds = frozenset(kinds) if kinds is not None else None
        self._accepted: tuple = (None, None)  # (self.kinds, what decode accepts with them)
        self.max_message_bytes = max_message_bytes
        self.reject_nonfinite = reject_nonfinite
        self._finite_exempt: frozenset[str] = frozenset()  # kinds whose receiver checks
        self.stats = TransportStats()
        self.inbox = Inbox(rank, PendingMessages(max_bytes=max_pending_bytes,
                                                 max_messages=max_pending_messages),
                           self.stats, receive=self._recv_frames, accept=self._accept)
        self._send_delay: tuple[float, frozenset[str]] = (0.0, frozenset())
        self.contacts: set[int] = set()  # ranks we sent to or heard from
        self.departed: set[int] = set()  # ranks that said goodbye
        self.linked: set[int] = set()  # ranks we opened a connection to (subclasses keep it)
        # Dead peers, control messages, rejoin. Sends looked up at each call: a wrapped send
        # (fault injection in tests) sees control messages too.
        self.membership = Membership(Network(
            rank=rank, size=size, clock=self.clock, describe=self.describe,
            send=lambda dst, msg: self.send(dst, msg),
            resend=self._send_encoded, wait=self.inbox.wait, never_reached=self._never_reached,
            restarted=self._restarted, discard_before=self.inbox.pending.discard_before,
            moved=self._moved, departed=lambda: self.departed,
            farewell=lambda dst: self.send(dst, Message(kind=BYE, round=-1))))
        self.waits = Waits(rank, self.send)  # a lockstep wait on a live peer, deadlocks
        self._sends = SendWatch(rank=rank, clock=self.clock, timeout=timeout,
                                describe=self.describe, check=self._check_delivery)

    # -- subclass hooks -------------------------------------------------------------------
    @abstractmethod
    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False,
                     received: Sequence = ()) -> list:
        """Queue one multipart message for ``dst``; with ``track``, return handles whose
        ``wait(timeout)`` returns once the transport no longer reads the tensors.
        ``received``: per frame, the received frame holding the same bytes, or None."""

    @abstractmethod
    def _recv_frames(self, timeout: float) -> list | None:
        """The next multipart message from anyone, or None after ``timeout`` seconds.
        Its frames are the receiver's own, writable memory: strategies update received
        buffers in place and send them on."""

    @abstractmethod
    def close(self, linger: float = 0.0) -> None:
        """Release every socket, giving unsent messages at most ``linger`` seconds."""

    def describe(self, rank: int) -> str:
        """How to name ``rank`` in an error message."""
        return f"peer {rank}"

    def _sender(self, frames: list) -> int | None:
        """The rank that authenticated the connection ``frames`` came over, if known."""
        return None

    def _heard(self, frames: list, msg: Message) -> None:
        """Called for every accepted message (goodbyes included), e.g. to track connections."""

    def _internal(self, msg: Message) -> None:
        """Handle a message of one of ``own_kinds``."""

    def _moved(self, rank: int, endpoint: str) -> None:
        """``rank`` restarted listening at ``endpoint`` (its join said): reach it there."""

    def _restarted(self, rank: int) -> None:
        """``rank`` restarted (it asked to rejoin): forget its old process's set-up."""

    def _poll_liveness(self) -> bool:
        """Read what is known of the peers' connections; True if a peer was just judged dead."""
        return False

    def _link_up(self, rank: int) -> bool:
        """Whether this transport's own control path (not the algorithm's messages) shows
        ``rank``'s process running now; False where it cannot tell."""
        return False

    def _starting(self, rank: int) -> bool:
        """Whether ``rank``'s link has not come up yet but may still: we started connecting
        less than ``dead_after`` ago (peers start seconds apart: importing torch alone takes
        ~2 s). False where the transport cannot tell."""
        return False

    def _never_reached(self) -> set[int]:
        """Peers we connected to whose connection never came up in the time a dead peer is
        given: no process listens at their address (a restarted peer uses it to fail fast
        when its job has finished)."""
        return self._unreached() & self.linked

    def _unreached(self) -> set[int]:
        """Every peer whose connection never came up in that time, connected to or not (a
        leaving peer awaits no goodbye from them)."""
        return set()

    def connect(self, ranks) -> None:
        """Open the connections to ``ranks`` now rather than at the first send, so that a
        peer dying before we ever send to it is noticed too."""

    def unlink(self, ranks) -> None:
        """This peer no longer works with ``ranks`` (an elastic view moved its edges): their
        deaths are not its to notice, and leaving says them no goodbye (both ends of an edge
        install the same view). A later message links again."""
        for rank in ranks:
            self.linked.discard(rank)
            self.contacts.discard(rank)

    def close_links(self, ranks) -> None:
        """``ranks`` are out of the run for good (a view dropped them; ids are never reused):
        unlink them and release what connects this peer to them."""
        self.unlink(ranks)

    # -- public API -----------------------------------------------------------------------
    def accept_kinds(self, kinds: Sequence[str], *, receiver_checks_finite: bool = False) -> None:
        """Also accept messages of these kinds from now on.

        ``receiver_checks_finite``: the receiver raises on a NaN/Inf result itself, so
        their frames skip the per-message NaN/Inf check (one read of the result instead of
        one per hop).
        """
        self.kinds = (self.kinds or frozenset()) | frozenset(kinds)
        if receiver_checks_finite:
            self._finite_exempt |= frozenset(kinds)

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s process runs now, judged from the transport's control path
        (ZeroMQ: our link to it is up, answering heartbeats), never from the algorithm's
        messages: a peer computing for minutes is alive. False if it left, is lost, or the
        transport cannot tell (loopback)."""
        return (rank not in self.departed and rank not in self.membership.firsthand()
                and self._link_up(rank))

    def delay_sends(self, seconds: float, kinds) -> None:
        """Fault injection: sleep ``seconds`` (on this transport's clock) before sending any
        message of ``kinds`` (a slow sender; other kinds, e.g. control messages and the
        consensus probe, go at once)."""
        self._send_delay = (seconds, frozenset(kinds))

    def send(self, dst: int, msg: Message, *, track: bool = False) -> Delivery:
        """Queue ``msg`` for ``dst`` and return at once; the message may still be in flight.

        Large tensors are sent zero-copy: do not modify them until ``.wait()`` on the
        returned Delivery (only meaningful with ``track=True``) has returned.
        A buffer of a received message sent on (forwarded, changed in place or not) and not
        tracked goes out as the frame it arrived in, by reference: the cheapest send there is,
        and the same rule holds, since that frame's memory is the buffer's.
        """
        delay, delayed = self._send_delay
        if delay and msg.kind in delayed:
            self.clock.sleep(delay)
        header, frames = codec.encode(msg, self.rank)
        trackers = self._send_frames(dst, header, frames, track,
                                     codec.received_frames(msg, frames))
        self.contacts.add(dst)
        if msg.kind not in INTERNAL and msg.kind not in self.own_kinds:
            self.waits.sent[dst] += 1
        self.stats.sent(msg.kind, len(header) + sum([f.numel() for f in frames]))
        self.membership.sent(dst, msg.kind, msg.round, header, frames)
        return Delivery(self._sends, dst, trackers, msg.kind)

    def recv(
        self,
        *,
        src: int | None = None,
        kind: str | None = None,
        round: int | None = None,
        timeout: float | None = None,
    ) -> Message:
        """The oldest message matching every given field; others are kept for later calls.

        A lockstep receive (``src`` given, default timeout) waits as long as ``src`` is
        alive (busy, not dead) unless a message was rejected meanwhile; it gives up on a
        deadlock instead (transport/waits.py).

        Raises:
            PeerTimeout: nothing matching arrived within ``timeout`` (default: self.timeout),
                or (lockstep) this peer waits in a cycle of peers each waiting for the next.
            PeerGone: it never will: ``src`` is dead or left (its goodbye came first), or
                (all-peer kinds) any peer is dead.
            CollectiveAborted: an all-peer round abandoned because a peer rejoined.
        """
        if round is not None:
            self.at_round(round)
        kept = self.inbox.take(src, kind, round)
        if kept is not None:
            return kept
        if src is not None and timeout is None:  # lockstep: waits on while src is alive
            self.waits.begin(src)
        try:
            return self._wait(src, kind, round, self.timeout if timeout is None else timeout)
        finally:
            self.waits.end()

    def _wait(self, src, kind, round, limit: float) -> Message:
        clock, waits = self.clock, self.waits
        deadline = clock.monotonic() + limit
        rejected_before = self.stats.messages_rejected
        while True:
            self.membership.check(src, kind, round)
            if waits.cycle is not None:
                raise PeerTimeout(f"rank {self.rank}: deadlock waiting for the {kind or 'message'} "
                                  f"of round {round} from {self.describe(src)}: "
                                  f"{describe_cycle(self.rank, waits.cycle, self.describe)}")
            if src in self.departed:  # per-pair FIFO: what it sent before its goodbye is here
                raise PeerGone(f"rank {self.rank}: {self.describe(src)} left the run (said "
                               f"goodbye) without sending the {kind or 'message'} of round "
                               f"{round if round is not None else 'any'} this peer waits for"
                               f"{self.stats.rejected_since(rejected_before)}", rank=src)
            start = clock.monotonic()
            frames = self._recv_frames(max(deadline - start, 0.0))
            self.stats.wait_s += clock.monotonic() - start
            if frames is None and deadline > clock.monotonic():
                continue  # woken early: a peer was declared dead
            if frames is None:
                alive = waits.on is not None and self.alive(src)
                if (waits.on is not None and self.stats.messages_rejected == rejected_before
                        and (alive or self._starting(src))):
                    # Busy, not dead: ask for cycles. Or not up yet: still starting, maybe.
                    if alive and waits.probe():
                        log.info("rank %d: waiting beyond %g s for %s, which is alive (busy)",
                                 self.rank, limit, self.describe(src))
                    deadline = clock.monotonic() + limit
                    continue
                who = self.describe(src) if src is not None else "any peer"
                raise PeerTimeout(
                    f"rank {self.rank}: no {kind or 'message'} from {who} for round "
                    f"{round if round is not None else 'any'} within {limit:g} s"
                    f"{self.stats.rejected_since(rejected_before)}")
            msg = self._accept(frames, want=(src, kind, round))
            if msg is not None:
                return msg

    def at_round(self, round: int) -> None:
        """This peer works on ``round`` now (as a ``recv`` of it says): kept messages too far
        behind it expire."""
        if round > self.membership.round:
            self.membership.round = round
            self.inbox.expire(round)

    def shutdown(self, timeout: float = 10.0, flush: float = 1.0) -> set[int]:
        """Say goodbye to every contact and every peer linked to, wait for the contacts'
        goodbyes (goodbye.py), then close. Only our own goodbyes may still be queued: they get
        ``flush`` seconds, so closing never blocks for long. Returns the peers that did not
        say goodbye, or could not be told, within ``timeout`` (dead, stuck, never started)."""
        try:
            return leave(Leaving(
                rank=self.rank, clock=self.clock, describe=self.describe,
                contacts=self.contacts, departed=self.departed, linked=self.linked,
                lost=lambda: set(self.membership.lost), unreached=self._unreached,
                dead=self.membership.firsthand(),
                say_goodbye=lambda dst: self.send(dst, Message(kind=BYE, round=-1)),
                wait=lambda t: self.inbox.wait(t, keep=False),
                link_up=self._link_up), timeout)
        finally:
            self.close(linger=flush)

    # -- internals ------------------------------------------------------------------------
    def _send_encoded(self, dst: int, kind: str, header: bytes, frames: list) -> None:
        """Send an encoded message as it is (a replay, a message of ``own_kinds``) and
        count it."""
        self._send_frames(dst, header, frames)
        self.stats.sent(kind, len(header) + sum(f.numel() for f in frames))

    def _check_delivery(self, dst: int, kind: str) -> None:
        self._poll_liveness()
        self.membership.check_delivery(dst, kind)

    def _accept(self, frames: list, *, want: tuple | None = None,
                keep: bool = True) -> Message | None:
        """Decode, check and count one received message and handle the transport's own
        kinds; return it if it matches ``want`` ``(src, kind, round)``, else keep it for a
        later receive (with ``keep``) and return None.

        Everything is checked before anything changes: a rejected message changes nothing
        but the rejection counters, the bytes under ``"<rejected>"`` and the log.
        """
        size = codec.frame_bytes(frames)
        self.stats.bytes_recv += size
        try:
            msg = codec.decode(frames, kinds=self._accepted_kinds(),
                               max_message_bytes=self.max_message_bytes, peers=self.size,
                               sender=self._sender(frames), finite=self.reject_nonfinite,
                               finite_exempt=self._finite_exempt)
            internal = msg.kind in INTERNAL or msg.kind in self.own_kinds
            if msg.kind in CONTROL:
                self.membership.validate(msg)
            elif msg.kind == PROBE:
                validate_probe(msg, self.size)
            elif msg.kind in self.own_kinds:
                self._validate_internal(msg)
            wanted = want is not None and _matches(msg, *want)
            refusal = (None if internal or wanted or not keep
                       else self.inbox.pending.refusal(msg, size))
            if refusal is not None:
                raise ProtocolError(refusal)
        except ProtocolError as exc:
            self.reject(f"{exc} ({size} bytes)", nbytes=size)
            return None
        except Exception as exc:  # noqa: BLE001 - a missed check must not let bytes crash a peer
            self.reject(f"undecodable message: {type(exc).__name__}: {exc} ({size} bytes)",
                        nbytes=size)
            return None
        self.stats.received(msg.kind, size)
        self._heard(frames, msg)
        self.contacts.add(msg.src)
        if msg.kind == BYE:
            self.departed.add(msg.src)
        elif msg.kind in CONTROL:
            self.membership.control(msg)
        elif msg.kind == PROBE:
            self.waits.handle(msg)
        elif msg.kind in self.own_kinds:
            self._internal(msg)
        else:
            self.waits.heard[msg.src] += 1  # read: it can no longer wake a wait on its sender
            if wanted:
                return msg
            if keep:
                self.inbox.pending.keep(msg, size)
        return None

    def _accepted_kinds(self) -> frozenset[str] | None:
        """The kinds a received message may have: ``kinds`` and the transport's own (None:
        any), made once per value of ``kinds`` rather than per message."""
        kinds, accepted = self._accepted
        if kinds is not self.kinds:
            accepted = self.kinds and self.kinds | INTERNAL | self.own_kinds
            self._accepted = (self.kinds, accepted)
        return accepted

    def _validate_internal(self, msg: Message) -> None:
        """Raise ProtocolError if a message of one of ``own_kinds`` is malformed."""

    def reject(self, reason: str, *, nbytes: int = 0, quiet: bool = False) -> None:
        """Log and count a dropped message (or refused connection); the peer keeps going.

        ``nbytes``: size of a dropped message whose bytes are counted but no kind's.
        ``quiet``: log at debug level only (a repeat of a reason logged moments ago).
        """
        self.stats.rejected(nbytes)
        self.stats.rejections.append(reason)
        log.log(logging.DEBUG if quiet else logging.WARNING, "rank %d: rejected message: %s",
                self.rank, reason)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _matches(msg: Message, src: int | None, kind: str | None, round: int | None) -> bool:
    return ((src is None or msg.src == src) and (kind is None or msg.kind == kind)
            and (round is None or msg.round == round))
