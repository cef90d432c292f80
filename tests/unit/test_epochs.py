"""An elastic run's views (gossip/transport/epochs.py) driven message by message, in the
orders that real runs met under load: a join's view overtaken by a death's agreement."""

from __future__ import annotations

import dataclasses

from gossip.clock import ManualClock
from gossip.transport.epochs import VIEW, Epochs, View
from gossip.transport.message import Message


@dataclasses.dataclass
class Member:
    """One member's Epochs, its sends recorded, its waits delivering ``arrivals`` in turn
    (each a message, or a callable run then)."""

    rank: int
    members: range = range(4)
    gone: set = dataclasses.field(default_factory=set)
    arrivals: list = dataclasses.field(default_factory=list)
    sent: list = dataclasses.field(default_factory=list)
    waits: int = 0

    def __post_init__(self):
        self.clock = ManualClock()
        self.epochs = Epochs(self.rank, self.members, min_peers=1,
                             send=lambda dst, msg: self.sent.append((dst, msg)),
                             wait=self.wait, gone=lambda: set(self.gone), describe=str,
                             clock=self.clock)

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        if not self.arrivals:
            self.clock.advance(timeout)
            return False
        arrival = self.arrivals.pop(0)
        if callable(arrival):
            arrival()
        else:
            self.epochs.control(arrival)
        return True


def view_message(view: View, src: int, **extra) -> Message:
    return Message(VIEW, view.round, src=src, meta={**view.as_meta(), **extra})


def test_a_join_view_that_comes_during_a_deaths_agreement_is_not_installed_after_it():
    """Rank 2 died while the coordinator's join view (1, due at round 5) was on its way to
    rank 3, which got it only while agreeing on the death: the agreed view 2 numbers past it,
    and round 5 runs on view 2 (installing view 1 then ran rank 3 on a view with the dead
    member, its messages of epoch 1 among the others' of epoch 2)."""
    member = Member(3, gone={2})
    join = View(1, (0, 1, 2, 3, 4), round=5, joins={4: 1})
    death = View(2, (0, 1, 3), round=3, acks={0: 2, 1: 2, 3: 2})
    member.arrivals = [view_message(join, 0, due=True), view_message(death, 0)]
    assert member.epochs.reform(2, timeout=5.0) == death
    for round in range(3, 7):
        assert member.epochs.admit(round) is None
    assert member.epochs.view == death and member.epochs.scheduled is None
    assert [view.epoch for view in member.epochs.history] == [0, 2]
