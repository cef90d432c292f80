"""A churn schedule (`gossip launch --churn join@10,leave:3@20,kill:5@30`): peers joining,
leaving and killed during an elastic run, and the record of its membership over time.

``join@R`` starts a peer on the next spare rank (after the initial ones, in the schedule's
order) with ``--join`` once some peer recorded R rounds; ``leave:K@R`` sends rank K SIGTERM
(it leaves after its round under way) and ``kill:K@R`` SIGKILL, once K itself recorded R
rounds. Each event is appended to ``membership.jsonl`` in the run directory as it happens;
a kill is a death the run injected, not a failure. A joiner still waiting for a view once
every peer that trained has ended (a join too near the end, or a process that started after
the members closed: nobody reads its asks) gets SIGTERM: it gives up and exits 0.

``random:PCT%/N`` draws such a schedule (``expand``): in every N rounds, PCT% of the initial
peers change, half of them joins, the other half leaving and killed in turn, at rounds and
of ranks drawn with the run's seed.
"""

from __future__ import annotations

import json
import math
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gossip.errors import ConfigError
from gossip.launching.processes import PeerProcess, rounds_done, send_signal

ACTIONS = {"join": None, "leave": signal.SIGTERM, "kill": signal.SIGKILL}
FORM = "ACTION[:RANK]@ROUND, e.g. join@10,leave:3@20,kill:5@30"


@dataclass(frozen=True)
class Event:
    """One change: ``action`` of ``rank`` (a join's: the spare rank it runs on) at ``round``."""

    action: str
    rank: int
    round: int


def parse(text: str, peers: int) -> list[Event]:
    """The events of ``text`` for a run of ``peers`` initial peers, in round order.

    Raises:
        ConfigError: one line naming the item at fault.
    """
    events, joins = [], 0
    for item in (part.strip() for part in text.split(",")):
        what, at, when = item.partition("@")
        action, colon, rank = what.partition(":")
        if not at or not when.isdigit() or int(when) < 1:
            raise ConfigError(f"--churn: {item!r} is not {FORM} (ROUND >= 1)")
        if action not in ACTIONS:
            raise ConfigError(f"--churn: {action!r} in {item!r} is not one of "
                              f"{', '.join(ACTIONS)}")
        if action == "join":
            if colon:
                raise ConfigError(f"--churn: {item!r}: a join takes no rank (it runs on the "
                                  f"next spare one)")
            events.append(Event(action, peers + joins, int(when)))
            joins += 1
        elif not rank.isdigit():
            raise ConfigError(f"--churn: {item!r} names no rank ({action}:RANK@ROUND)")
        else:
            events.append(Event(action, int(rank), int(when)))
    ranks = peers + joins
    for event in events:
        if event.action != "join" and event.rank >= ranks:
            raise ConfigError(f"--churn: {event.action}:{event.rank}@{event.round}: no rank "
                              f"{event.rank} (ranks 0..{ranks - 1}, joiners included)")
    gone = [e.rank for e in events if e.action != "join"]
    if len(set(gone)) < len(gone):
        raise ConfigError(f"--churn: a rank leaves or is killed twice ({text})")
    if len(gone) >= ranks:
        raise ConfigError(f"--churn: every peer would leave or be killed ({text})")
    return sorted(events, key=lambda e: e.round)


RANDOM = "random:"
RANDOM_FORM = "random:PCT%/ROUNDS, e.g. random:10%/100"
LAST = 3  # a drawn event comes at least this many rounds before the end (a join's margin)


def expand(text: str, peers: int, rounds: int, seed: int) -> str:
    """``text``, or the schedule ``random:PCT%/N`` draws for ``peers`` initial peers and
    ``rounds`` rounds with ``seed`` (see the module docstring), as items ``parse`` reads.
    A joiner may be drawn to leave or be killed from the next period on; at least two
    peers stay.

    Raises:
        ConfigError: one line naming what is wrong with the form.
    """
    if not text.startswith(RANDOM):
        return text
    share, slash, period = text[len(RANDOM):].partition("/")
    try:
        fraction = float(share.removesuffix("%")) / 100
    except ValueError:
        fraction = -1.0
    if not share.endswith("%") or not slash or not period.isdigit() or int(period) < 1 \
            or not 0 < fraction <= 1:
        raise ConfigError(f"--churn: {text!r} is not {RANDOM_FORM} (0 < PCT <= 100)")
    period, changes = int(period), max(1, round(fraction * peers))
    draw = random.Random(seed)
    present, spare, items = list(range(peers)), peers, []
    for start in range(0, rounds, period):
        last = min(start + period, rounds - LAST)
        if last <= start:
            break
        joined = list(range(spare, spare + changes // 2))
        spare += len(joined)
        items += [f"join@{draw.randint(start + 1, last)}" for _ in joined]
        gone = draw.sample(present, min(changes - len(joined), len(present) - 2))
        items += [f"{'leave' if i % 2 == 0 else 'kill'}:{rank}@{draw.randint(start + 1, last)}"
                  for i, rank in enumerate(gone)]
        gone_now = set(gone)
        present = [rank for rank in present if rank not in gone_now] + joined
    if not items:
        raise ConfigError(f"--churn: {text!r} draws no event in {rounds} rounds (the last "
                          f"{LAST} have none)")
    return ",".join(items)


def joins_in(text: str) -> int:
    """How many joins ``text`` schedules (before it can be parsed: they size the topology)."""
    return sum(part.strip().startswith("join") for part in text.split(","))


def joiners(events: Sequence[Event]) -> list[int]:
    """The spare ranks the schedule's joins run on."""
    return [e.rank for e in events if e.action == "join"]


class Schedule:
    """The schedule's events, each due once its round is reached (``due``) and then appended
    to the membership record; what doing one means is the runner's (processes here, greenlets
    in the simulator: gossip/sim/churn.py).

    Args:
        events: From ``parse``.
        log_path: Where each event is appended as a JSON line (None: nowhere).
        clock: The seconds each line records (since the start): wall time for processes,
            virtual time in a simulation.
    """

    def __init__(self, events: Sequence[Event], log_path: Path | None,
                 clock: Callable[[], float] = time.monotonic):
        self.pending = list(events)
        self.log_path, self.clock = log_path, clock
        self.began = clock()

    def due(self, reached: int, progress: Callable[[int], float | None]) -> list[Event]:
        """The events due now, in schedule order, each recorded and no longer pending.
        ``reached``: the most rounds any peer recorded; ``progress(rank)``: the rounds that
        rank recorded, None if it has not started, ``math.inf`` once it ended (an event on
        an ended peer is due at once and has nothing left to do)."""
        now = []
        for event in list(self.pending):
            if event.action == "join":
                if reached < event.round:
                    continue
            else:
                done = progress(event.rank)
                if done is None or done < event.round:
                    continue  # a joiner not started yet, or a round not reached
            self.pending.remove(event)
            self._note(event, reached)
            now.append(event)
        return now

    def _note(self, event: Event, reached: int) -> None:
        if self.log_path is None:
            return
        line = {"time": round(self.clock() - self.began, 3), "event": event.action,
                "rank": event.rank, "round": event.round, "reached": reached}
        with open(self.log_path, "a") as out:
            out.write(json.dumps(line) + "\n")


class Churn(Schedule):
    """The schedule of `gossip launch`: a join starts a process, a leave sends SIGTERM, a
    kill SIGKILL (``tick``).

    Args:
        events: From ``parse``.
        start: ``start(rank)``: start a joiner's peer process.
        log_path: Where each event is appended as a JSON line.
    """

    def __init__(self, events: Sequence[Event], start: Callable[[int], PeerProcess],
                 log_path: Path):
        super().__init__(events, log_path)
        self.start = start
        self.killed: set[int] = set()  # ranks the schedule killed: injected deaths
        self.joiners = set(joiners(events))
        self.released: set[int] = set()  # joiners told to give up: the run ended without them

    def watching(self) -> dict:
        """``launch.watch``'s arguments for this schedule (none for an empty one)."""
        return {"tick": self.tick, "injected": self.killed.__contains__} if self.pending else {}

    def tick(self, procs: list[PeerProcess]) -> None:
        """Do every event due (a joiner's process is appended to ``procs``)."""
        running = {p.rank: p for p in procs}
        reached = max((rounds_done(p) for p in procs), default=0)

        def progress(rank: int) -> float | None:
            p = running.get(rank)
            if p is None:
                return None
            return rounds_done(p) if p.process.poll() is None else math.inf

        for event in self.due(reached, progress):
            if event.action == "join":
                procs.append(self.start(event.rank))
            elif running[event.rank].process.poll() is None:
                send_signal(running[event.rank], ACTIONS[event.action])
                if event.action == "kill":
                    self.killed.add(event.rank)
        self._release(procs)

    def _release(self, procs: list[PeerProcess]) -> None:
        """SIGTERM the joiners with no round recorded once every peer that recorded one has
        ended and no join is pending: no view can admit them any more."""
        if any(event.action == "join" for event in self.pending):
            return
        trained = [p for p in procs if p.rank not in self.joiners or rounds_done(p)]
        if not any(rounds_done(p) for p in trained) \
                or any(p.process.poll() is None for p in trained):
            return
        for p in procs:
            if p.rank in self.joiners and p.rank not in self.released \
                    and p.process.poll() is None:
                send_signal(p, ACTIONS["leave"])
                self.released.add(p.rank)
