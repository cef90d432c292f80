"""Membership views of an elastic run: numbered epochs, one agreement per change.

A view V_e = (e, sorted member ids, activation round, what each member had completed) is what
an elastic strategy runs on: a member's slot (its index in the ids) is its rank there, the
number of members its size. Ids are the topology's ranks and are never reused. Epoch 0 is every
rank from round 0.

Without a rendezvous store the agreement goes through the control channel (two kinds handled
inside the transport, never returned by ``recv``):

* ``ctl.state {e, members, lc, lost}``: a member that found its view broken (a collective
  raised PeerGone) tells the coordinator its installed view, the last round it completed
  (``lc``) and the members it knows gone.
* ``ctl.view {e, members, round, acks[, joins, due]}``: the coordinator's decision, sent to
  every member of the new view; a view proposed ahead of its round (``admit``: a join, or
  for gossip a departure) says ``due`` and is installed at that round.
* ``ctl.held {e}``: the answer to a ``due`` view: the sender holds view ``e`` and installs
  it at its round (``admit``: the coordinator waits for it).
* ``ctl.leave {round}``: the sender completed ``round`` and leaves (``leave``): from the next
  round on it counts as gone, but not as dead; the receiver says goodbye to it at once (it
  needs nothing more from it, and the leaver waits for its contacts' goodbyes).
* ``ctl.enter {}``: the sender, a spare id not in any view yet, asks to join (``ask``).
* ``ctl.end {round}``: the sender closed after ``round``, the run's last, and admits nobody
  more (``cancel``): sent to the peers asking to join (at once to one asking later), so a
  joiner no view admitted in time ends cleanly without waiting for every member it asked
  to say goodbye (a dead one never does).

A join is admitted at a round boundary (``admit``): the coordinator, at the start of its round
r, proposes the view with every asking peer added, activated at round r + MARGIN, each joiner
given a donor (the old members round-robin, from the epoch on, so joins spread), and sends it
to every member of it; each member installs it when it starts that round. No member starts
round r + 2 before completing r + 1, which needs the coordinator's input, and the coordinator
sends that only once every old member said it holds the view (``ctl.held``, awaited at the
start of round r + 1): the view travels on another connection than the rounds' messages, so
without the answer a member could start r + 2 on the old view while the others ran the new
one. A message of a newer epoch thus never reaches a receive on an older view.
A coordinator proposes nothing while a join it proposed is not yet installed, so racing joins
get one view each or one view together. A death before the activation drops the scheduled
view (``reform``), and the next agreement's epoch is past it, so no number is used twice; the
joiners still asking are admitted by a later view.

The coordinator is the lowest id of the installed view not known gone, a rule every member
computes from the same evidence (``ctl.gone`` reaches every survivor). It decides once it has a
state from every member not known gone: the base is the newest view any of them installed (one
a coordinator that died half-way through sending it may have given to some), the new members
are the base's minus every member known gone, the new epoch the base's + 1, and the activation
round R + 1 with R the newest round any of them completed. A member takes a view only from a
sender it does not count gone and only of a newer epoch; once it counts the old coordinator
gone it ignores that one's views, so no view number is decided twice among the living. No peer
starts round r+1 before completing r, and r+1 completes nowhere without every member's input,
so the members' ``lc`` differ by at most one: round R was completed by some, and the others
adopt its result from the lowest such id (``View.donor``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gossip.errors import PeerGone, PeerTimeout
from gossip.transport.message import Message

log = logging.getLogger("gossip.transport")

STATE, VIEW, LEAVE, ENTER, END = "ctl.state", "ctl.view", "ctl.leave", "ctl.enter", "ctl.end"
HELD = "ctl.held"
KINDS = frozenset({STATE, VIEW, LEAVE, ENTER, END, HELD})
WAKE_S = 0.05  # how often a member waiting for a view looks whether its coordinator died
MARGIN = 2  # a join's view activates this many rounds after its proposal (spec section 3)


@dataclass(frozen=True)
class View:
    """One epoch's membership.

    Attributes:
        epoch: Its number; grows by one per agreed change.
        members: The member ids, sorted; ``slot(id)`` is the rank a strategy uses.
        round: The first round run on it (a round nobody completed is redone on it).
        acks: Per member, the last round it had completed when the view was agreed.
        joins: Per member that joins with this view, the member that gives it the state of
            round ``round - 1`` (its donor).
    """

    epoch: int
    members: tuple[int, ...]
    round: int = 0
    acks: Mapping[int, int] = field(default_factory=dict)
    joins: Mapping[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.members)

    @functools.cached_property
    def ids(self) -> frozenset[int]:
        """The members as a set: every collective receive asks it of each gone peer (a scan
        of the tuple was most of a 1,000-peer simulation's time)."""
        return frozenset(self.members)

    def slot(self, member: int) -> int:
        return self.members.index(member)

    @property
    def donor(self) -> int | None:
        """The lowest id that completed round ``round - 1`` (its result is adopted by
        those that had not); None when no member is behind."""
        behind = [m for m, lc in self.acks.items() if lc < self.round - 1]
        done = [m for m, lc in self.acks.items() if lc == self.round - 1]
        return min(done) if behind and done else None

    @property
    def behind(self) -> list[int]:
        """Members that had not completed round ``round - 1``: they adopt it."""
        return sorted(m for m, lc in self.acks.items() if lc < self.round - 1)

    def as_meta(self) -> dict:
        return {"e": self.epoch, "members": list(self.members), "round": self.round,
                "acks": [[m, lc] for m, lc in sorted(self.acks.items())],
                "joins": [[m, d] for m, d in sorted(self.joins.items())]}


class Epochs:
    """An elastic run's installed view and the agreement on the next one.

    Args:
        rank: This member's id.
        members: Epoch 0's members.
        min_peers: Fewer members than this end the run (PeerGone naming the dead).
        send: ``send(dst, message)``: a control message (best effort).
        wait: ``wait(timeout)``: handle the next incoming message, False if none came.
        gone: The ids known dead or departed (first-hand or reported).
        describe: How to name an id in an error.
        clock: Time reads of the waits.
        farewell: ``farewell(id)``: say goodbye to a member that leaves.
        locate: ``locate(ids)``: learn where ids not known yet listen (joiners through a
            rendezvous store: gossip/rendezvous/meet.py's ``Locator``), before a message
            goes to them.
    """

    def __init__(self, rank: int, members, *, min_peers: int, send: Callable[[int, Message], None],
                 wait: Callable[[float], bool], gone: Callable[[], set[int]],
                 describe: Callable[[int], str], clock,
                 farewell: Callable[[int], None] = lambda member: None,
                 locate: Callable[[list[int]], None] = lambda ids: None):
        self.rank, self.min_peers = rank, min_peers
        self.first = tuple(sorted(members))  # epoch 0's members: whom a joiner asks
        # a joiner's own view is itself alone until it is admitted: no loss among the
        # members it asked stops the receive of its state (only its donor's death does)
        self.view = View(0, self.first if rank in self.first else (rank,))
        # every view installed here, in order (a joiner's from the one admitting it)
        self.history = [self.view] if rank in self.first else []
        self.leaving: dict[int, int] = {}  # member -> the last round it runs
        self._farewell, self._locate = farewell, locate
        self.stale = 0  # messages of older epochs dropped (strategies count them here)
        self.agreements = 0  # views this member decided as coordinator
        self._send, self._wait = send, wait
        self._gone = lambda: gone() | set(self.leaving)
        self._describe, self._clock = describe, clock
        self._states: dict[int, Mapping] = {}  # the coordinator's: member -> its ctl.state
        self._offered: View | None = None  # a newer view from a live coordinator, not yet taken
        self.asking: set[int] = set()  # ids that asked to join and are not members yet
        self.scheduled: View | None = None  # a join's view, installed at its round
        # as the coordinator: its proposal not yet held by every member (view, round proposed)
        self._unheld: tuple[View, int] | None = None
        self._held: set[int] = set()  # members that said they hold it (ctl.held)
        self.queued: list[View] = []  # newer ones, come while it waited: each at its round
        self._passed = 0  # the newest epoch proposed (maybe dropped): numbers never reused
        self.closing = False  # this member runs its closing round: it admits nobody more
        self._last: int | None = None  # as a member closing: the run's last round
        self._closed: int | None = None  # as a joiner: the last round a member said (ctl.end)

    # -- messages (called by Membership) -----------------------------------------------------
    @staticmethod
    def validate(msg: Message) -> None:
        """Raise ValueError or TypeError naming what is wrong with ``msg``'s meta."""
        meta = msg.meta
        if msg.kind in (LEAVE, END):
            _ints(meta, "round")
            return
        if msg.kind == ENTER:
            return
        _ints(meta, "e")
        if msg.kind == HELD:
            return
        members = meta.get("members")
        if not isinstance(members, list) or not members or not all(_is_int(m) for m in members):
            raise ValueError(f"members={members!r} is not a list of ids")
        if msg.kind == STATE:
            _ints(meta, "lc")
            lost = meta.get("lost")
            if not isinstance(lost, list) or not all(_is_int(m) for m in lost):
                raise ValueError(f"lost={lost!r} is not a list of ids")
        else:
            _ints(meta, "round")
            acks = meta.get("acks")
            if not isinstance(acks, list) or not all(
                    isinstance(a, list) and len(a) == 2 and _is_int(a[0]) and _is_int(a[1])
                    for a in acks):
                raise ValueError(f"acks={acks!r} is not a list of [id, round]")
            joins = meta.get("joins", [])
            if not isinstance(joins, list) or not all(
                    isinstance(j, list) and len(j) == 2 and j[0] in members and j[1] in members
                    for j in joins):
                raise ValueError(f"joins={joins!r} is not a list of [member, donor]")

    def control(self, msg: Message) -> None:
        meta = msg.meta
        if msg.kind == STATE:
            self._states[msg.src] = meta
            return
        if msg.kind == ENTER:
            if msg.src not in self.view.members and self._located([msg.src]):
                self.asking.add(msg.src)
                if self.closing:
                    self._end([msg.src])
            return
        if msg.kind == END:
            self._closed = meta["round"]
            return
        if msg.kind == HELD:
            if self._unheld is not None and self._unheld[0].epoch == meta["e"]:
                self._held.add(msg.src)
            return
        if msg.kind == LEAVE:
            self.leaving[msg.src] = meta["round"]
            log.warning("rank %d: %s leaves after round %d", self.rank,
                        self._describe(msg.src), meta["round"])
            self._farewell(msg.src)
            return
        view = View(meta["e"], tuple(sorted(meta["members"])), meta["round"],
                    {m: lc for m, lc in meta["acks"]}, {m: d for m, d in meta.get("joins", [])})
        if msg.src in self._gone() or view.epoch <= max(self.view.epoch, self._passed):
            log.info("rank %d: ignored view %d from peer %d (installed %d)", self.rank,
                     view.epoch, msg.src, self.view.epoch)
            return
        if not self._located(view.members):
            return  # the coordinator's next view (a death) or join (asked again) goes on
        if view.joins or meta.get("due") is True:  # installed at its round, not at once
            if self.scheduled is not None and self.rank not in view.joins \
                    and view.round > self.scheduled.round:
                # its coordinator installed the one scheduled here and proposed the next (a
                # gossip member may be diam rounds behind it, a joiner wait for its state):
                # install both, in order
                self.queued.append(view)
            else:
                self.scheduled = view
            self._passed = view.epoch
            self._send(msg.src, Message(HELD, max(view.round, 0), meta={"e": view.epoch}))
        elif self._offered is None or view.epoch > self._offered.epoch:
            self._offered = view

    def _located(self, ids) -> bool:
        """Whether every one of ``ids`` can be reached (``locate``); a failure is logged."""
        try:
            self._locate(list(ids))
            return True
        except Exception as exc:  # noqa: BLE001 - a store that failed: this change waits
            log.warning("rank %d: cannot reach peer(s) %s: %s", self.rank, list(ids), exc)
            return False

    def coordinator(self) -> int:
        """The lowest id of the installed view not known gone (this member's knowledge):
        who agrees on the next view, and who tells the others of a death."""
        gone = self._gone()
        return min((m for m in self.view.members if m not in gone), default=self.rank)

    def audience(self) -> list[int]:
        """Whom news of the membership concerns: the members of the installed view and of
        one scheduled, and the peers asking to join, less those known gone and this one."""
        return sorted({*self.view.members, *self._coming(), *self.asking} - self._gone()
                      - {self.rank})

    def _coming(self) -> set[int]:
        """The members of the views scheduled, not installed yet."""
        return {m for view in self._pending() for m in view.members}

    def _pending(self) -> list[View]:
        """The views scheduled, in the order of their rounds."""
        return ([self.scheduled] if self.scheduled is not None else []) + self.queued

    def gone_for(self, round: int | None) -> list[int]:
        """Members that left before ``round`` (any round, for None), sorted."""
        return sorted(m for m, last in self.leaving.items()
                      if m in self.view.ids and (round is None or round > last))

    def note_left(self, member: int, last: int) -> None:
        """``member`` left after round ``last`` (a joiner's donor's word)."""
        if member != self.rank:
            self.leaving.setdefault(member, last)

    def leave(self, last: int) -> None:
        """This member completed round ``last`` and leaves: tell every other member, those
        of a join's view not installed yet too (its joiner would wait in that view's first
        round for this member)."""
        for dst in sorted({*self.view.members, *self._coming()}):
            if dst != self.rank and dst not in self._gone():
                self._send(dst, Message(LEAVE, max(last, 0), meta={"round": last}))

    # -- joins ----------------------------------------------------------------------------------
    def ask(self) -> None:
        """As a spare id: ask epoch 0's members to join."""
        for dst in self.first:
            self._send(dst, Message(ENTER, 0, meta={}))

    def admit(self, round: int, *, timeout: float, margin: int = MARGIN,
              departures: bool = False) -> View | None:
        """At the start of ``round``: install the view due now (returned), or, as the
        coordinator, propose one for the peers asking (installed ``margin`` rounds later),
        or, in the round after proposing it, wait up to ``timeout`` s until every old member
        holds it (``ctl.held``; see the module docstring). With ``departures`` (gossip, whose
        members drop a gone neighbour by themselves meanwhile) it also proposes one without
        the members known gone (dead or left)."""
        view = self.scheduled
        if view is not None and view.round <= round:
            while self.queued and self.queued[0].round <= round:  # due too: the newest wins
                view = self.queued.pop(0)
            self.scheduled = self.queued.pop(0) if self.queued else None
            self.asking -= set(view.members)
            return self._install(view)
        if self._unheld is not None and round > self._unheld[1]:
            if self._unheld[0] is view:  # else dropped (reform) or cancelled meanwhile
                self._await_held(view, timeout)
            self._unheld = None
        gone = self._gone()
        alive = [m for m in self.view.members if m not in gone]
        joiners = sorted(self.asking - set(self.view.members) - gone)
        departed = departures and len(alive) < self.view.size
        if view is not None or self.closing or not (joiners or departed) or not alive \
                or min(alive) != self.rank:
            return None
        if departed:
            self._check_enough(alive + joiners, self.view.members)
        epoch = max(self.view.epoch, self._passed) + 1
        view = View(epoch, tuple(sorted(alive + joiners)), round + margin,
                    joins={j: alive[(epoch + i) % len(alive)] for i, j in enumerate(joiners)})
        for dst in view.members:
            if dst != self.rank:
                self._send(dst, Message(VIEW, max(round, 0), meta={**view.as_meta(),
                                                                   "due": True}))
        log.warning("rank %d: proposed view %d admitting %s, without %s, from round %d",
                    self.rank, epoch, joiners, sorted(set(self.view.members) - set(alive)),
                    view.round)
        self.agreements += 1
        self.scheduled, self._passed = view, epoch
        self._unheld, self._held = (view, round), set()
        return None

    def _await_held(self, view: View, timeout: float) -> None:
        """As the coordinator: wait until every member of ``view`` but its joiners (which
        run nothing before their state comes) said it holds it, or is known gone; after
        ``timeout`` s go on, logged (a silent member is dead or about to be found so)."""
        deadline = self._clock.monotonic() + timeout
        while True:
            silent = set(view.members) - set(view.joins) - self._held - self._gone() \
                - {self.rank}
            if not silent:
                return
            if self._clock.monotonic() >= deadline:
                log.warning("rank %d: view %d: no word that %s hold it within %g s; going on",
                            self.rank, view.epoch, sorted(silent), timeout)
                return
            self._wait(WAKE_S)

    def admission(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> View | None:
        """As a joiner: wait for the newest view that admits this id (not installed: its
        donor's state comes first); None once the run ended before admitting it
        (``ended``), or once ``stop()`` (this peer was asked to leave: it gives up).

        Raises:
            PeerTimeout: no view admitted it within ``timeout`` s.
        """
        deadline = self._clock.monotonic() + timeout
        while self.scheduled is None or self.rank not in self.scheduled.joins:
            if self.ended() or stop():
                return None
            if self._clock.monotonic() >= deadline:
                raise PeerTimeout(f"rank {self.rank}: no view admitted this peer within "
                                  f"{timeout:g} s (asked {list(self.first)})")
            self._wait(WAKE_S)
        return self.scheduled

    def cancel(self, last: int) -> None:
        """As a member closing after round ``last``: admit nobody more, and drop a join's
        view not installed yet. Every member closes after the same last round, so all drop
        it (its joiner, if its state came, runs no round). The other peers asking are told
        the run ended (``ctl.end``): no view can admit them now."""
        handed = set()  # a view due right after the last round: its donors sent the state
        if self.scheduled is not None and self.scheduled.round == last + 1:
            handed = set(self.scheduled.joins)
        self.scheduled, self.queued, self.closing, self._last = None, [], True, last
        self._end(sorted(self.asking - set(self.view.members) - handed))

    def _end(self, joiners) -> None:
        for dst in joiners:
            self._send(dst, Message(END, max(self._last, 0), meta={"round": self._last}))

    def withdraw(self, view: View) -> None:
        """As a joiner: leave ``view`` before its first round (its donor died before sending
        the state): its members count this peer gone from that round on."""
        self.forget(view)
        for dst in view.members:
            if dst != self.rank and dst not in self._gone():
                self._send(dst, Message(LEAVE, max(view.round - 1, 0),
                                        meta={"round": view.round - 1}))

    def forget(self, view: View) -> None:
        """As a joiner: ``view``'s donor died before sending; wait for a newer view."""
        if self.scheduled == view:
            self.scheduled, self.queued = None, []

    def ended(self) -> bool:
        """As a joiner: whether the run is over for it: a member said it closed (``ctl.end``)
        and no view admits this peer by the round after the last (whose donor sends the
        state before closing), or every member it asked has gone."""
        if self._closed is not None:
            view = self.scheduled
            if view is None or self.rank not in view.joins or view.round > self._closed + 1:
                return True
        return set(self.first) <= self._gone()

    def install(self, view: View) -> View:
        """As a joiner: run on ``view`` (from ``admission``) from now on."""
        return self._install(view)

    # -- agreement ------------------------------------------------------------------------------
    def reform(self, completed: int, timeout: float) -> View:
        """Agree with the other survivors on the next view and install it; ``completed``:
        the last round this member completed.

        Raises:
            PeerGone: fewer than ``min_peers`` members are left, or this member is not in
                the view agreed (the others counted it dead).
            PeerTimeout: no view was agreed within ``timeout`` s.
        """
        clock = self._clock
        deadline = clock.monotonic() + timeout
        told = None
        if self.scheduled is not None:  # a join not installed yet: dropped, asked again later
            log.warning("rank %d: dropped view %d (a join) for the agreement on a death",
                        self.rank, self.scheduled.epoch)
            self.scheduled, self.queued = None, []
        while True:
            if self._offered is not None:
                view, self._offered = self._offered, None
                return self._install(view)
            gone = self._gone()
            alive = [m for m in self.view.members if m not in gone]
            self._check_enough(alive, self.view.members)
            coordinator = min(alive)
            # e: past any join proposed; v: the view installed (a join's, where it was)
            state = {"e": max(self.view.epoch, self._passed), "v": self.view.epoch,
                     "members": list(self.view.members), "lc": completed,
                     "lost": sorted(gone & set(self.view.members))}
            if coordinator == self.rank:
                self._states[self.rank] = state
                view = self._decide(gone)
                if view is not None:
                    for dst in view.members:
                        if dst != self.rank:
                            self._send(dst, Message(VIEW, max(completed, 0), meta=view.as_meta()))
                    self.agreements += 1
                    return self._install(view)
            elif told != coordinator:
                self._send(coordinator, Message(STATE, max(completed, 0), meta=state))
                told = coordinator
            if clock.monotonic() >= deadline:
                raise PeerTimeout(f"rank {self.rank}: no view after epoch {self.view.epoch} "
                                  f"agreed within {timeout:g} s (coordinator "
                                  f"{self._describe(coordinator)})")
            self._wait(WAKE_S)

    def _decide(self, gone: set[int]) -> View | None:
        """The next view, once every member not known gone sent its state; else None."""
        states = dict(self._states)
        for state in states.values():
            gone = gone | set(state["lost"])
        base = max(states.values(), key=lambda s: (s["e"], s.get("v", s["e"])))
        members = [m for m in sorted(base["members"]) if m not in gone]
        if any(m not in states for m in members):
            return None
        acks = {m: states[m]["lc"] for m in members}
        self._check_enough(members, base["members"])
        return View(base["e"] + 1, tuple(members), max(acks.values()) + 1, acks)

    def _check_enough(self, members, before) -> None:
        """Raise PeerGone naming the gone if fewer than ``min_peers`` ``members`` are left."""
        if len(members) < self.min_peers:
            dead = sorted(set(before) - set(members))
            raise PeerGone(f"rank {self.rank}: {len(members)} peer(s) left, fewer than "
                           f"min_peers={self.min_peers}: "
                           f"{', '.join(self._describe(m) for m in dead)} gone", rank=dead[0])

    def _install(self, view: View) -> View:
        if self.rank not in view.members:
            raise PeerGone(f"rank {self.rank}: the others went on without this peer (view "
                           f"{view.epoch}: {list(view.members)})", rank=self.rank)
        # what changed, not the members: a 1,000-id list from every member was ~5 MB a view
        before = set(self.view.members if self.history else view.members) - (
            set() if self.history else {self.rank})  # a joiner: only itself joined
        log.warning("rank %d: view %d: %d peer(s) from round %d, joined %s, gone %s",
                    self.rank, view.epoch, view.size, view.round,
                    sorted(set(view.members) - before), sorted(before - set(view.members)))
        self.view = view
        self.history.append(view)
        self._states.clear()
        # Views scheduled but not newer are dropped: the one installed (a joiner's), or a
        # join's view that reached this member during an agreement on a death, which numbered
        # past it (installed at its round, it would undo this one)
        later = [pending for pending in self._pending() if pending.epoch > view.epoch]
        self.scheduled, self.queued = (later[0], later[1:]) if later else (None, [])
        return view


def _ints(meta: Mapping, key: str) -> None:
    if not _is_int(meta.get(key)):
        raise TypeError(f"{key}={meta.get(key)!r} is not an int")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
