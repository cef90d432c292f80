"""Elastic runs at scale (issue 28: 1,000 simulated peers with 10% churn per 100 rounds): a
death is told once through the coordinator, a view install closes the links it dropped, and
a member behind its coordinator installs every view in order."""

from __future__ import annotations

import logging
import re
from collections import Counter

import networkx as nx
from click.testing import CliRunner

from gossip.cli import main
from gossip.clock import ManualClock
from gossip.config import TrainConfig
from gossip.launching.churn import parse
from gossip.sim import Simulation, simulate_run
from gossip.sim.transport import SimWorld
from gossip.topology import Topology, generators
from gossip.transport.epochs import VIEW
from gossip.transport.membership import GONE, Membership, Network
from gossip.transport.message import Message


def _membership(rank: int, size: int, sent: list, spares: int = 0) -> Membership:
    network = Network(rank=rank, size=size, clock=ManualClock(),
                      describe=lambda r: f"peer {r}",
                      send=lambda dst, msg: sent.append((dst, msg)),
                      resend=lambda *args: None, wait=lambda timeout: False,
                      never_reached=set, restarted=lambda r: None,
                      discard_before=lambda r: None)
    membership = Membership(network)
    membership.elastic(min_peers=1, spares=spares)
    return membership


def _gone(sent: list) -> list[tuple[int, int, bool]]:
    """(destination, dead rank, relay asked) of each ctl.gone sent."""
    return [(dst, msg.meta["rank"], msg.meta.get("relay") is True) for dst, msg in sent
            if msg.kind == GONE]


def test_a_death_is_told_to_the_coordinator_which_tells_every_member_once():
    sent: list = []
    noticer = _membership(5, 10, sent)
    noticer.declare_dead(7, "its link broke")
    # "I dropped you" to the dead one, the news to the coordinator (the lowest live id)
    assert _gone(sent) == [(7, 7, False), (0, 7, True)]

    sent.clear()
    coordinator = _membership(0, 10, sent)
    relay = Message(GONE, 3, meta={"rank": 7, "why": "its link broke", "relay": True}, src=5)
    coordinator.control(relay)
    assert sorted(dst for dst, rank, _ in _gone(sent)) == [1, 2, 3, 4, 5, 6, 8, 9]
    sent.clear()
    coordinator.control(Message(GONE, 3, meta=relay.meta, src=6))  # a second noticer
    coordinator.declare_dead(7, "its link broke")  # and its own evidence
    assert _gone(sent) == [(7, 7, False)]  # nobody is told twice


def test_a_noticer_tells_the_next_coordinator_when_the_one_it_told_dies():
    sent: list = []
    noticer = _membership(5, 10, sent)
    noticer.declare_dead(7, "its link broke")
    sent.clear()
    # the coordinator it told died (maybe before telling anyone): the next one hears it
    noticer.control(Message(GONE, 3, meta={"rank": 0, "why": "gone"}, src=2))
    assert _gone(sent) == [(1, 7, True)]


def test_a_report_asked_of_a_member_goes_on_down_to_its_coordinator():
    sent: list = []
    member = _membership(3, 10, sent)
    member.control(Message(GONE, 3, meta={"rank": 0, "why": "gone"}, src=2))
    assert _gone(sent) == []  # a plain report: nothing to pass on
    member.control(Message(GONE, 3, meta={"rank": 8, "why": "gone", "relay": True}, src=9))
    assert _gone(sent) == [(1, 8, True)]  # it thought 3 coordinated; 1 does


def _view(epoch: int, members, round: int, joins=()) -> Message:
    return Message(VIEW, 0, src=0, meta={"e": epoch, "members": list(members), "round": round,
                                         "acks": [], "joins": [list(j) for j in joins],
                                         "due": True})


def test_a_member_behind_installs_each_view_proposed_in_order():
    """A gossip member may be diam rounds behind the coordinator, which installs a view and
    proposes the next at once: the newer one came before the older one's round here and
    replaced it, so this member skipped a view its neighbours ran on."""
    epochs = _membership(4, 8, []).epochs
    epochs.control(_view(1, range(7), 10))
    epochs.control(_view(2, range(6), 20))
    assert epochs.admit(9, timeout=5.0) is None
    assert epochs.admit(10, timeout=5.0).epoch == 1
    assert epochs.admit(19, timeout=5.0) is None
    assert epochs.admit(20, timeout=5.0).epoch == 2
    assert epochs.scheduled is None and epochs.queued == []


def test_a_joiner_waiting_for_its_state_keeps_the_next_view_for_after_its_own():
    joiner = _membership(7, 8, [], spares=1).epochs
    joiner.control(_view(1, range(8), 10, joins=[(7, 2)]))
    joiner.control(_view(2, [0, 1, 2, 4, 5, 6, 7], 20))  # the next, without 3
    admitted = joiner.admission(1.0)
    assert admitted.epoch == 1
    joiner.install(admitted)
    assert joiner.scheduled.epoch == 2
    assert joiner.admit(20, timeout=5.0).epoch == 2
    # a view admitting it again (the members dropped the first) replaces the one waited on
    again = _membership(7, 8, [], spares=1).epochs
    again.control(_view(1, range(8), 10, joins=[(7, 2)]))
    again.control(_view(3, range(8), 30, joins=[(7, 4)]))
    assert again.admission(1.0).epoch == 3 and again.queued == []


def test_a_gossip_joiner_whose_donor_dies_before_its_state_leaves_the_view(tmp_path):
    """dpsgd on a ring of 5 (a view activates 2 diam + 2 = 6 rounds after its proposal):
    the joiner's donor is killed before it sends the state. The members install the view
    anyway (no agreement in gossip); the joiner leaves it before its first round, so they
    drop it as a departure instead of waiting for it (and then declaring it dead)."""
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 16, "batch_size": 8,
                                    "seed": 3, "elastic": True, "spares": 1,
                                    "dead_after": 0.5, "timeout": 30,
                                    "delays": {"compute": 0.1}})
    run = simulate_run(config, Topology.generate("ring", 6), tmp_path, Simulation(),
                       churn=parse("join@1,kill:1@4", 5), write=False)
    assert run.failed == {} and run.killed == [1]
    assert run.records[5] == []  # it ran no round
    for rank in (0, 2, 3, 4):
        assert max(line["round"] for line in run.records[rank]) == 15
    assert run.virtual_s < 10  # nobody sat out a timeout


def test_at_40_peers_a_kill_costs_o_p_messages_and_the_views_close_its_links(tmp_path,
                                                                            monkeypatch, caplog):
    """dpsgd on an exponential graph of 40 (degree ~10), two kills, a leave and two joins:
    each death is noticed first-hand by the peers linked to the dead one (its neighbours
    and a few the control messages linked since the last view), not by every peer that ever
    told of one; ctl.gone messages are O(P) a kill (they were noticers x ranks); once a
    view dropped a peer, no survivor is linked to it any more."""
    transports = []
    made = SimWorld.transport

    def keep(world, rank, **kwargs):
        transport = made(world, rank, **kwargs)
        transports.append(transport)
        return transport

    monkeypatch.setattr(SimWorld, "transport", keep)
    events = parse("join@2,kill:5@3,leave:9@5,join@9,kill:20@14", 40)
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 30, "batch_size": 8,
                                    "seed": 3, "elastic": True, "spares": 2,
                                    "dead_after": 0.5, "timeout": 30,
                                    "delays": {"compute": 0.1}})
    with caplog.at_level(logging.WARNING, logger="gossip"):
        run = simulate_run(config, Topology.generate("exponential", 42), tmp_path,
                           Simulation(probe="oracle"), churn=events, write=False)
    assert run.failed == {} and run.killed == [5, 20]
    noticed = Counter(int(m[1]) for m in re.finditer(r"peer (\d+) is dead \(noticed",
                                                       caplog.text))
    assert set(noticed) == {5, 20}
    assert noticed[20] <= 16, noticed  # after a view: its neighbours (degree ~12) and few more
    gone = sum(stats["by_kind"].get(GONE, {}).get("messages_sent", 0)
               for stats in run.stats.values())
    assert gone <= 2 * 3 * 42, gone  # noticers + P per kill; it was ~noticers x 42
    for transport in transports:
        if transport.rank not in (5, 9, 20):
            assert not {5, 9, 20} & (transport.linked | transport.contacts), transport.rank


def test_a_torus_without_rows_and_cols_takes_the_views_shape_at_its_size(tmp_path):
    """``--graph torus --peers N``: a run whose spares the seed draws (``--churn random:``)
    has no rows x cols to give; its torus is the one a view of N members takes."""
    assert nx.utils.graphs_equal(Topology.generate("torus", 12).graph,
                                 generators.torus(rows=3, cols=4))
    assert nx.utils.graphs_equal(Topology.generate("torus", 7).graph,
                                 generators.near_torus(7))  # the circulant: 7 is prime
    out = CliRunner().invoke(main, [
        "simulate", "--graph", "torus", "--peers", "6", "--strategy", "dpsgd", "--elastic",
        "--churn", "random:40%/4", "--rounds", "8", "--batch-size", "8", "--dead-after", "0.5",
        "--compute-delay", "0.1", "--quiet", "--run-dir", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    assert "8 simulated peers, torus-8" in out.output
