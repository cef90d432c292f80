"""Who is still in the run: dead peers, telling the others, and a restarted peer's rejoin.

Control messages (kinds accepted by every transport, handled inside it, never returned by
``recv``):

* ``ctl.gone {rank, why[, relay]}``: the sender declared ``rank`` dead (its own evidence: its
  link to it broke and stayed broken). Sent to every other peer, so that all-peer exchanges
  (ring all-reduce, sparse all-reduce, the consensus probe) stop everywhere instead of
  waiting for a message that depends on the dead peer. To the dead peer itself it says "I
  dropped you": if it is in fact alive, it drops the sender too, so no edge is used by one
  end only. In an elastic run a death is told once: each peer that notices it first-hand
  sends it (``relay``) to the view's coordinator only, which tells the others the first time
  it hears of it (``Epochs.audience``): O(P) messages a death, where every noticer telling
  every rank was O(P^2) at 1,000 peers.
* ``ctl.join {round, endpoint?}``: the sender restarted from its checkpoint of ``round``,
  listening at ``endpoint`` if it moved (a rendezvous gave it a new address).
* ``ctl.welcome {round, lost, dropped, restarting}``: the answer: the round this peer is at,
  the peers it knows to be lost, whether it had already dropped the sender, and whether it is
  itself rejoining (then ``round`` is its checkpoint's: a whole job restarting together).
* ``ctl.resume {round, skip}``: the restarted sender runs from ``round`` on; all-peer
  exchanges of rounds <= ``skip`` are abandoned everywhere (they mixed two incarnations).
  The receiver re-sends the messages it kept for the sender from ``round`` on.
* ``ctl.state``, ``ctl.view``, ``ctl.leave``: an elastic run's agreement on its next view,
  and a member leaving it (epochs.py).

What a recv raises follows from two sets: first-hand losses stop a recv from that very peer
(``PeerGone``); any loss at all (also one only heard of) stops a recv of an all-peer kind.
A gossip strategy thus only ever drops a neighbour on its own evidence; a report from a
third peer can stop an all-reduce, which could not have finished anyway, and nothing else.
In an elastic run (``elastic``) only a loss among the current view's members stops one: the
survivors agree on a view without the dead and run their all-peer exchanges on it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gossip.clock import Clock
from gossip.errors import CollectiveAborted, PeerGone, ProtocolError, RejoinError
from gossip.transport.epochs import KINDS as VIEW_KINDS
from gossip.transport.epochs import Epochs
from gossip.transport.message import Message

log = logging.getLogger("gossip.transport")

GONE, JOIN, WELCOME, RESUME = "ctl.gone", "ctl.join", "ctl.welcome", "ctl.resume"
CONTROL = frozenset({GONE, JOIN, WELCOME, RESUME}) | VIEW_KINDS
# Messages kept per destination for a neighbour that restarts: a restarted peer resumes at
# most a round or two behind the neighbour furthest ahead of it (docs/ARCHITECTURE.md).
REPLAY_MESSAGES = 3
# All-peer exchanges are abandoned this many rounds past the furthest peer at a rejoin: a
# peer may still be finishing a round when it answers.
SKIP_MARGIN = 2
# A rejoining peer looks this often whether any peer is running at all.
WAKE_S = 0.1


@dataclass(frozen=True)
class Network:
    """What membership asks of its transport, and nothing more.

    Attributes:
        size: Number of ranks (None: unknown, so there is no one to tell or ask).
        describe: How to name a rank in a log line or an error.
        send: ``send(dst, message)``: send a control message; may raise.
        resend: ``resend(dst, kind, header, frames)``: send an encoded message again
            (a replay; the transport counts it).
        wait: ``wait(timeout)``: wait for the next incoming message and handle it, keeping it
            for a later receive unless the transport handles it itself; False if none came.
        never_reached: The ranks whose connection never came up in the time a dead peer is
            given (no process listens at their address).
        restarted: ``restarted(rank)``: forget what was set up with ``rank``'s old process.
        discard_before: ``discard_before(round)``: drop the kept messages of earlier rounds.
        moved: ``moved(rank, endpoint)``: ``rank`` restarted at a new address.
        departed: The ranks that said goodbye (an elastic view goes on without them).
        farewell: ``farewell(rank)``: say goodbye to ``rank`` now (it leaves an elastic run).
    """

    rank: int
    size: int | None
    clock: Clock
    describe: Callable[[int], str]
    send: Callable[[int, Message], Any]
    resend: Callable[[int, str, bytes, list], None]
    wait: Callable[[float], bool]
    never_reached: Callable[[], set[int]]
    restarted: Callable[[int], None]
    discard_before: Callable[[int], Any]
    moved: Callable[[int, str], None] = lambda rank, endpoint: None
    departed: Callable[[], set[int]] = set
    farewell: Callable[[int], None] = lambda rank: None


@dataclass(frozen=True)
class Loss:
    """A peer this one no longer counts on.

    Attributes:
        round: The round this peer was at when it learned of the loss.
        reason: Why, in words.
        firsthand: This peer's own evidence (its link broke, or the peer dropped us), as
            opposed to another peer's report.
    """

    rank: int
    round: int
    reason: str
    firsthand: bool


class Membership:
    """The losses a transport knows of, its control messages and a rejoin's replay buffer."""

    def __init__(self, network: Network):
        self._net = network
        self.lost: dict[int, Loss] = {}
        self.round = -1  # the latest round this peer asked a message for: where it is
        self.skip_through = -1  # all-peer exchanges of rounds <= this are abandoned
        self.collective_kinds: frozenset[str] = frozenset()
        self._replay: dict[int, deque] | None = None  # dst -> (kind, round, header, frames)
        self._welcomes: dict[int, Mapping] = {}
        self._rejoining = False
        self.epochs: Epochs | None = None  # an elastic run's views (``elastic``)
        self._relayed: dict[int, int] = {}  # a death noticed here -> the coordinator told
        self._reachable: Callable[[int], bool] = lambda rank: True  # has an address

    # -- configuration ----------------------------------------------------------------------
    def collective(self, kinds: Iterable[str]) -> None:
        """Messages of ``kinds`` belong to exchanges that need every peer (all-reduce)."""
        self.collective_kinds |= frozenset(kinds)

    def keep_for_rejoin(self) -> None:
        """Keep the last few messages sent to each peer (copies), for a peer that restarts
        from a checkpoint and asks for them again."""
        if self._replay is None:
            self._replay = {}

    def elastic(self, min_peers: int, spares: int = 0, locate=None) -> Epochs:
        """Run all-peer exchanges on agreed views of the members (epochs.py) from now on,
        down to ``min_peers`` members; the last ``spares`` ranks are not members at first
        (they may join). ``locate``, for joiners through a store (rendezvous/meet.py's
        ``Locator``): ``locate(ids)`` learns where those not known yet listen, and
        ``locate.knows(id)`` whether it was: a death is not told to an id nobody has."""
        if locate is not None:
            self._reachable = locate.knows
        if self.epochs is None:
            net = self._net
            self.epochs = Epochs(
                net.rank, range((net.size or 1) - spares), min_peers=min_peers,
                send=self._send_message,
                wait=net.wait, gone=lambda: set(self.lost) | set(net.departed()),
                describe=net.describe, clock=net.clock, farewell=net.farewell,
                **({} if locate is None else {"locate": locate}))
        return self.epochs

    def _counted(self) -> list[int]:
        """The lost peers an all-peer exchange needs: all of them, or the view's members."""
        if self.epochs is None:
            return sorted(self.lost)
        members = self.epochs.view.ids
        return sorted(rank for rank in self.lost if rank in members)

    # -- losses -----------------------------------------------------------------------------
    def firsthand(self) -> set[int]:
        return {rank for rank, loss in self.lost.items() if loss.firsthand}

    def declare_dead(self, rank: int, reason: str) -> None:
        """This peer's own verdict: ``rank`` is dead. Logged once, told to every other peer
        (in an elastic run through the coordinator, unless it was told already)."""
        if rank in self.lost and self.lost[rank].firsthand:
            return
        heard = rank in self.lost
        self.lost[rank] = Loss(rank, self.round, reason, True)
        log.warning("rank %d: %s is dead (noticed at round %d): %s", self._net.rank,
                    self._net.describe(rank), self.round, reason)
        if self.epochs is None:
            self._broadcast(GONE, {"rank": rank, "why": reason}, include=rank)
            return
        if self._reachable(rank):
            self._send(rank, GONE, {"rank": rank, "why": reason})  # "I dropped you"
        if not heard:  # a report came through the coordinator, which told every member
            self._relay(rank, reason)
        self._retell(rank)

    def _relay(self, rank: int, why: str) -> None:
        """Tell the view of ``rank``'s death: every member, as the coordinator; else the
        coordinator, which does. Ids below the coordinator are gone, so a report passed on
        goes to ever lower ids and ends."""
        coordinator = self.epochs.coordinator()
        if coordinator != self._net.rank:
            self._relayed[rank] = coordinator
            self._send(coordinator, GONE, {"rank": rank, "why": why, "relay": True})
            return
        for dst in self.epochs.audience():
            if dst != rank and self._reachable(dst):
                self._send(dst, GONE, {"rank": rank, "why": why})

    def _retell(self, gone: int) -> None:
        """``gone`` is lost: the deaths this peer noticed and told it alone (as the
        coordinator, which may have died before telling the others) go to the next one."""
        for rank, told in list(self._relayed.items()):
            if told == gone:
                del self._relayed[rank]
                self._relay(rank, self.lost[rank].reason)

    def note_lost(self, rank: int, round: int, reason: str) -> None:
        """Count ``rank`` lost on known grounds (e.g. a checkpoint's record), quietly."""
        if rank != self._net.rank and rank not in self.lost:
            self.lost[rank] = Loss(rank, round, reason, True)

    def check(self, src: int | None, kind: str | None, round: int | None) -> None:
        """Raise if the message asked for will never come; see the module docstring."""
        if src is not None:
            loss = self.lost.get(src)
            if loss is not None and loss.firsthand:
                raise self._gone(loss, kind, round)
            if self.epochs is not None and src in self.epochs.gone_for(round):
                raise self._left(src, kind, round)  # it sends nothing after its last round
        if kind is not None and kind in self.collective_kinds:
            if round is not None and round <= self.skip_through:
                raise CollectiveAborted(
                    f"rank {self._net.rank}: {kind} of round {round} was abandoned: a "
                    f"restarted peer rejoined while it was under way (rounds <= "
                    f"{self.skip_through})")
            counted = self._counted()
            if counted:
                raise self._gone(self.lost[counted[0]], kind, round)
            left = self.epochs.gone_for(round) if self.epochs is not None else []
            if left:
                raise self._left(left[0], kind, round)

    def _left(self, rank: int, kind: str | None, round: int | None) -> PeerGone:
        return PeerGone(f"rank {self._net.rank}: {self._net.describe(rank)} left the run "
                        f"after round {self.epochs.leaving[rank]} (waiting for "
                        f"{kind or 'a message'} of round {round})", rank=rank)

    def check_delivery(self, dst: int, kind: str) -> None:
        """Raise if a message sent to ``dst`` will never be read (for Delivery.wait)."""
        loss = self.lost.get(dst)
        if loss is not None and loss.firsthand:
            raise self._gone(loss, kind, None)
        counted = self._counted() if kind in self.collective_kinds else []
        if counted:
            raise self._gone(self.lost[counted[0]], kind, None)

    def _gone(self, loss: Loss, kind: str | None, round: int | None) -> PeerGone:
        waiting = (f" (waiting for {kind or 'a message'} of round "
                   f"{round if round is not None else 'any'})")
        return PeerGone(f"rank {self._net.rank}: {self._net.describe(loss.rank)} is dead, "
                        f"noticed at round {loss.round}: {loss.reason}{waiting}", rank=loss.rank)

    # -- control messages -------------------------------------------------------------------
    def validate(self, msg: Message) -> None:
        """Raise ProtocolError naming what is wrong with a control message's meta; called
        before the message changes anything (counters, contacts)."""
        meta = msg.meta
        try:
            if msg.kind == GONE:
                rank = _int(meta, "rank")
                if self._net.size is not None and not 0 <= rank < self._net.size:
                    raise ValueError(f"rank {rank} is not a peer")
            elif msg.kind == JOIN:
                _int(meta, "round")
                endpoint = meta.get("endpoint", "tcp://")
                if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") \
                        or len(endpoint) > 300:
                    raise ValueError(f"endpoint={endpoint!r} is not tcp://HOST:PORT")
            elif msg.kind == WELCOME:
                _int(meta, "round")
                lost = meta.get("lost")
                if not isinstance(lost, list) or not all(
                        isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0])
                        and _is_int(entry[1]) for entry in lost):
                    raise ValueError(f"lost={lost!r} is not a list of [rank, round]")
            elif msg.kind == RESUME:
                _int(meta, "round")
                _int(meta, "skip")
            elif self.epochs is None:
                raise ValueError("this peer runs no elastic views")
            else:
                self.epochs.validate(msg)
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"{msg.kind} from peer {msg.src}: bad meta: {exc}") from None

    def control(self, msg: Message) -> None:
        """Handle a control message that passed ``validate`` (the transport calls it for
        every one it accepts)."""
        meta, src = msg.meta, msg.src
        if msg.kind == GONE:
            rank, why = meta["rank"], str(meta.get("why", "?"))[:500]
            if rank == self._net.rank:
                if src not in self.lost or not self.lost[src].firsthand:
                    self.lost[src] = Loss(src, self.round, f"it declared this peer dead "
                                          f"({why}) and will not talk to it again", True)
                    log.warning("rank %d: %s dropped this peer: %s", self._net.rank,
                                self._net.describe(src), why)
            elif rank not in self.lost and rank != src:
                self.lost[rank] = Loss(rank, self.round, f"reported by peer {src}: {why}",
                                       False)
                log.info("rank %d: peer %d reports %s dead: %s", self._net.rank, src,
                         self._net.describe(rank), why)
                if self.epochs is not None:
                    if meta.get("relay") is True:  # a noticer's: tell the view
                        self._relay(rank, why)
                    self._retell(rank)
        elif msg.kind == JOIN:
            if "endpoint" in meta:  # before the welcome, which goes there
                self._net.moved(src, meta["endpoint"])
            self._net.restarted(src)
            loss = self.lost.get(src)
            if loss is not None and not loss.firsthand:  # it is back, whoever said not
                del self.lost[src]
                loss = None
            self._send(src, WELCOME, {
                "round": self.round,
                "lost": [[r, loss.round] for r, loss in self.lost.items() if r != src],
                "dropped": bool(loss is not None and loss.firsthand),
                "restarting": self._rejoining})
        elif msg.kind == WELCOME:
            self._welcomes[src] = meta
        elif msg.kind == RESUME:
            self.skip_through = max(self.skip_through, meta["skip"])
            self._replay_to(src, meta["round"])
        elif msg.kind in VIEW_KINDS:
            self.epochs.control(msg)

    def _broadcast(self, kind: str, meta: dict, *, include: int | None = None) -> None:
        for dst in range(self._net.size or 0):
            if dst != self._net.rank and (dst not in self.lost or dst == include) \
                    and self._reachable(dst):
                self._send(dst, kind, meta)

    def _send(self, dst: int, kind: str, meta: dict) -> None:
        self._send_message(dst, Message(kind=kind, round=max(self.round, 0), meta=meta))

    def _send_message(self, dst: int, msg: Message) -> None:
        try:
            self._net.send(dst, msg)
        except Exception as exc:  # noqa: BLE001 - telling others is best effort
            log.warning("rank %d: could not send %s to peer %d: %s", self._net.rank, msg.kind,
                        dst, exc)

    # -- replay -----------------------------------------------------------------------------
    def sent(self, dst: int, kind: str, round: int, header: bytes, frames: list) -> None:
        """Keep a copy of a message just sent, if a restarted peer may ask for it again."""
        if self._replay is None or kind in CONTROL or kind in self.collective_kinds:
            return
        kept = self._replay.get(dst)
        if kept is None:
            kept = self._replay[dst] = deque(maxlen=REPLAY_MESSAGES)
        # Copies: the sender may overwrite its tensors as soon as the send completed.
        kept.append((kind, round, header, [f.clone() for f in frames]))

    def _replay_to(self, dst: int, start: int) -> None:
        kept = (self._replay or {}).get(dst, ())
        for kind, round, header, frames in list(kept):
            if round >= start:
                self._net.resend(dst, kind, header, frames)
        log.info("rank %d: re-sent %d message(s) of rounds >= %d to restarted peer %d",
                 self._net.rank, sum(1 for entry in kept if entry[1] >= start), start, dst)

    # -- rejoining --------------------------------------------------------------------------
    def rejoin(self, checkpoint_round: int, choose: Callable[[Mapping[int, int]], int],
               timeout: float, endpoint: str | None = None) -> int:
        """Rejoin running peers after a restart from the checkpoint of ``checkpoint_round``.

        Sends ``join`` to every peer not known lost, waits for every answer, lets ``choose``
        pick the round to resume at from the rounds the answering peers are at, tells them
        (``resume``), and returns that round. Peers that had dropped this one, and the peers
        they know to be lost, are lost to it too. When every other peer is rejoining too (the
        whole job restarted), they all resume at their common checkpoint round instead, for
        any strategy. ``endpoint``: where this peer listens now, if it moved.

        Raises:
            RejoinError: a peer did not answer within ``timeout`` s, a whole job restarts
                from checkpoints of different rounds, or ``choose`` refuses.
        """
        self.round = checkpoint_round
        self._rejoining = True
        try:
            return self._rejoin(checkpoint_round, choose, timeout, endpoint)
        finally:
            self._rejoining = False

    def _rejoin(self, checkpoint_round: int, choose: Callable[[Mapping[int, int]], int],
                timeout: float, endpoint: str | None) -> int:
        net = self._net
        others = [r for r in range(net.size or 0) if r != net.rank and r not in self.lost]
        for dst in others:
            self._send(dst, JOIN, {"round": checkpoint_round,
                                   **({"endpoint": endpoint} if endpoint else {})})
        clock = net.clock
        deadline = clock.monotonic() + timeout
        while set(others) - set(self._welcomes) and clock.monotonic() < deadline:
            # Messages for the rounds to come are kept meanwhile.
            if net.wait(min(max(deadline - clock.monotonic(), 0.0), WAKE_S)):
                continue
            if others and set(others) <= net.never_reached():
                raise RejoinError(
                    f"rank {net.rank}: no peer is running: none of "
                    f"{', '.join(net.describe(r) for r in others)} accepted a connection "
                    f"after its join: the job has finished (or a whole job restarting "
                    f"together was not started within --dead-after of this peer)")
        missing = sorted(set(others) - set(self._welcomes))
        if missing:
            raise RejoinError(f"rank {net.rank}: no answer to its join from "
                              f"{', '.join(net.describe(r) for r in missing)} within {timeout:g} s")
        rounds = {}
        for src, welcome in sorted(self._welcomes.items()):
            if welcome.get("dropped"):
                self.lost[src] = Loss(src, checkpoint_round, "it had declared this peer dead "
                                      "before the restart", True)
            else:
                rounds[src] = int(welcome["round"])
            for entry in welcome["lost"]:
                rank = entry[0] if isinstance(entry, list) and entry else None
                if isinstance(rank, int) and rank != net.rank and rank not in self.lost:
                    # Our links to it will never come up, so we could not tell ourselves.
                    self.lost[rank] = Loss(rank, checkpoint_round,
                                           f"lost before this peer restarted (reported by "
                                           f"peer {src})", True)
        restarting = {src: int(w["round"]) for src, w in self._welcomes.items()
                      if w.get("restarting")}
        if others and len(restarting) == len(others):  # the whole job restarts together
            if set(restarting.values()) != {checkpoint_round}:
                raise RejoinError(
                    f"rank {net.rank}: every peer is restarting, but from checkpoints of "
                    f"different rounds ({checkpoint_round} here, "
                    f"{', '.join(f'{c} on peer {r}' for r, c in sorted(restarting.items()))}); "
                    f"restart them from checkpoints of one round")
            start = checkpoint_round  # nothing was under way: no all-peer round to abandon
        else:
            start = max(choose({r: c for r, c in rounds.items() if r not in self.lost}), 0)
            self.skip_through = max([start, *rounds.values()]) + SKIP_MARGIN
        for dst in sorted(rounds):
            if dst not in self.lost:
                self._send(dst, RESUME, {"round": start, "skip": self.skip_through})
        self.round = start
        # What the old incarnation was sent for earlier rounds is of no use any more.
        net.discard_before(start)
        self._welcomes.clear()
        return start


def _int(meta: Mapping, key: str) -> int:
    value = meta.get(key)
    if not _is_int(value):
        raise TypeError(f"{key}={value!r} is not an int")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
