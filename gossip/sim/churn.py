"""A churn schedule in a simulation (`gossip simulate --elastic --churn ...`): the schedule of
`gossip launch` (gossip/launching/churn.py: the same syntax, parser and membership.jsonl),
done to greenlets in virtual time.

``join@R`` starts the spare rank's peer (its ``Trainer.enter``) once some peer recorded R
rounds; ``leave:K@R`` is peer K's ``request_leave`` once it recorded R rounds, so it leaves
right after its R-th round; ``kill:K@R`` stops K's greenlet then, as ``--kill`` does (its
links go dead: the others find it after ``dead_after`` virtual seconds). Each line's time is
virtual seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gossip.launching.churn import Event, Schedule
from gossip.sim.transport import SimWorld


class SimChurn(Schedule):
    """The schedule's events done in ``world`` as the peers record their rounds
    (``recorded``).

    Args:
        events: From ``gossip.launching.churn.parse``.
        world: The simulation.
        start: ``start(rank)``: spawn a joiner's peer.
        peers: Each running peer's ``Peer`` by rank (a leave asks it to leave).
        log_path: membership.jsonl (None: not written).
    """

    def __init__(self, events: Sequence[Event], world: SimWorld, start: Callable[[int], None],
                 peers: Mapping[int, object], log_path: Path | None):
        super().__init__(events, log_path, clock=lambda: world.scheduler.now)
        self.world, self.start, self.peers = world, start, peers
        self.rounds: dict[int, int] = {}  # rounds each peer recorded
        self.reached = 0

    def recorded(self, rank: int, round: int) -> None:
        """Peer ``rank`` recorded ``round``: do every event due now."""
        self.rounds[rank] = round + 1
        self.reached = max(self.reached, round + 1)
        if self.pending:
            for event in self.due(self.reached, self._progress):
                self._do(event)

    def _progress(self, rank: int) -> float | None:
        task = self.world.tasks.get(rank)
        if task is None:
            return None
        return math.inf if task.done else self.rounds.get(rank, 0)

    def _do(self, event: Event) -> None:
        if event.action == "join":
            self.start(event.rank)
        elif not self.world.tasks[event.rank].done:
            if event.action == "leave":
                peer = self.peers.get(event.rank)
                if peer is not None:  # else it trained every round and is saying goodbye
                    peer.request_leave()
            else:  # once the peer parks: it runs on until then, as a process until the signal
                self.world.kill_at(event.rank, self.world.scheduler.now)
