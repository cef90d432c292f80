"""An elastic run's views (gossip/transport/epochs.py) driven message by message, in the
orders that real runs met under load: a join's view overtaken by a death's agreement, a join's
view reaching a member after the rounds' messages."""

from __future__ import annotations

import dataclasses
import logging

from gossip.clock import ManualClock
from gossip.transport.epochs import END, ENTER, HELD, VIEW, Epochs, View
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
        assert member.epochs.admit(round, timeout=5.0) is None
    assert member.epochs.view == death and member.epochs.scheduled is None
    assert [view.epoch for view in member.epochs.history] == [0, 2]


def proposing_coordinator() -> tuple[Member, View]:
    """Rank 0 of members 0-3 with spare 4 asking: it proposes view 1 at round 2."""
    coordinator = Member(0)
    coordinator.epochs.control(Message(ENTER, 0, src=4))
    assert coordinator.epochs.admit(2, timeout=5.0) is None
    view = coordinator.epochs.scheduled
    assert (view.epoch, view.members, view.round, set(view.joins)) == (1, tuple(range(5)), 4,
                                                                      {4})
    assert sorted(dst for dst, msg in coordinator.sent if msg.kind == VIEW) == [1, 2, 3, 4]
    return coordinator, view


def held(view: View, src: int) -> Message:
    return Message(HELD, view.round, src=src, meta={"e": view.epoch})


def test_a_member_says_it_holds_a_due_view():
    member = Member(2)
    join = View(1, (0, 1, 2, 3, 4), round=4, joins={4: 1})
    member.epochs.control(view_message(join, 0, due=True))
    assert member.epochs.scheduled == join
    assert [(dst, msg.kind, dict(msg.meta)) for dst, msg in member.sent] == [
        (0, HELD, {"e": 1})]


def test_the_coordinator_sends_the_round_before_a_view_once_every_member_holds_it():
    """Its input to round 3 is what lets anybody start round 4, the view's: until members 1-3
    say they hold the view (not the joiner: it runs nothing before its state), it waits."""
    coordinator, view = proposing_coordinator()
    coordinator.arrivals = [held(view, 1), held(view, 4), held(view, 3), held(view, 2)]
    assert coordinator.epochs.admit(3, timeout=5.0) is None
    assert coordinator.arrivals == [] and coordinator.waits == 4
    assert coordinator.epochs.admit(4, timeout=5.0) == view  # installed at its round


def test_the_coordinator_waits_for_no_member_known_gone_and_not_past_its_timeout(caplog):
    coordinator, view = proposing_coordinator()
    coordinator.arrivals = [held(view, 1), lambda: coordinator.gone.add(3)]
    with caplog.at_level(logging.WARNING, logger="gossip.transport"):
        assert coordinator.epochs.admit(3, timeout=2.0) is None
    assert coordinator.clock.monotonic() >= 2.0
    assert "view 1: no word that [2] hold it within 2 s; going on" in caplog.text
    caplog.clear()
    waited = coordinator.clock.monotonic()
    assert coordinator.epochs.admit(4, timeout=2.0) == view  # waited once, in round 3 only
    assert coordinator.clock.monotonic() == waited and "no word" not in caplog.text


def test_a_view_dropped_before_its_round_is_not_waited_for():
    coordinator, view = proposing_coordinator()
    coordinator.epochs.cancel(2)  # the run closed after round 2
    assert coordinator.epochs.admit(3, timeout=5.0) is None and coordinator.waits == 0
    assert [msg.kind for dst, msg in coordinator.sent if dst == 4][-1] == END
